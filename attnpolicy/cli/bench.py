"""``attnpolicy bench``: the mask-vs-mask-free table on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.cli.common import (
    add_spec_args,
    int_list,
    print_table,
    progress,
)
from attnpolicy.core.jsonfile import write_json
from attnpolicy.kernels.attention import IMPLS
from attnpolicy.measure.timing import BenchSettings, run_bench, speedups, to_json


def register(subparsers: Any) -> None:
    d = BenchSettings()
    p = subparsers.add_parser("bench", help="time CAUSAL vs MASK (1 sequence) and MASK vs VARLEN (packed)")
    p.add_argument("--lengths", type=int_list, default=d.lengths, metavar="L[,L...]",
                   help="total tokens per call (default: %(default)s)")
    p.add_argument("--seqs", type=int_list, default=d.seqs, metavar="N[,N...]",
                   help="sequences per call, of L/N tokens each (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per mode (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed runs first (default: %(default)s)")
    add_spec_args(p)
    p.add_argument("--impl", choices=IMPLS, default=d.impl)
    p.add_argument("--partition-len", type=int, default=None, help="flash partition (default: whole kv)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write rows and environment as JSON")
    p.add_argument("--overhead", action="store_true",
                   help="instead: time Dispatcher.attend against the bare kernel per backend, policy, batch")
    p.add_argument("--kernels", action="store_true",
                   help="instead: every registered implementation per family against the SDPA loop")
    p.set_defaults(func=cmd_bench)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    for name in ("repeats", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            raise SystemExit(f"attnpolicy bench: error: --{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"attnpolicy bench: error: --kv-heads ({args.kv_heads}) must divide "
                         f"--heads ({args.heads})")
    if args.warmup < 0:
        raise SystemExit(f"attnpolicy bench: error: --warmup must be >= 0, got {args.warmup}")
    bad = [(L, n) for L in args.lengths for n in args.seqs if n > L]
    if bad:
        raise SystemExit(f"attnpolicy bench: error: --seqs {bad[0][1]} exceeds --lengths {bad[0][0]}")
    return BenchSettings(tuple(args.lengths), tuple(args.seqs), args.repeats, args.warmup, args.heads,
                         args.kv_heads, args.head_dim, args.dtype, args.impl, args.partition_len,
                         args.threads)


def cmd_bench(args: argparse.Namespace) -> int:
    s = settings_from(args)
    if args.overhead:
        from attnpolicy.cli.overhead import cmd_overhead

        return cmd_overhead(args)
    if args.kernels:
        from attnpolicy.cli.kernels import cmd_kernels

        return cmd_kernels(args)
    with progress(len(s.lengths) * len(s.seqs), "bench") as advance:
        rows = run_bench(s, advance)
    ratio = {(r["seq_len"], r["num_seqs"]): r for r in speedups(rows)}
    table = []
    for row in rows:
        sp = ratio[(row.seq_len, row.num_seqs)]
        mark = f"{sp['ratio']:.2f}x" if row.mode == sp["faster"] else ""
        table.append((row.seq_len, row.num_seqs, row.mode, row.median_ms, row.min_ms, row.max_ms,
                      row.mask_build_ms, mark))
    print_table(f"attention modes, {s.impl}, {s.dtype}, H={s.heads}/{s.kv_heads} D={s.head_dim}",
                ("L", "seqs", "mode", "median ms", "min ms", "max ms", "mask build ms", "speedup"), table)
    if args.json:
        write_json(args.json, to_json(s, rows))
    return 0
