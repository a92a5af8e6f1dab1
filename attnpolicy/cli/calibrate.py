"""``attnpolicy calibrate``: fit a cost model on this machine."""

from __future__ import annotations

import argparse
import os
from typing import Any

from attnpolicy.bench.calibration import calibrate, shapes, store_shapes
from attnpolicy.bench.calibration_cache import cache_dir, store
from attnpolicy.bench.settings import CalibrationSettings, ModelCalibrationSettings
from attnpolicy.cli.common import (
    add_spec_args,
    by_family,
    check_spec_args,
    check_writable,
    command,
    console,
    fail,
    int_list,
    model_spec,
    positive_int,
    print_table,
    progress,
    settings,
    warn,
    writing,
)
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.cost_file import FAMILIES, CostFile

DEFAULT_COSTMODEL_PATH = "attnpolicy_costmodel.json"
CALIBRATE_FLAGS = {"max_len": "--max-len", "kv_heads": "--kv-heads", "head_dim": "--head-dim", "impl": "--impl",
         "partition_len": "--partition-len", "sizes": "--sizes"}


def register(subparsers: Any) -> None:
    d = CalibrationSettings()
    c = command(subparsers, "calibrate", "measure run, compile and mask-build seconds; write a cost model",
                "attnpolicy calibrate --quick --out model.json && attnpolicy simulate --cost-model model.json",
                cmd_calibrate)
    c.add_argument("--out", default=DEFAULT_COSTMODEL_PATH, metavar="PATH",
                   help="cost-model file to write; the fits of the other family already in it are kept "
                        f"(default: {DEFAULT_COSTMODEL_PATH})")
    c.add_argument("--backend", choices=("aot_eager", "inductor", "eager"), default=d.backend,
                   help=f"compile backend (default: {d.backend})")
    add_spec_args(c)
    c.add_argument("--impl", choices=("sdpa", "eager", "flash"), default=d.impl,
                   help=f"attention implementation (default: {d.impl})")
    c.add_argument("--partition-len", type=positive_int, default=None, metavar="N",
                   help="tokens per KV partition, needed by --impl flash (default: none)")
    c.add_argument("--max-len", type=positive_int, default=d.max_len, metavar="N",
                   help=f"largest bucket measured; simulating longer requests extrapolates "
                        f"(default: {d.max_len})")
    c.add_argument("--repeats", type=positive_int, default=d.repeats, metavar="N",
                   help=f"timing rounds (default: {d.repeats})")
    c.add_argument("--threads", type=positive_int, default=d.threads, metavar="N",
                   help=f"torch threads while measuring; stable on a shared machine, and bench's "
                        f"default too (default: {d.threads})")
    c.add_argument("--quick", action="store_true", help="every other size only (default: off)")
    c.add_argument("--sizes", type=int_list, default=None, metavar="N[,N...]",
                   help="the pow2 bucket sizes of the grid instead of 16 up to --max-len (default: none)")
    c.add_argument("--statistic", choices=("min", "mean"), default=d.statistic,
                   help="a call's sample: its fastest run, or its mean run (what a replay on this machine "
                        f"pays now, interference included) (default: {d.statistic})")
    c.add_argument("--model", type=model_spec, metavar="SPEC", default=None,
                   help="fit the whole-model fits of SPEC's graphs (qwen3, llama, sizes, or a local HF directory) "
                        "through the StaticModelRunner, into the model section of --out (its attention fits kept) "
                        "(default: none, attention calls)")
    c.add_argument("--family", choices=FAMILIES, default=None,
                   help="the fits calibrated: the attention calls', or the whole model's (needs --model SPEC) "
                        "(default: model with --model SPEC, else attention)")
    c.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="with --model: process CPU seconds (stable on a loaded machine) or wall seconds "
                        "(default: cpu)")
    c.add_argument("--no-store", action="store_true",
                   help="skip saving and loading a few graphs per call kind through a graph store (the model then "
                        "cannot model one: no store_load, store_bytes) (default: off)")
    c.add_argument("--kernels", action="store_true",
                   help="also time every registered kernel per call kind, for kernels 'auto' (default: off)")


def kept_file(out: str) -> CostFile:
    """The cost-model file at ``out`` whose other family's fits a calibration keeps
    (empty when there is none, or it cannot be read: said in one warning, and replaced)."""
    if not os.path.exists(out):
        return CostFile()
    try:
        return CostFile.load(out)
    except ConfigError as exc:
        warn(f"--out {out} is replaced, its fits are not kept: {exc}")
        return CostFile()


def cmd_calibrate(args: argparse.Namespace) -> int:
    return by_family(args, {"attention": _calibrate_calls, "model": _calibrate_graphs}, by_model=True)(args)


def _calibrate_graphs(args: argparse.Namespace) -> int:
    """``calibrate --model``: whole-model graphs."""
    check_spec_args(args, not_with="--model (the model's own heads and head dim, in float32)")
    return whole_model_fits(args)


def _calibrate_calls(args: argparse.Namespace) -> int:
    """``calibrate``: attention calls."""
    if args.clock is not None:
        fail(f"argument --clock: {args.clock}: needs --model SPEC (the attention calls are timed in wall seconds)")
    check_writable("--out", args.out)
    s = settings(CalibrationSettings, CALIBRATE_FLAGS, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 dtype=args.dtype, impl=args.impl, partition_len=args.partition_len, backend=args.backend,
                 max_len=args.max_len, repeats=args.repeats, quick=args.quick, threads=args.threads,
                 kernels=args.kernels, sizes=tuple(args.sizes) if args.sizes else None,
                 statistic=args.statistic, store=not args.no_store)
    stored = len(store_shapes(s)) if s.store and s.backend != "none" else 0
    with progress(len(shapes(s)) + s.repeats + stored, "calibrate") as advance:
        model = calibrate(s, advance)
    with writing("--out", args.out):
        path = kept_file(args.out).with_attention(model).save(args.out)
    try:
        kept = f"; kept for plan, simulate and stalls on this machine in {store(s, model).path}"
    except OSError as exc:
        kept = ""
        warn(f"the calibration is not kept in the calibration cache {cache_dir()}: {exc.strerror or exc}")
    rows = []
    for x in model.samples:
        fit = getattr(model, x.what) if x.kind is None else getattr(model, x.what)[x.kind]
        predicted = fit(x.rows, x.cols)
        unit = 1.0 if x.what == "store_bytes" else 1e3
        rows.append((x.what, x.kind or "", x.rows, x.cols, x.seconds * unit, predicted * unit,
                     predicted / x.seconds if x.seconds else None))
    print_table(f"cost model, {model.impl}/{model.backend}, {model.dtype}, H={model.heads}/{model.kv_heads} "
                f"D={model.head_dim}, {model.threads} thread(s)",
                ("what", "kind", "rows", "cols", "measured ms", "model ms", "model/measured"), rows,
                caption="store_bytes: bytes on disk, not ms")
    console.print(f"dispatch overhead per call: {model.call_overhead_seconds * 1e6:.1f} µs; the first compile "
                  f"in the process paid {model.warmup_seconds:.3g} s more (warmup_seconds); wrote {path}{kept}")
    return 0


def whole_model_fits(args: argparse.Namespace) -> int:
    """``calibrate --model SPEC``: the whole-model fits of SPEC, into the model section of --out."""
    out = args.out
    check_writable("--out", out)
    s = settings(ModelCalibrationSettings, {"spec": "--model"}, spec=args.model, backend=args.backend,
                 sizes=tuple(args.sizes) if args.sizes else None, repeats=args.repeats, threads=args.threads,
                 clock=args.clock or "cpu", quick=args.quick)
    try:
        with progress(None, "calibrate --model") as advance:
            model = calibrate(s, advance)
    except ConfigError as exc:
        fail(f"argument --model: {exc}")
    with writing("--out", out):
        path = kept_file(out).with_model(model).save(out)
    rows = []
    for x in model.samples:
        key = x.key(model.backend)
        rows.append((x.mode, "+".join(map(str, x.segments)), x.compile_seconds, model.compile_seconds(key),
                     x.run_seconds * 1e3, model.run_seconds(key) * 1e3, x.rss_bytes / 2**20,
                     x.estimate_bytes / 2**20))
    print_table(f"model cost model, {model.spec}, {model.backend}, {model.clock} seconds, "
                f"{model.threads} thread(s)",
                ("mode", "buckets", "compile s", "model s", "run ms", "model ms", "RSS MiB", "estimate MiB"), rows)
    if model.steps is not None:
        step_rows = []
        for y in model.steps.samples:
            step = y.key(model.backend)
            step_rows.append((y.mode, "+".join(f"{t}/{c}" for t, c in y.segments), y.compile_seconds,
                              model.compile_seconds(step), y.run_seconds * 1e3, model.run_seconds(step) * 1e3,
                              y.rss_bytes / 2**20, y.estimate_bytes / 2**20))
        print_table(f"step graphs (decode, chunked prefill), {model.spec}",
                    ("mode", "rows/context buckets", "compile s", "model s", "run ms", "model ms", "RSS MiB",
                     "estimate MiB"), step_rows)
    console.print(f"the first compile in the process paid {model.warmup_seconds:.3g} s more (warmup_seconds); "
                  f"wrote {path}")
    return 0
