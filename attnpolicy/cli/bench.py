"""``attnpolicy bench``: the mask-vs-mask-free table on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.bench.mode_timing import NOISY, run_bench, speedups, to_json
from attnpolicy.bench.model_timing import MODEL_LENGTHS
from attnpolicy.bench.settings import BenchSettings
from attnpolicy.cli.common import (
    add_spec_args,
    check_spec_args,
    check_writable,
    command,
    int_list,
    model_spec,
    natural_int,
    positive_int,
    print_table,
    progress,
    settings,
    shown,
    warn,
    writing,
)
from attnpolicy.core.jsonfile import write_json
from attnpolicy.core.names import IMPLS

BENCH_FLAGS = {"kv_heads": "--kv-heads", "seqs": "--seqs", "partition_len": "--partition-len"}


def register(subparsers: Any) -> None:
    d = BenchSettings()
    p = command(subparsers, "bench", "time CAUSAL vs MASK (1 sequence) and MASK vs VARLEN (packed)",
                "attnpolicy bench --lengths 512,2048 --seqs 1,4 --repeats 5", cmd_bench)
    p.add_argument("--lengths", type=int_list, default=None, metavar="L[,L...]",
                   help=f"total tokens per call (default: {shown(d.lengths)}; with --model: "
                        f"{shown(MODEL_LENGTHS)})")
    p.add_argument("--seqs", type=int_list, default=d.seqs, metavar="N[,N...]",
                   help=f"sequences per call, of L/N tokens each (default: {shown(d.seqs)})")
    p.add_argument("--repeats", type=positive_int, default=d.repeats, metavar="N",
                   help=f"timed runs per mode (default: {d.repeats})")
    p.add_argument("--warmup", type=natural_int, default=d.warmup, metavar="N",
                   help=f"untimed runs first (default: {d.warmup})")
    add_spec_args(p)
    p.add_argument("--impl", choices=IMPLS, default=d.impl,
                   help=f"attention implementation (default: {d.impl})")
    p.add_argument("--partition-len", type=positive_int, default=None, metavar="N",
                   help="tokens per KV partition for --impl flash (default: whole kv)")
    p.add_argument("--threads", type=positive_int, default=d.threads, metavar="N",
                   help=f"torch threads, as calibrate's default (default: {d.threads})")
    p.add_argument("--json", metavar="PATH", help="write rows and environment as JSON (default: none)")
    p.add_argument("--overhead", action="store_true",
                   help="instead: time Dispatcher.attend against the bare kernel per backend, policy and "
                        "batch (default: off)")
    p.add_argument("--model", type=model_spec, metavar="SPEC",
                   help="instead: a whole model's forward, CAUSAL vs MASK, one sequence per length, compiled; "
                        "SPEC is qwen3, llama, qwen3:layers=2,hidden=128,... or a local HF directory "
                        "(default: off)")
    p.add_argument("--backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                   help="torch.compile backend of --model (default: inductor)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: every registered implementation per call kind against the SDPA loop "
                        "(default: off)")


def cmd_bench(args: argparse.Namespace) -> int:
    check_writable("--json", args.json)
    if args.model is not None:
        check_spec_args(args, not_with="--model (the model's own heads and head dim, in float32)")
        return cmd_model_bench(args)
    args.lengths = args.lengths or BenchSettings().lengths
    s = settings(BenchSettings, BENCH_FLAGS, lengths=tuple(args.lengths), seqs=tuple(args.seqs), repeats=args.repeats,
                 warmup=args.warmup, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 dtype=args.dtype, impl=args.impl, partition_len=args.partition_len, threads=args.threads)
    if args.overhead:
        from attnpolicy.cli.overhead import cmd_overhead

        return cmd_overhead(args)
    if args.kernels:
        from attnpolicy.cli.kernels import cmd_kernels

        return cmd_kernels(args)
    with progress(len(s.lengths) * len(s.seqs), "bench") as advance:
        rows = run_bench(s, advance)
    ratio = {(sp.seq_len, sp.num_seqs): sp for sp in speedups(rows)}
    table = []
    for row in rows:
        sp = ratio[(row.seq_len, row.num_seqs)]
        mark = f"{sp.faster} {sp.ratio:.2f}× faster" if row.mode == sp.faster else ""
        table.append((row.seq_len, row.num_seqs, row.mode, row.median_ms, row.min_ms, row.max_ms,
                      row.mask_build_ms, mark + (" (noisy)" if mark and sp.noisy else "")))
    print_table(f"attention modes, {s.impl}, {s.dtype}, H={s.heads}/{s.kv_heads} D={s.head_dim}, "
                f"{s.threads} thread(s)",
                ("L", "seqs", "mode", "median ms", "min ms", "max ms", "mask build ms", "speedup"), table,
                caption="speedup: slower median / faster median")
    noisy = [f"L={sp.seq_len} seqs={sp.num_seqs}" for sp in ratio.values() if sp.noisy]
    if noisy:
        warn(f"a median is more than {NOISY:g}× its minimum at {', '.join(noisy)}: the machine was busy, "
             "the speedup is unreliable (rerun with more --repeats)")
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, to_json(s, rows))
    return 0


def cmd_model_bench(args: argparse.Namespace) -> int:
    """``bench --model``: the whole-model table, beside tt-xla's published ratios."""
    from attnpolicy.bench.model_timing import run_model_bench
    from attnpolicy.report.plots import TT_XLA

    lengths = tuple(args.lengths or MODEL_LENGTHS)
    with progress(len(lengths), "bench --model") as advance:
        bench = run_model_bench(args.model, lengths, backend=args.backend, repeats=args.repeats,
                                warmup=args.warmup, threads=args.threads, advance=advance)
    ratios = {r.seq_len: r for r in bench.ratios()}
    table = [(r.seq_len, r.mode, r.compile_s, r.compiled_ms, r.eager_ms, r.rss_mib, r.estimate_mib,
              ratios[r.seq_len].compiled if r.mode == "mask" else None,
              TT_XLA.get(r.seq_len) if r.mode == "mask" else None) for r in bench.rows]
    print_table(f"whole-model forward, 1 sequence, {bench.model}, {bench.backend}, {bench.threads} thread(s)",
                ("L", "mode", "compile s", "compiled ms", "eager ms", "RSS per graph MiB", "estimate MiB",
                 "mask/causal", "tt-xla mask/causal"), table,
                caption="medians of --repeats runs; compile s and RSS: the graph's build (the first build "
                        "in a process also pays the backend's start-up)")
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, bench.to_json())
    return 0
