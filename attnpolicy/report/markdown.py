"""report.md, rendered from the report's JSON data alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnpolicy.report.plots import TT_XLA

MIB = 2**20


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _cap(capacity: int | None) -> str:
    return "∞" if capacity is None else str(capacity)


def _bound(row: dict[str, Any]) -> str:
    nbytes = row.get("max_bytes")
    return _cap(row["capacity"]) + ("" if nbytes is None else f", {nbytes / MIB:.4g} MiB")


def _bounds(data: dict[str, Any]) -> list[str]:
    """How far the sweep is from optimal, per bucket scheme and policy."""
    return [
        "### How far from optimal", "",
        ("Lower bound = attention seconds + every distinct graph compiled once: no eviction and no "
         "cache bound does better for the same decisions (cost-aware decides differently under each "
         "cache: its bound is the lowest of its rows'). Belady gives the fewest misses for a row's key "
         "stream, not the fewest compile seconds when compile costs differ."), "",
        table(("buckets", "policy", "distinct graphs", "attention s", "lower bound s", "best online s",
               "best belady s"),
              [(b["buckets"], b["policy"], b["distinct_keys"], b["attention_seconds"], b["bound_seconds"],
                b["best_online"], b["best_belady"]) for b in data.get("bounds", [])]),
    ]


def _baselines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Total seconds per bucket scheme, side by side (nothing with one scheme)."""
    names = list(dict.fromkeys(r["buckets"] for r in rows))
    if len(names) < 2:
        return []
    cells = {(r["policy"], _bound(r), r["eviction"], r["buckets"]): r["total_seconds"] for r in rows}
    lines = list(dict.fromkeys((r["policy"], _bound(r), r["eviction"]) for r in rows))
    return ["### Bucket schemes side by side (total s, same policy, bound and eviction)", "",
            table(("policy", "bound", "eviction", *names), [(*line, *(cells.get((*line, n)) for n in names))
                                                           for line in lines]), ""]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats to 4 significant digits."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _options(rows: Sequence[dict[str, Any]]) -> str:
    seen = {r["policy"]: r.get("policy_options") or {} for r in rows}
    with_options = [f"`{p}` {o}" for p, o in seen.items() if o]
    return (" Policy options: " + ", ".join(with_options) + ".") if with_options else ""


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown (sections: bench, sweep, simulator vs real compute)."""
    s = data["settings"]
    bench = data["bench"]
    env = data["env"]
    model = data["cost_model"]
    limit = "" if s["limit"] is None else f" (first {s['limit']} requests)"
    lines = [
        "# attnpolicy report", "",
        f"Command: `{data['command']}`  ",
        (f"Machine: {env['machine']}, torch {env['torch']}, {env['threads']} threads, "
         f"{env.get('date', '')}. Took {data['seconds']:.0f} s."), "",
        "## 1. Mask vs mask-free attention (measured)", "",
        (f"`attnpolicy bench` settings: {bench['env']}. Medians of {bench['env']['repeats']} runs, "
         "modes interleaved; MASK includes building its mask (also shown alone)."), "",
        table(("L", "seqs", "mode", "median ms", "min ms", "max ms", "mask build ms"),
              [(r["seq_len"], r["num_seqs"], r["mode"], r["median_ms"], r["min_ms"], r["max_ms"],
                r["mask_build_ms"]) for r in bench["rows"]]), "",
        table(("L", "seqs", "faster", "slower / faster", "noisy (median > 2 × min)"),
              [(sp["seq_len"], sp["num_seqs"], sp["faster"], sp["ratio"], "yes" if sp["noisy"] else "")
               for sp in bench["speedups"]]), "",
        "tt-xla (Tenstorrent's compiler, tenstorrent/tt-xla#1784, their accelerator, 1 sequence, "
        "mask / causal): " + ", ".join(f"{v}× @ {k}" for k, v in TT_XLA.items()) + ".", "",
        "![bench](bench.png)", "",
        "### Implementations per family (measured)", "",
        (f"`attnpolicy bench --kernels`: every registered implementation (plugins' included) per family, "
         f"{data['kernels']['seqs']} sequences per batch, against the per-sequence SDPA loop; flex runs "
         "compiled with inductor, the others uncompiled; a MASK call's mask build is shown apart"
         + (f"; left out: {', '.join(data['kernels']['skip'])}" if data['kernels']['skip'] else "") + "."), "",
        table(("batch", "family", "impl", "backend", "median ms", "vs loop", "mask build ms"),
              [(f"{r['num_seqs']}x{r['total_tokens'] // r['num_seqs']}", r["family"], r["impl"], r["backend"],
                r["median_ms"], f"{r['vs_loop']:.2f}x", r["build_ms"]) for r in data["kernels"]["rows"]]), "",
        "## 2. Bucket schemes × policies × graph-cache bounds × eviction (simulated)", "",
        f"Workload: `{s['trace']}`{limit}, "
        f"{data['workload']['requests']} requests → {data['workload']['batches']} batches "
        f"(batch former {s['former']}). Cost model: {data['cost_model_source']} "
        f"({model['backend']}, {model['impl']}, H={model['heads']}/{model['kv_heads']} D={model['head_dim']}, "
        f"{model['threads']} thread(s)). Buckets: pow2 (tt-xla), vllm (vLLM's default capture sizes), "
        "exact (one graph per length) or a config's. Bound = max graphs (∞: unbounded), max bytes. "
        "Total = attention (incl. dispatch overhead and mask builds) + compiles. "
        "Modes c/m/v: batches run causal / mask / varlen." + _options(data["sweep"]), "",
        table(("buckets", "policy", "bound", "eviction", "misses", "hit rate", "compile s", "attention s",
               "total s", "over lower bound", "peak MiB", "modes c/m/v"),
              [(r["buckets"], r["policy"], _bound(r), r["eviction"], r["misses"], r["hit_rate"],
                r["compile_seconds"], r["attention_seconds"], r["total_seconds"], f"{r['bound_gap']:+.1%}",
                r["peak_bytes"] / MIB, "/".join(str(r["modes"][m]) for m in ("causal", "mask", "varlen")))
               for r in data["sweep"]]), "",
        *_bounds(data), "",
        *_baselines(data["sweep"]),
        "![frontier](frontier.png)", "",
        ("### Best policy per capacity (first bucket scheme, best online eviction; belady = offline bound "
         "on misses)"), "",
        table(("capacity", "best policy", "total s", "cost-aware vs best fixed policy"),
              [(_cap(c["capacity"]), c["best_policy"], c["total_seconds"], c["vs_best_fixed"])
               for c in data["summary"]]), "",
        "## 3. Simulator vs real compute (same prefix, config and batches)", "",
        (f"First {s['validate_requests']} requests, capacity {s['validate_capacity']}, LRU, "
         "real tensors and real compiles, every output checked against the float64 reference."), "",
        table(("policy", "batches", "misses pred/meas", "compile s pred/meas", "attention s pred/meas",
               "total s pred/meas", "max abs err"),
              [(v["policy"], v["batches"], f"{v['predicted_misses']} / {v['measured_misses']}",
                f"{v['predicted_compile_seconds']:.3g} / {v['measured_compile_seconds']:.3g}",
                f"{v['predicted_attention_seconds']:.3g} / {v['measured_attention_seconds']:.3g}",
                f"{v['predicted_total_seconds']:.3g} / {v['measured_total_seconds']:.3g}",
                v["max_abs_err"]) for v in data["validation"]]), "",
    ]
    return "\n".join(lines)
