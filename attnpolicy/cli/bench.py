"""``attnpolicy bench``: the modes side by side on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.bench.mode_timing import (
    MODEL_LENGTHS,
    NOISY,
    AttentionBench,
    BenchRow,
    Ratio,
    WholeModelBench,
    modes_for,
    ratios,
    run_bench,
)
from attnpolicy.bench.settings import BenchSettings
from attnpolicy.cli.common import (
    add_spec_args,
    by_family,
    check_spec_args,
    check_writable,
    command,
    int_list,
    model_spec,
    natural_int,
    not_taken,
    positive_int,
    print_table,
    progress,
    settings,
    shown,
    str_list,
    warn,
    writing,
)
from attnpolicy.core.jsonfile import write_json
from attnpolicy.core.names import IMPLS
from attnpolicy.modelling.cost_file import FAMILIES, Family
from attnpolicy.report.plots import TT_XLA

BENCH_FLAGS = {"kv_heads": "--kv-heads", "seqs": "--seqs", "splits": "--split", "partition_len": "--partition-len"}


def register(subparsers: Any) -> None:
    d = BenchSettings()
    p = command(subparsers, "bench", "time CAUSAL vs MASK vs ROWS (1 sequence) and MASK vs VARLEN vs ROWS (packed)",
                "attnpolicy bench --lengths 512,2048 --seqs 1,4 --repeats 5", cmd_bench)
    p.add_argument("--lengths", type=int_list, default=None, metavar="L[,L...]",
                   help=f"total tokens per call (default: {shown(d.lengths)}; with --model: "
                        f"{shown(MODEL_LENGTHS)})")
    p.add_argument("--seqs", type=int_list, default=d.seqs, metavar="N[,N...]",
                   help=f"sequences per call, splitting L as --split says (default: {shown(d.seqs)})")
    p.add_argument("--split", type=str_list, default=d.splits, metavar="S[,S...]",
                   help="how L is split among N sequences, each timed on its own: equal (L/N each) or spread "
                        "(sequence i about i/(1+...+N) of L, at least 1 token each); one sequence is timed once "
                        f"(default: {shown(d.splits)})")
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
                   help="instead: a whole model's forward over the same shapes and modes, compiled; "
                        "SPEC is qwen3, llama, qwen3:layers=2,hidden=128,... or a local HF directory "
                        "(default: off)")
    p.add_argument("--backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                   help="torch.compile backend of --model (default: inductor)")
    p.add_argument("--family", choices=FAMILIES, default=None,
                   help="the level timed: attention calls, or the whole model's forward (needs --model SPEC) "
                        "(default: model with --model SPEC, else attention)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: every registered implementation per call kind against the SDPA loop "
                        "(default: off)")


def cmd_bench(args: argparse.Namespace) -> int:
    check_writable("--json", args.json)
    level = by_family(args, BENCH_LEVELS, by_model=True)(args)
    if args.overhead:
        from attnpolicy.cli.overhead import cmd_overhead

        return cmd_overhead(args)
    if args.kernels:
        from attnpolicy.cli.kernels import cmd_kernels

        return cmd_kernels(args)
    with progress(len(level.bench.shapes()), level.name) as advance:
        rows = run_bench(level.bench, advance)
    found = ratios(rows, level.bench.measure)
    level.print(rows, found)
    noisy = [f"L={r.seq_len} seqs={r.num_seqs}" + (f" {r.split}" if r.num_seqs > 1 else "") for r in found if r.noisy]
    if noisy:
        warn(f"a median is more than {NOISY:g}× its minimum at {', '.join(noisy)}: the machine was busy, "
             "the ratio is unreliable (rerun with more --repeats)")
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, level.bench.to_json(rows))
    return 0


class _Attention:
    """``bench``: the mask-vs-mask-free table of attention calls."""

    name = "bench"

    def __init__(self, args: argparse.Namespace) -> None:
        args.lengths = args.lengths or BenchSettings().lengths
        self.bench = AttentionBench(settings(
            BenchSettings, BENCH_FLAGS, lengths=tuple(args.lengths), seqs=tuple(args.seqs), repeats=args.repeats,
            warmup=args.warmup, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
            impl=args.impl, partition_len=args.partition_len, threads=args.threads, splits=args.split))

    def print(self, rows: list[BenchRow], found: list[Ratio]) -> None:
        s = self.bench.settings
        ratio = {(r.seq_len, r.num_seqs, r.split): r for r in found}
        table = []
        for row in rows:
            r, j = ratio[(row.seq_len, row.num_seqs, row.split)], self.bench.row_json(row)
            mark = f"{r.faster} {r.ratio:.2f}× faster" if row.mode == r.faster else ""
            table.append((row.seq_len, row.num_seqs, row.split, row.mode, j["median_ms"], j["min_ms"], j["max_ms"],
                          j["mask_build_ms"], mark + (" (noisy)" if mark and r.noisy else "")))
        print_table(f"attention modes, {s.impl}, {s.dtype}, H={s.heads}/{s.kv_heads} D={s.head_dim}, "
                    f"{s.threads} thread(s)",
                    ("L", "seqs", "split", "mode", "median ms", "min ms", "max ms", "mask build ms", "speedup"), table,
                    caption="speedup: of the two fastest modes, slower median / faster median")


class _WholeModel:
    """``bench --model``: the whole-model table, beside tt-xla's published ratios."""

    name = "bench --model"

    def __init__(self, args: argparse.Namespace) -> None:
        check_spec_args(args, not_with="--model (the model's own heads and head dim, in float32)")
        not_taken(args, "with --model (a whole model's forward, not attention calls)", "overhead", "kernels")
        grid = settings(BenchSettings, BENCH_FLAGS, lengths=tuple(args.lengths or MODEL_LENGTHS),
                        seqs=tuple(args.seqs), splits=args.split)
        self.bench = WholeModelBench(args.model, grid.lengths, seqs=grid.seqs, splits=grid.splits,
                                     backend=args.backend, repeats=args.repeats, warmup=args.warmup,
                                     threads=args.threads)

    def print(self, rows: list[BenchRow], found: list[Ratio]) -> None:
        data = self.bench.to_json(rows)
        over = {(r.seq_len, r.num_seqs, r.split): r.over["compiled"] for r in found}
        table = []
        for row in rows:
            j, first = self.bench.row_json(row), modes_for(row.num_seqs)[0].value
            vs = over[(row.seq_len, row.num_seqs, row.split)][row.mode]
            table.append((row.seq_len, row.num_seqs, row.split, row.mode, j["compile_s"], j["compiled_ms"],
                          j["eager_ms"], j["rss_mib"], j["estimate_mib"], None if row.mode == first else
                          f"{vs:.2f}× {first}", TT_XLA.get(row.seq_len) if row.mode == "mask" and row.num_seqs == 1
                          else None))
        print_table(f"whole-model forward, {data['model']}, {data['backend']}, {data['threads']} thread(s)",
                    ("L", "seqs", "split", "mode", "compile s", "compiled ms", "eager ms", "RSS per graph MiB",
                     "estimate MiB", "compiled vs first", "tt-xla mask/causal"), table,
                    caption="medians of --repeats runs; compiled vs first: the mode's compiled median over the "
                            "shape's first mode's; compile s and RSS: the graph's build (the first build in a "
                            "process also pays the backend's start-up; shapes of one graph share its build)")


#: What ``bench`` times per level (--family, or --model SPEC).
BENCH_LEVELS: dict[Family, type[_Attention] | type[_WholeModel]] = {"attention": _Attention, "model": _WholeModel}
