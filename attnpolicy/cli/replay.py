"""``attnpolicy calibrate`` (fit a cost model on this machine) and ``attnpolicy simulate``
(replay a workload with the cost model: policies × capacities × evictions)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from attnpolicy.cli.common import (
    add_spec_args,
    capacity_list,
    console,
    print_table,
    progress,
    str_list,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.kernels.attention import IMPLS
from attnpolicy.measure.batching import BatchFormer
from attnpolicy.measure.calibration import CalibrationSettings, calibrate, shapes
from attnpolicy.measure.simulation import simulate, simulation_config
from attnpolicy.measure.workload import load_trace

DEFAULT_COSTMODEL_PATH = "attnpolicy_costmodel.json"


def register(subparsers: Any) -> None:
    d = CalibrationSettings()
    c = subparsers.add_parser("calibrate", help="measure run, compile and mask-build costs; write a cost model")
    c.add_argument("--out", default=DEFAULT_COSTMODEL_PATH, metavar="PATH",
                   help="cost model JSON to write (default: %(default)s)")
    c.add_argument("--backend", choices=("aot_eager", "inductor", "eager"), default=d.backend,
                   help="compile backend (default: %(default)s)")
    add_spec_args(c)
    c.add_argument("--impl", choices=IMPLS, default=d.impl)
    c.add_argument("--partition-len", type=int, default=None, help="flash partition (impl flash)")
    c.add_argument("--max-len", type=int, default=d.max_len, help="largest bucket measured (default: %(default)s)")
    c.add_argument("--repeats", type=int, default=d.repeats, help="timing rounds (default: %(default)s)")
    c.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads while measuring (default: %(default)s; stable on a shared machine)")
    c.add_argument("--quick", action="store_true", help="every other size only")
    c.add_argument("--kernels", action="store_true",
                   help="also time every registered kernel per family (for kernels 'auto')")
    c.set_defaults(func=cmd_calibrate)

    s = subparsers.add_parser("simulate", help="replay a workload with a cost model: policies × capacities × evictions")
    s.add_argument("--trace", default="default", help="'default' (synthetic) or an Azure-format CSV path")
    s.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests only")
    s.add_argument("--policies", type=str_list, default=("always-mask", "dynamic", "varlen", "cost-aware"),
                   metavar="P[,P...]", help="registered policies (default: %(default)s)")
    s.add_argument("--capacities", type=capacity_list, default=(2, 4, 8, 16), metavar="K[,K...]",
                   help="max_graphs values (default: %(default)s)")
    s.add_argument("--evictions", type=str_list, default=("lru", "belady"), metavar="E[,E...]",
                   help="eviction strategies, 'belady' = offline optimum (default: %(default)s)")
    s.add_argument("--cost-model", metavar="PATH", help="cost model JSON (default: the built-in one)")
    s.add_argument("--config", metavar="PATH",
                   help="base attnpolicy config (default: derived from the cost model and batch former)")
    f = BatchFormer()
    s.add_argument("--max-num-seqs", type=int, default=f.max_num_seqs)
    s.add_argument("--max-num-batched-tokens", type=int, default=f.max_num_batched_tokens)
    s.add_argument("--max-seq-len", type=int, default=f.max_model_len,
                   help="longest request (prompt + output) admitted (default: %(default)s)")
    s.add_argument("--no-chunked-prefill", action="store_true")
    s.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    s.add_argument("--plot", metavar="PATH.png", help="plot total seconds and peak graph bytes vs capacity")
    s.set_defaults(func=cmd_simulate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    for name in ("heads", "kv_heads", "head_dim", "max_len", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"attnpolicy calibrate: error: --{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    settings = CalibrationSettings(args.heads, args.kv_heads, args.head_dim, args.dtype, args.impl,
                                   args.partition_len, args.backend, args.max_len, args.repeats,
                                   args.quick, args.threads, args.kernels)
    with progress(len(shapes(settings)) + settings.repeats, "calibrate") as advance:
        model = calibrate(settings, advance)
    path = model.save(args.out)
    rows = []
    for x in model.samples:
        fit = model.mask_build if x.what == "mask_build" else getattr(model, x.what)[x.kind]
        predicted = fit(x.rows, x.cols)
        rows.append((x.what, x.kind or "", x.rows, x.cols, x.seconds * 1e3, predicted * 1e3,
                     predicted / x.seconds if x.seconds else None))
    print_table(f"cost model, {model.impl}/{model.backend}, {model.dtype}, H={model.heads}/{model.kv_heads} "
                f"D={model.head_dim}, {model.threads} thread(s)",
                ("what", "kind", "rows", "cols", "measured ms", "model ms", "model/measured"), rows)
    console.print(f"dispatch overhead per call: {model.call_overhead_seconds * 1e6:.1f} µs; wrote {path}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    model = CostModel.load(args.cost_model) if args.cost_model else CostModel.default()
    former_options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "max_model_len": args.max_seq_len, "chunked_prefill": not args.no_chunked_prefill}
    base = (AttnPolicyConfig.load(args.config) if args.config
            else simulation_config(model, BatchFormer(**former_options)))
    requests = load_trace(args.trace, args.limit)
    total = len(args.policies) * len(args.capacities) * len(args.evictions)
    with progress(total, "simulate") as advance:
        rows = simulate(requests, args.policies, args.capacities, args.evictions, base, model,
                        former_options, advance)
    print_table(f"simulated {len(requests)} requests of {args.trace} ({rows[0]['batches']} batches), "
                f"cost model {model.impl}/{model.backend}",
                ("policy", "capacity", "eviction", "hits", "misses", "hit rate", "compile s", "attention s",
                 "total s", "peak MiB", "modes c/m/v"),
                [(r["policy"], r["capacity"] or "∞", r["eviction"], r["hits"], r["misses"], r["hit_rate"],
                  r["compile_seconds"], r["attention_seconds"], r["total_seconds"], r["peak_bytes"] / 2**20,
                  "/".join(str(r["modes"][m]) for m in ("causal", "mask", "varlen"))) for r in rows])
    if args.json:
        write_json(args.json, {"trace": args.trace, "requests": len(requests), "former": former_options,
                               "config": base.model_dump(mode="json"), "rows": rows})
    if args.plot:
        plot(rows, args.plot)
    return 0




def plot(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Total seconds and peak graph MiB vs capacity: one panel column per eviction,
    one line per policy (unbounded capacity drawn at twice the largest bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evictions = list(dict.fromkeys(r["eviction"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    bounded = [r["capacity"] for r in rows if r["capacity"] is not None]
    unbounded_x = 2 * max(bounded) if bounded else 1
    fig, axes = plt.subplots(2, len(evictions), figsize=(5 * len(evictions), 7), squeeze=False, sharex=True)
    for col, eviction in enumerate(evictions):
        for policy in policies:
            pts = sorted((r["capacity"] or unbounded_x, r["total_seconds"], r["peak_bytes"] / 2**20)
                         for r in rows if r["policy"] == policy and r["eviction"] == eviction)
            xs = [p[0] for p in pts]
            axes[0][col].plot(xs, [p[1] for p in pts], marker="o", label=policy)
            axes[1][col].plot(xs, [p[2] for p in pts], marker="o", label=policy)
        axes[0][col].set_title(f"eviction: {eviction}")
        axes[0][col].set_ylabel("total seconds (attention + compile)")
        axes[1][col].set_ylabel("peak graph MiB")
        axes[1][col].set_xlabel("capacity (max_graphs)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
