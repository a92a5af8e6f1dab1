"""The ``attnpolicy`` command line: one module per group of subcommands."""

from __future__ import annotations

import importlib
import sys

from attnpolicy.cli.common import Parser, fail
from attnpolicy.core.version import __version__
from attnpolicy.errors import AttnPolicyError

#: Modules under ``attnpolicy.cli`` that add subcommands through ``register(subparsers)``.
COMMAND_MODULES = ("report", "policies", "simulate", "plan", "replan", "stalls", "calibrate", "run", "bench",
                   "config", "kernels")
#: Subcommands added by a module other than their namesake in :data:`COMMAND_MODULES`.
COMMAND_HOMES = {"decide": "policies"}

EPILOG = """first steps (seconds each):
  attnpolicy decide --policy dynamic --seq-lens 100,200
  attnpolicy simulate --limit 20
then the main job (minutes; --limit 40 for a quick look):
  attnpolicy report --out report"""


def build_parser(command: str | None = None) -> Parser:
    """The parser of every subcommand; ``command``: of that one alone (a command line
    naming it parses the same, without importing the other subcommands' modules)."""
    parser = Parser(prog="attnpolicy", epilog=EPILOG,
                    description="Measure and choose attention mask modes and compiled-graph budgets.")
    parser.add_argument("--version", action="version", version=f"attnpolicy {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMAND_MODULES if command is None else (COMMAND_HOMES.get(command, command),):
        importlib.import_module(f"attnpolicy.cli.{name}").register(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names first (``None``: none, or an option comes first)."""
    if argv and (argv[0] in COMMAND_MODULES or argv[0] in COMMAND_HOMES):
        return argv[0]
    return None


def main(argv: list[str] | None = None) -> int:
    """Run ``attnpolicy`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.
    Every error is one line on stderr, ``attnpolicy: error: ...``, with status 2."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(argv))
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        try:
            return int(args.func(args))
        except AttnPolicyError as exc:
            fail(str(exc))
    except SystemExit as stop:  # --help, --version and every error
        return stop.code if isinstance(stop.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
