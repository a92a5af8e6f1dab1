"""``attnpolicy report``: the measurements a user needs, from one command.

1. the mask-vs-mask-free table on this machine (``attnpolicy bench``);
2. a cost model (the built-in one, a given file, or calibrated now);
3. the policy × capacity × eviction sweep on the workload, Belady's bound included
   (``attnpolicy simulate``);
4. the simulator checked against real compute on a prefix of the workload:
   predicted vs measured misses and seconds, side by side (``attnpolicy run``);
5. plots of the memory-vs-speed frontier; ``report.md`` + ``report.json``.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.measure.batching import BatchFormer
from attnpolicy.measure.calibration import CalibrationSettings, calibrate
from attnpolicy.measure.replay import run_workload
from attnpolicy.measure.simulation import simulate, simulation_config
from attnpolicy.measure.timing import BenchSettings, run_bench, speedups
from attnpolicy.measure.workload import load_trace

#: tt-xla issue #1784: mask-free / masked speed on their accelerator.
TT_XLA = {128: 1.12, 1024: 1.26, 4096: 1.50, 16384: 1.82}


@dataclass(frozen=True)
class ReportSettings:
    out: Path = Path("report")
    trace: str = "default"
    limit: int | None = None
    # always-causal is left out: on packed batches the guard turns it into varlen.
    policies: tuple[str, ...] = ("always-mask", "dynamic", "varlen", "cost-aware")
    capacities: tuple[int | None, ...] = (2, 4, 8, 16, 32, None)
    evictions: tuple[str, ...] = ("lru", "lfu", "cost", "belady")
    bench: BenchSettings = field(default_factory=lambda: BenchSettings(repeats=3))
    cost_model: str | None = None
    calibrate: bool = False
    validate_requests: int = 6
    validate_capacity: int = 4
    validate_policies: tuple[str, ...] = ("dynamic", "varlen", "cost-aware")
    former: dict[str, Any] = field(default_factory=lambda: {"max_num_seqs": 8, "max_num_batched_tokens": 2048})


def _model(s: ReportSettings, progress: Callable[[str], None]) -> tuple[CostModel, str]:
    if s.cost_model:
        return CostModel.load(s.cost_model), f"loaded from {s.cost_model}"
    if s.calibrate:
        progress("calibrating")
        return calibrate(CalibrationSettings(quick=True)), "calibrated now (attnpolicy calibrate --quick)"
    return CostModel.default(), "built-in (attnpolicy/data/default_costmodel.json)"


def validate(model: CostModel, requests: Sequence, s: ReportSettings,
             progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Predicted (simulate) vs measured (run) on the same prefix, config and batches."""
    former = BatchFormer(**s.former)
    steps = list(former.steps(requests))
    rows = []
    torch.set_num_threads(model.threads)
    for policy in s.validate_policies:
        config = simulation_config(model, former, policy=policy, max_graphs=s.validate_capacity)
        (predicted,) = simulate(requests, [policy], [s.validate_capacity], ["lru"], config, model, s.former)
        measured = run_workload(requests, config, model.spec, steps=steps, check=True)
        rows.append({
            "policy": policy, "capacity": s.validate_capacity, "batches": len(steps),
            "predicted_misses": predicted["misses"], "measured_misses": measured["cache"]["misses"],
            "predicted_compile_seconds": predicted["compile_seconds"],
            "measured_compile_seconds": measured["compile_seconds"],
            "predicted_attention_seconds": predicted["attention_seconds"],
            "measured_attention_seconds": measured["attention_seconds"],
            "predicted_total_seconds": predicted["total_seconds"],
            "measured_total_seconds": measured["total_seconds"],
            "max_abs_err": measured["max_abs_err"],
        })
        progress(f"validated {policy}")
    return rows


def best_by_policy(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, Any]]:
    """Per (policy, capacity): the row of the best online eviction (not belady)."""
    best: dict[tuple[str, Any], dict[str, Any]] = {}
    for row in rows:
        if row["eviction"] == "belady":
            continue
        k = (row["policy"], row["capacity"])
        if k not in best or row["total_seconds"] < best[k]["total_seconds"]:
            best[k] = row
    return best


def plot(rows: Sequence[dict[str, Any]], bench_rows: Sequence[Any], out: Path) -> list[str]:
    """Two PNGs: the memory-vs-speed frontier and the bench ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_policy(rows)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        pts = sorted((r["peak_bytes"] / 2**20, r["total_seconds"], r["capacity"])
                     for (p, _), r in best.items() if p == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        for x, y, cap in pts:
            ax.annotate("∞" if cap is None else str(cap), (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak graph memory (MiB, computed from static shapes)")
    ax.set_ylabel("predicted total seconds (attention + compiles)")
    ax.set_title("memory vs speed per policy (labels: graph-cache capacity)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    frontier = out / "frontier.png"
    fig.savefig(frontier, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, label in ((1, "1 seq: mask / causal"), (4, "4 seqs: mask / varlen")):
        pts = [(sp["seq_len"], _ratio(sp)) for sp in speedups(bench_rows) if sp["num_seqs"] == n]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"this machine, {label}")
    ax.plot(list(TT_XLA), list(TT_XLA.values()), marker="s", linestyle="--", label="tt-xla #1784, 1 seq")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total tokens L")
    ax.set_ylabel("masked time / mask-free time")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    ratios = out / "bench.png"
    fig.savefig(ratios, dpi=120)
    plt.close(fig)
    return [frontier.name, ratios.name]


def _ratio(sp: dict[str, Any]) -> float:
    """masked / mask-free time (> 1: the mask costs)."""
    return sp["ratio"] if sp["slower"] == "mask" else 1 / sp["ratio"]


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cap(capacity: int | None) -> str:
    return "∞" if capacity is None else str(capacity)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    bench = data["bench"]
    limit = "" if s["limit"] is None else f" (first {s['limit']} requests)"
    lines = [
        "# attnpolicy report", "",
        f"Command: `{data['command']}`  ",
        f"Machine: {data['env']['machine']}, torch {data['env']['torch']}, "
        f"{data['env']['threads']} threads. Took {data['seconds']:.0f} s.", "",
        "## 1. Mask vs mask-free attention (measured)", "",
        f"`attnpolicy bench` settings: {bench['env']}. Medians of {bench['env']['repeats']} runs, "
        "modes interleaved; MASK includes building its mask (also shown alone).", "",
        _table(("L", "seqs", "mode", "median ms", "min ms", "max ms", "mask build ms"),
               [(r["seq_len"], r["num_seqs"], r["mode"], r["median_ms"], r["min_ms"], r["max_ms"],
                 r["mask_build_ms"]) for r in bench["rows"]]), "",
        _table(("L", "seqs", "faster", "slower / faster"),
               [(sp["seq_len"], sp["num_seqs"], sp["faster"], sp["ratio"]) for sp in bench["speedups"]]), "",
        "tt-xla (#1784, their accelerator, 1 sequence, mask / causal): "
        + ", ".join(f"{v}× @ {k}" for k, v in TT_XLA.items()) + ".", "",
        "![bench](bench.png)", "",
        "## 2. Policies × graph-cache capacity × eviction (simulated)", "",
        f"Workload: `{s['trace']}`{limit}, "
        f"{data['workload']['requests']} requests → {data['workload']['batches']} batches "
        f"(batch former {s['former']}). Cost model: {data['cost_model_source']} "
        f"({data['cost_model']['backend']}, {data['cost_model']['impl']}, "
        f"H={data['cost_model']['heads']}/{data['cost_model']['kv_heads']} D={data['cost_model']['head_dim']}, "
        f"{data['cost_model']['threads']} thread(s)). Capacity = max graphs (∞: unbounded). "
        "Total = attention (incl. dispatch overhead and mask builds) + compiles.", "",
        _table(("policy", "capacity", "eviction", "hits", "misses", "hit rate", "compile s", "attention s",
                "total s", "peak MiB"),
               [(r["policy"], _cap(r["capacity"]), r["eviction"], r["hits"], r["misses"], r["hit_rate"],
                 r["compile_seconds"], r["attention_seconds"], r["total_seconds"], r["peak_bytes"] / 2**20)
                for r in data["sweep"]]), "",
        "![frontier](frontier.png)", "",
        "### Best policy per capacity (best online eviction; belady = offline bound on misses)", "",
        _table(("capacity", "best policy", "total s", "vs best fixed policy"),
               [(_cap(c["capacity"]), c["best_policy"], c["total_seconds"], c["vs_best_fixed"])
                for c in data["summary"]]), "",
        "## 3. Simulator vs real compute (same prefix, config and batches)", "",
        f"First {s['validate_requests']} requests, capacity {s['validate_capacity']}, LRU, "
        "real tensors and real compiles, every output checked against the float64 reference.", "",
        _table(("policy", "batches", "misses pred/meas", "compile s pred/meas", "attention s pred/meas",
                "total s pred/meas", "max abs err"),
               [(v["policy"], v["batches"], f"{v['predicted_misses']} / {v['measured_misses']}",
                 f"{v['predicted_compile_seconds']:.3g} / {v['measured_compile_seconds']:.3g}",
                 f"{v['predicted_attention_seconds']:.3g} / {v['measured_attention_seconds']:.3g}",
                 f"{v['predicted_total_seconds']:.3g} / {v['measured_total_seconds']:.3g}",
                 v["max_abs_err"]) for v in data["validation"]]), "",
    ]
    return "\n".join(lines)


FIXED = ("always-mask", "dynamic", "varlen")


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    best = best_by_policy(rows)
    out = []
    for cap in dict.fromkeys(r["capacity"] for r in rows):
        at = {p: r for (p, c), r in best.items() if c == cap}
        winner = min(at.values(), key=lambda r: r["total_seconds"])
        fixed = [at[p]["total_seconds"] for p in FIXED if p in at]
        out.append({"capacity": cap, "best_policy": winner["policy"], "total_seconds": winner["total_seconds"],
                    "vs_best_fixed": (at["cost-aware"]["total_seconds"] / min(fixed)
                                      if fixed and "cost-aware" in at else None)})
    return out


def make_report(s: ReportSettings, command: str, progress: Callable[[str], None]) -> dict[str, Any]:
    start = time.perf_counter()
    s.out.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()} {platform.processor() or platform.system()}"}
    bench_rows = run_bench(s.bench, progress)
    model, source = _model(s, progress)
    requests = load_trace(s.trace, s.limit)
    former = BatchFormer(**s.former)
    sweep = simulate(requests, s.policies, s.capacities, s.evictions, simulation_config(model, former),
                     model, s.former, progress)
    validation = validate(model, requests[:s.validate_requests], s, progress)
    data = {
        "command": command,
        "settings": {**asdict(s), "out": str(s.out), "bench": asdict(s.bench)},
        "env": env,
        "bench": {"rows": [asdict(r) for r in bench_rows], "speedups": speedups(bench_rows),
                  "env": {"dtype": s.bench.dtype, "heads": s.bench.heads, "kv_heads": s.bench.kv_heads,
                          "head_dim": s.bench.head_dim, "impl": s.bench.impl, "repeats": s.bench.repeats}},
        "cost_model_source": source,
        "cost_model": model.model_dump(mode="json", exclude={"samples"}),
        "workload": {"requests": len(requests), "batches": sweep[0]["batches"] if sweep else 0},
        "sweep": sweep,
        "summary": summarize(sweep),
        "validation": validation,
    }
    data["plots"] = plot(sweep, bench_rows, s.out)
    data["seconds"] = time.perf_counter() - start
    write_json(s.out / "report.json", data)
    write_text_atomic(s.out / "report.md", markdown(data) + "\n")
    return data
