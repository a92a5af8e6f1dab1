"""``attnpolicy policies`` (list registered policies) and ``attnpolicy decide``
(run one policy, behind the guard, on a layout given as lengths)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnpolicy.cli.common import int_list
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import FALLBACK_MODES, ON_ILLEGAL
from attnpolicy.errors import LayoutError, PolicyError
from attnpolicy.plugins.registry import policy_registry
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard


def register(subparsers: Any) -> None:
    """Add the ``policies`` and ``decide`` subcommands to an argparse subparsers object."""
    p = subparsers.add_parser("policies", help="list the registered policies and their plugins")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_policies)

    d = subparsers.add_parser("decide", help="show the (guarded) decision of a policy for a batch")
    d.add_argument("--policy", required=True, help="registered policy name")
    d.add_argument("--seq-lens", required=True, type=int_list, metavar="N[,N...]",
                   help="query length of each packed sequence, e.g. 512 or 100,200")
    d.add_argument("--kv-lens", type=int_list, metavar="N[,N...]",
                   help="key/value length of each sequence (>= its query length: cached context)")
    d.add_argument("--bidirectional", action="store_true", help="non-causal attention")
    d.add_argument("--option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="policy option (repeatable); VALUE is parsed as JSON when it can be")
    d.add_argument("--on-illegal", choices=ON_ILLEGAL, default="fallback",
                   help="what the guard does with a bad decision (default: fallback)")
    d.add_argument("--fallback", choices=FALLBACK_MODES, default="varlen",
                   help="the guard's safe mode (default: varlen)")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=cmd_decide)


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def cmd_policies(args: argparse.Namespace) -> int:
    infos = sorted(policy_registry().values(), key=lambda i: i.name)
    if args.json:
        print(json.dumps([{"name": i.name, "plugin": i.plugin, "description": i.description}
                          for i in infos], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("policy", "plugin", "description")
    for i in infos:
        table.add_row(i.name, i.plugin, i.description)
    Console().print(table)
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    try:
        guard = Guard.for_policy(args.policy, dict(args.option), on_illegal=args.on_illegal,
                                 fallback=MaskMode(args.fallback))
        layout = BatchLayout.from_lens(args.seq_lens, args.kv_lens, causal=not args.bidirectional)
    except (PolicyError, LayoutError) as exc:
        print(f"attnpolicy decide: error: {exc}", file=sys.stderr)
        return 2
    try:
        decision = guard.decide(layout, PolicyContext())
    except PolicyError as exc:
        print(f"attnpolicy decide: error: {exc}", file=sys.stderr)
        return 1
    result = {"policy": args.policy, "mode": decision.mode.value, "reason": decision.reason,
              "fell_back": guard.fallbacks > 0}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.policy}: {decision.mode.value} ({decision.reason})"
              + (" [guard fell back]" if result["fell_back"] else ""))
    return 0
