"""``attnpolicy bench --kernels``: every registered implementation per family, side by side."""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import asdict

import torch

from attnpolicy.bench.kernel_timing import bench_kernels
from attnpolicy.cli.common import print_table, progress
from attnpolicy.core.jsonfile import write_json


def cmd_kernels(args: argparse.Namespace) -> int:
    """Print (and with ``--json`` write) the per-implementation table, labelled with the
    machine and the date."""
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with progress(len(args.lengths) * len(args.seqs), "kernels") as advance:
        for total in args.lengths:
            for n in args.seqs:
                rows += bench_kernels(total, n, heads=args.heads, kv_heads=args.kv_heads,
                                      head_dim=args.head_dim, repeats=args.repeats)
                advance(f"{n}x{total // n}")
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    when = time.strftime("%Y-%m-%d")
    table = [(f"{r.num_seqs}x{r.total_tokens // r.num_seqs}", f"{args.heads}:{r.kv_heads}", r.family, r.impl,
              r.backend, f"{r.median_ms:.2f}", f"{r.vs_loop:.2f}x",
              "" if r.build_ms is None else f"{r.build_ms:.2f}") for r in rows]
    print_table(f"implementations per family vs the per-sequence SDPA loop ({machine}, "
                f"{torch.get_num_threads()} threads, torch {torch.__version__}, {when}; "
                f"median of {args.repeats}, {args.dtype} D={args.head_dim})",
                ("batch", "heads q:kv", "family", "impl", "backend", "median ms", "vs loop", "mask build ms"),
                table)
    if args.json:
        write_json(args.json, {"machine": machine, "date": when, "threads": torch.get_num_threads(),
                               "rows": [asdict(r) for r in rows]})
    return 0
