"""The ``attnpolicy`` command line: one module per group of subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys

from attnpolicy.errors import AttnPolicyError

#: Modules under ``attnpolicy.cli`` that add subcommands through ``register(subparsers)``.
COMMAND_MODULES = ("bench", "policies", "config", "run", "replay", "report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnpolicy",
        description="Measure and choose attention mask modes and compiled-graph budgets.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"attnpolicy.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AttnPolicyError as exc:
        print(f"attnpolicy: error: {exc}", file=sys.stderr)
        return 2
