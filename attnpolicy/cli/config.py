"""``attnpolicy config show [PATH] [--json]`` (print the resolved config) and
``attnpolicy config validate PATH`` (check a config file or directory)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.errors import ConfigError


def register(subparsers: Any) -> None:
    """Add the ``config`` command (``show``, ``validate``) to an argparse subparsers object."""
    config = subparsers.add_parser("config", help="show or validate an attnpolicy config")
    commands = config.add_subparsers(dest="config_command", required=True, metavar="{show,validate}")

    show = commands.add_parser("show", help="print the resolved config (defaults without PATH)")
    show.add_argument("path", nargs="?", metavar="PATH",
                      help="a config directory (attnpolicy_config.json inside) or file")
    show.add_argument("--json", action="store_true", help="print the config file's JSON")
    show.set_defaults(func=cmd_show)

    validate = commands.add_parser("validate", help="check a config file or directory")
    validate.add_argument("path", metavar="PATH",
                          help="a config directory (attnpolicy_config.json inside) or file")
    validate.set_defaults(func=cmd_validate)


def _load(path: str | None) -> AttnPolicyConfig:
    """The config at ``path`` (defaults without), its policy and eviction names resolved
    against the installed plugins and its policy_options checked by building the policy."""
    config = AttnPolicyConfig() if path is None else AttnPolicyConfig.load(path)
    try:
        config.validate_names()
    except ConfigError as exc:
        raise ConfigError(f"{path or 'defaults'}: {exc}") from None
    return config


def _error(exc: ConfigError) -> int:
    print(f"attnpolicy config: error: {exc}", file=sys.stderr)
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
