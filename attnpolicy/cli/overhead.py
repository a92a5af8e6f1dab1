"""``attnpolicy bench --overhead``: ``Dispatcher.attend`` against its bare kernel."""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import asdict

import torch

from attnpolicy.bench.overhead import OVERHEAD_BACKENDS, OVERHEAD_POLICIES, SHAPES, measure_decisions, run_overhead
from attnpolicy.cli.common import (
    print_table,
    progress,
    writing,
)
from attnpolicy.core.jsonfile import write_json


def cmd_overhead(args: argparse.Namespace) -> int:
    """Print (and with ``--json`` write) the overhead table, then each policy's time
    per decision on the built-in workload; 1 torch thread unless ``--threads``."""
    threads = args.threads or 1
    repeats = max(args.repeats, 3)
    n = len(OVERHEAD_BACKENDS) * len(OVERHEAD_POLICIES) * len(SHAPES)
    with progress(n, "overhead") as advance:
        rows = run_overhead(threads=threads, advance=lambda: advance(""), heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim, repeats=repeats)
    table = [(r.backend, r.policy, f"{r.num_seqs}x{r.seq_len}", r.mode, r.graph_calls,
              f"{r.bare_us:.1f}", f"{r.attend_us:.1f}", f"{r.overhead_us:+.1f}") for r in rows]
    print_table(f"attend overhead over the bare kernel, µs (median of {repeats} interleaved repeats, "
                f"{threads} thread(s), H={args.heads}/{args.kv_heads} D={args.head_dim}, float32)",
                ("backend", "policy", "batch", "mode", "calls", "bare µs", "attend µs", "overhead µs"),
                table)
    decisions = [measure_decisions(policy) for policy in OVERHEAD_POLICIES]
    print_table(f"time per decision, µs (median over the {decisions[0].decisions} batches of the built-in "
                "workload; cold: new layouts planned inside the decision, warm: planned before)",
                ("policy", "cold µs", "warm µs"),
                [(r.policy, f"{r.cold_us:.1f}", f"{r.warm_us:.1f}") for r in decisions])
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, {"machine": platform.processor() or platform.machine(),
                                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                   "threads": threads, "rows": [asdict(r) for r in rows],
                                   "decisions": [asdict(r) for r in decisions]})
    return 0
