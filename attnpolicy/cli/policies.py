"""``attnpolicy policies`` (registered policies with their options, and evictions) and
``attnpolicy decide`` (run one policy, behind the guard, on a layout given as lengths)."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from attnpolicy.cache.eviction_registry import eviction_registry
from attnpolicy.cli.common import command, int_list, positive_int, print_table
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import FALLBACK_MODES, ON_ILLEGAL
from attnpolicy.errors import ConfigError, LayoutError, PolicyError
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.policies.registry import policy_registry

#: The default of ``decide --max-seq-len``: the config's.
MAX_SEQ_LEN: int = AttnPolicyConfig.model_fields["max_seq_len"].default


def register(subparsers: Any) -> None:
    """Add the ``policies`` and ``decide`` subcommands to an argparse subparsers object."""
    p = command(subparsers, "policies", "list the registered policies (with options) and eviction strategies",
                "attnpolicy policies --json", cmd_policies)
    p.add_argument("--json", action="store_true",
                   help='print JSON: one entry per policy, then per eviction, each with "kind" and '
                        '"options" (default: a table)')

    d = command(subparsers, "decide", "show the (guarded) decision of a policy for one batch",
                "attnpolicy decide --policy dynamic --seq-lens 100,200", cmd_decide)
    d.add_argument("--policy", required=True, metavar="NAME",
                   help="registered policy, see 'attnpolicy policies' (required)")
    d.add_argument("--seq-lens", required=True, type=int_list, metavar="N[,N...]",
                   help="query length of each packed sequence, e.g. 512 or 100,200 (required)")
    d.add_argument("--kv-lens", type=int_list, metavar="N[,N...]",
                   help="key/value length of each sequence, >= its query length: cached context "
                        "(default: the query lengths)")
    d.add_argument("--bidirectional", action="store_true", help="non-causal attention (default: causal)")
    d.add_argument("--max-seq-len", type=positive_int, default=MAX_SEQ_LEN, metavar="N",
                   help="the longest sequence a config serves (max_seq_len): a longer --seq-lens or --kv-lens is "
                        f"refused (default: the config's, {MAX_SEQ_LEN})")
    d.add_argument("--option", action="append", type=_option, default=[], metavar="KEY=VALUE",
                   help="policy option (repeatable); VALUE is parsed as JSON when it can be, "
                        "POLICY:KEY=VALUE is accepted too (default: none)")
    d.add_argument("--on-illegal", choices=ON_ILLEGAL, default="fallback",
                   help="what the guard does with a bad decision (default: fallback)")
    d.add_argument("--fallback", choices=FALLBACK_MODES, default="varlen",
                   help="the guard's safe mode (default: varlen)")
    d.add_argument("--json", action="store_true", help="print JSON (default: one line of text)")


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.rpartition(":")[2]
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def options_of(factory: Callable[..., Any]) -> dict[str, Any]:
    """Keyword options of a class's ``__init__`` (or a factory) and their defaults
    (``None`` for a required one); ``*args``/``**kwargs`` are left out."""
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return {}
    if isinstance(factory, type):
        params = params[1:]  # self
    return {p.name: _json_value(None if p.default is inspect.Parameter.empty else p.default) for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def _json_value(value: Any) -> Any:
    """``value`` if it is plain JSON, else its ``repr`` (``math.inf`` → ``"inf"``)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _summary(factory: Callable[..., Any]) -> str:
    target = factory.func if isinstance(factory, functools.partial) else factory
    return (inspect.getdoc(target) or "").split("\n")[0]


def _shown(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "-"


def cmd_policies(args: argparse.Namespace) -> int:
    policies = sorted(policy_registry().values(), key=lambda i: i.name)
    evictions = sorted(eviction_registry().values(), key=lambda i: i.name)
    if args.json:
        entries = [{"kind": "policy", "name": i.name, "plugin": i.plugin, "description": i.description,
                    "options": options_of(i.cls)} for i in policies]
        entries += [{"kind": "eviction", "name": e.name, "plugin": e.plugin,
                     "description": _summary(e.factory),
                     "options": options_of(e.factory)} for e in evictions]
        print(json.dumps(entries, indent=2, default=repr))
        return 0
    print_table("policies (options: name=default; set with --option POLICY:KEY=VALUE)",
                ("policy", "plugin", "options", "description"),
                [(i.name, i.plugin, _shown(options_of(i.cls)), i.description) for i in policies])
    print_table("eviction strategies (belady: simulation only)", ("eviction", "plugin", "options", "description"),
                [(e.name, e.plugin, _shown(options_of(e.factory)), _summary(e.factory)) for e in evictions])
    return 0


def _error(exc: Exception, code: int) -> int:
    print(f"attnpolicy: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return code


def cmd_decide(args: argparse.Namespace) -> int:
    for flag, lens in (("--seq-lens", args.seq_lens), ("--kv-lens", args.kv_lens or ())):
        longest = max(lens, default=0)
        if longest > args.max_seq_len:
            return _error(ConfigError(f"argument {flag}: {longest} is longer than --max-seq-len {args.max_seq_len}, "
                                      "the longest sequence a config serves"), 2)
    try:
        guard = Guard.for_policy(args.policy, dict(args.option), on_illegal=args.on_illegal,
                                 fallback=MaskMode(args.fallback))
        layout = BatchLayout.from_lens(args.seq_lens, args.kv_lens, causal=not args.bidirectional)
    except (PolicyError, LayoutError) as exc:
        return _error(exc, 2)
    guard_log = logging.getLogger("attnpolicy.policies.guard")
    quiet = guard_log.disabled
    guard_log.disabled = True  # a fallback is reported once, below
    try:
        decision = guard.decide(layout, PolicyContext())
    except PolicyError as exc:
        return _error(exc, 1)
    finally:
        guard_log.disabled = quiet
    result = {"policy": args.policy, "mode": decision.mode.value, "reason": decision.reason,
              "fell_back": guard.fallbacks > 0}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.policy}: {decision.mode.value} ({decision.reason})"
              + (" [guard fell back]" if result["fell_back"] else ""))
    return 0
