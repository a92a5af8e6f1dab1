"""``attnpolicy config show [PATH] [--json]`` (print the resolved config) and
``attnpolicy config validate PATH`` (check a config file or directory)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnpolicy.cli.common import command, fail
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.errors import ConfigError
from attnpolicy.policies.resolve import validate_names


def register(subparsers: Any) -> None:
    """Add the ``config`` command (``show``, ``validate``) to an argparse subparsers object."""
    config = command(subparsers, "config", "show or validate an attnpolicy config",
                     "attnpolicy config validate my_model/  # or: attnpolicy config show --json", _no_command)
    commands = config.add_subparsers(dest="config_command", metavar="show | validate")
    show = command(commands, "show", "print the resolved config (the defaults without PATH)",
                   "attnpolicy config show my_model/attnpolicy_config.json", cmd_show)
    show.add_argument("path", nargs="?", metavar="PATH",
                      help="a config directory (attnpolicy_config.json inside) or file (default: the defaults)")
    show.add_argument("--json", action="store_true",
                      help="print the config file's JSON (default: one field per line)")

    validate = command(commands, "validate", "check a config file or directory; list every bad field",
                       "attnpolicy config validate my_model/", cmd_validate)
    validate.add_argument("path", metavar="PATH",
                          help="a config directory (attnpolicy_config.json inside) or file (required)")


def _no_command(args: argparse.Namespace) -> int:
    fail("argument show | validate: a config command is required")


def _load(path: str | None) -> AttnPolicyConfig:
    """The config at ``path`` (defaults without), its policy and eviction names resolved
    against the installed plugins and its policy_options checked by building the policy."""
    config = AttnPolicyConfig() if path is None else AttnPolicyConfig.load(path)
    try:
        validate_names(config)
    except ConfigError as exc:
        raise ConfigError(f"{path or 'defaults'}: {exc}") from None
    return config


def _error(exc: ConfigError) -> int:
    print(f"attnpolicy: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


def cmd_show(args: argparse.Namespace) -> int:
    try:
        config = _load(args.path)
    except ConfigError as exc:
        return _error(exc)
    if args.json:
        print(config.model_dump_json(indent=2))
        return 0
    data = config.model_dump(mode="json")
    data["buckets"] = config.buckets.describe()
    data["policy_options"] = json.dumps(config.policy_options)
    print(f"# {args.path or 'defaults'}")
    width = max(map(len, data))
    for name, value in data.items():
        print(f"{name:<{width}}  {'null' if value is None else value}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        _load(args.path)
    except ConfigError as exc:
        return _error(exc)
    print(f"valid: {args.path}")
    return 0
