"""``attnpolicy bench --kernels`` (every registered implementation per call kind, side by
side) and ``attnpolicy kernels check NAME`` (a kernel against the float64 reference in
every case it declares)."""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import asdict
from typing import Any

import torch

from attnpolicy.bench.kernel_timing import bench_kernels
from attnpolicy.cli.common import (
    command,
    print_table,
    progress,
    writing,
)
from attnpolicy.core.jsonfile import write_json
from attnpolicy.plugins.kernels import check_kernel


def register(subparsers: Any) -> None:
    """Add the ``kernels`` subcommand (``kernels check NAME``)."""
    p = subparsers.add_parser("kernels", help="check registered attention kernels",
                              description="Check registered attention kernels.",
                              epilog="example:\n  attnpolicy kernels check sdpa")
    actions = p.add_subparsers(dest="action", metavar="ACTION", title="actions", required=True)
    c = command(actions, "check", "verify a kernel against the float64 reference in every case it declares",
                "attnpolicy kernels check sdpa", cmd_check)
    c.add_argument("name", metavar="NAME", help="a registered kernel, see 'attnpolicy bench --kernels' (required)")


def cmd_check(args: argparse.Namespace) -> int:
    """Print each case checked and ``ok``; a failing case is a one-line error (status 2)."""
    cases = check_kernel(args.name)
    for case in cases:
        print(f"ok  {case}")
    print(f"kernel {args.name!r}: {len(cases)} cases match the float64 reference")
    return 0


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
        with writing("--json", args.json):
            write_json(args.json, {"machine": machine, "date": when, "threads": torch.get_num_threads(),
                                   "rows": [asdict(r) for r in rows]})
    return 0
