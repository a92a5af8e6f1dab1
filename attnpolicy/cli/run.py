"""``attnpolicy run``: replay a workload with real tensors and real compiles."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.cli.common import add_spec_args, print_table, progress
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.measure.batching import BatchFormer
from attnpolicy.measure.replay import run_workload
from attnpolicy.measure.workload import load_trace


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--trace/--limit and the batch former's knobs (shared by run and report)."""
    p.add_argument("--trace", default="default", help="'default' (built-in synthetic) or an Azure CSV path")
    p.add_argument("--limit", type=int, default=None, help="use the first N requests")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-seq-len", type=int, default=8192, help="longest sequence (max_model_len)")


def spec_from(args: argparse.Namespace) -> TensorSpec:
    return TensorSpec(args.dtype, args.heads, args.kv_heads, args.head_dim)


def former_from(args: argparse.Namespace) -> BatchFormer:
    return BatchFormer(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_seq_len)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="replay a workload through the Dispatcher with real compute")
    add_workload_args(p)
    add_spec_args(p)
    p.add_argument("--config", help="a saved attnpolicy config (dir or file); flags below override it")
    p.add_argument("--policy", default=None)
    p.add_argument("--max-graphs", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--eviction", default=None)
    p.add_argument("--backend", default=None, help="inductor | aot_eager | eager | none")
    p.add_argument("--impl", default=None, help="attn_impl: sdpa | eager | flash")
    p.add_argument("--check", action="store_true", help="compare every output with the reference")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=cmd_run)


def config_from(args: argparse.Namespace) -> AttnPolicyConfig:
    base = AttnPolicyConfig.load(args.config).model_dump() if args.config else {}
    overrides = {"policy": args.policy, "max_graphs": args.max_graphs, "max_bytes": args.max_bytes,
                 "eviction": args.eviction, "backend": args.backend, "attn_impl": args.impl}
    base.update({k: v for k, v in overrides.items() if v is not None})
    base.setdefault("max_seq_len", args.max_seq_len)
    # a packed MASK call's keys are every running sequence's context: as in `simulate`
    base.setdefault("max_batch_tokens", max(AttnPolicyConfig().max_batch_tokens,
                                            args.max_num_seqs * base["max_seq_len"]))
    return AttnPolicyConfig.model_validate(base)


def cmd_run(args: argparse.Namespace) -> int:
    config = config_from(args)
    requests = load_trace(args.trace, args.limit)
    steps = list(former_from(args).steps(requests))
    with progress(len(steps), "run") as advance:
        result = run_workload(requests, config, spec_from(args), check=args.check, steps=steps,
                              progress=advance)
    c = result["cache"]
    rows = [("policy", config.policy), ("backend", config.backend), ("batches", result["batches"]),
            ("graph calls", result["calls"]),
            ("modes", ", ".join(f"{m} {n}" for m, n in result["modes"].items())),
            ("hits / misses", f"{c['hits']} / {c['misses']}"), ("compiles", c["compiles"]),
            ("evictions", c["evictions"]), ("peak graph bytes", c["peak_bytes"]),
            ("attention s", result["attention_seconds"]), ("compile s", result["compile_seconds"]),
            ("total s", result["total_seconds"]), ("max abs err", result["max_abs_err"])]
    print_table(f"attnpolicy run: {args.trace}", ("", "value"), rows)
    if args.json:
        write_json(args.json, result)
    return 0
