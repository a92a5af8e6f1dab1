"""report.md, rendered from the report's JSON data alone: first the answer (the
recommendation beside the sweep's fastest and leanest good rows, the recommended
configuration, what it saves, how far to trust it, how to apply it), then the
measurements, each section opening with its takeaway, then the full sweep as an
appendix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnpolicy.modelling.runtime_sets import GRAPH_SETS_FILE
from attnpolicy.planning.scheme_comparison import COMPARISON_LEGEND
from attnpolicy.report.plots import TT_XLA
from attnpolicy.report.units import MIB, bound_text, capacity_text, human_bytes
from attnpolicy.workloads.batching import Workload


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _bound(row: dict[str, Any]) -> str:
    nbytes = row.get("max_bytes")
    return capacity_text(row["capacity"]) + ("" if nbytes is None else f", {nbytes / MIB:.4g} MiB")


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


def _pct(x: float) -> str:
    return f"{abs(x):.0%} " + ("less" if x >= 0 else "more")


def _err(x: float | None) -> str:
    return "not measured" if x is None else f"{x:+.0%}"


def _workload(data: dict[str, Any]) -> str:
    """The workload line: the trace, its requests, rejections and batches, the former's knobs."""
    s = data["settings"]
    limit = "" if s["limit"] is None else f" (first {s['limit']} requests)"
    return f"`{s['trace']}`{limit}: {Workload.from_json(data['workload']).describe()}"


def frontier_table(data: dict[str, Any]) -> list[str]:
    """The recommendation, the sweep's fastest row and its leanest row within 10 %,
    side by side, then the sentence saying why the recommendation is neither."""
    f = data["frontier"]
    return [
        table(("row", "policy", "buckets", "capacity", "eviction", "total s", "× fastest", "graph memory (peak)",
               "graphs held (peak)", "graphs compiled"),
              [(r["name"], f"`{r['policy']}`", r["buckets"], bound_text(r["capacity"], r["max_bytes"]),
                f"`{r['eviction']}`", f"{r['total_seconds']:.4g}", f"{r['vs_fastest']:.2f}×",
                human_bytes(r["peak_bytes"]), r["peak_graphs"], r["distinct_graphs"]) for r in f["rows"]]),
        *(["", f["why"]] if f["why"] else []),
    ]


def _outside(data: dict[str, Any]) -> str:
    """`` **N of M batches priced outside the calibrated range (...)**: ...`` when some are, else ``""``."""
    o = data.get("outside_calibrated_range")
    if not o or not o["outside"]:
        return ""
    return (f" **{o['outside']} of {o['batches']} batches priced outside the calibrated range (sizes up to "
            f"{o['largest']}, calibrated to {o['calibrated']})**: their seconds are extrapolated.")


def first_screen(data: dict[str, Any]) -> list[str]:
    """The answer: the workload, the recommendation beside the sweep's fastest and
    leanest good rows, the recommended configuration, its predicted total against the
    defaults and its base buckets + LRU, peak graph memory, the simulator's error
    here and the commands that apply it (also what ``attnpolicy report`` prints)."""
    r = data["recommendation"]
    err = r["simulator_error"]
    bound = bound_text(r["max_graphs"], r["max_bytes"])
    base = f"{r['base_buckets']} buckets + LRU at the same capacity"
    why_rejected = data["workload"]["why_rejected"]
    lines = [
        f"**Workload:** {_workload(data)}.", "",
        *([f"> **WARNING: {why_rejected}**: left out of every figure below.", ""] if why_rejected else []),
        ("**The choice** (the sweep's online rows, simulated; `frontier.png` draws them with the Pareto "
         "frontier):"), "",
        *frontier_table(data), "",
        ("**Recommended for this workload on this machine** (`attnpolicy plan` at the leanest cache bound "
         "within 10 % of the sweep's best total):"), "",
        "| setting | value |", "|---|---|",
        f"| policy | `{r['policy']}` |",
        f"| buckets | {sizes_text(r['buckets'], ', ')} |",
        f"| capacity | {bound} |",
        f"| eviction | `{r['eviction']}` |",
        (f"| warm set | {r['warm_graphs']} graphs compiled at start ({r['warm_compile_seconds']:.3g} modelled "
         f"compile s), serving {r['warm_calls']} of {r['calls']} calls |"), "",
        (f"**Predicted total {r['total_seconds']:.4g} s**: {_pct(r['saving_vs_defaults'])} than the defaults "
         f"({r['default_total_seconds']:.4g} s: varlen, pow2 buckets, unbounded, LRU) and "
         f"{_pct(r['saving_vs_base_lru'])} than {base} ({r['base_lru_total_seconds']:.4g} s)."), "",
        (f"**Peak graph memory {human_bytes(r['peak_bytes'])}** (defaults: {human_bytes(r['default_peak_bytes'])}; "
         f"{base}: {human_bytes(r['base_lru_peak_bytes'])})."), "",
        (f"**Simulator error on this machine** (predicted / measured − 1, section 3): compile seconds "
         f"{_err(err['compile'])}, total seconds {_err(err['total'])}."),
    ]
    whole = data.get("whole_requests")
    if whole is not None:
        sliced = whole["measured_slice"]
        ratios = [] if sliced is None else [f"{r['scheme']} {r['modelled_over_measured']:.2f}×"
                                            for r in sliced["rows"] if r["modelled_over_measured"] is not None]
        measured = (f" Modelled / measured total on a slice of {sliced['requests']} requests: {', '.join(ratios)}."
                    if sliced is not None and ratios else "")
        lines += ["", (f"**Warm-up schemes on whole requests** ({whole['model']}, modelled, section 5): "
                       f"{whole['summary'].removeprefix('* ')}.{measured}")]
    if not err["trusted"]:
        advice = ("The cost model was calibrated in this run, so the machine's load changed between "
                  "calibration and validation: rerun on a quieter machine."
                  if data["cost_model_source"].startswith("calibrated") else
                  "Calibrate a cost model (`attnpolicy calibrate --out model.json`) and rerun with "
                  "`--cost-model model.json`, or drop `--no-calibrate`.")
        lines += ["", ("> **WARNING: the simulator is more than 20 % off on this machine.** The predicted "
                       f"seconds above are rough; the ranking may still hold. {advice}")]
    lines += ["", f"**Apply it** (config written to `{r['config_dir']}`):", "", "```",
              *r["apply"], "```"]
    return lines


def _kernel_takeaway(rows: Sequence[dict[str, Any]]) -> str:
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["family"] != "loop" and (r["family"] not in best or r["median_ms"] < best[r["family"]]["median_ms"]):
            best[r["family"]] = r
    return "Fastest per family: " + ", ".join(f"{f} `{r['impl']}` ({r['vs_loop']:.2f}× the loop)"
                                               for f, r in best.items()) + "."


def sizes_text(sizes: Sequence[int], sep: str = ",") -> str:
    """A bucket list, shortened past 12 sizes (a scheme kept by the plan can hold hundreds)."""
    shown = sizes if len(sizes) <= 12 else [*sizes[:6], "…", *sizes[-2:]]
    return sep.join(map(str, shown)) + ("" if len(sizes) <= 12 else f" ({len(sizes)} sizes)")


def _plot_title(data: dict[str, Any], name: str) -> str:
    return next((p["title"] for p in data["plots"] if p["file"] == name), "")


def _validation_takeaway(data: dict[str, Any]) -> str:
    err = data["recommendation"]["simulator_error"]
    rows = data["validation"]
    same = all(v["predicted_misses"] == v["measured_misses"] for v in rows)
    verdict = "within 20 % of" if err["trusted"] else "**more than 20 % off**"
    failed = [v["policy"] for v in rows if v["passed"] is False]
    check = f"**the outputs of {', '.join(failed)} failed their check** (see the table); " if failed else ""
    return (f"{check}Misses {'agree exactly' if same else 'differ'}; predicted seconds are {verdict} the "
            f"measured ones (compile {_err(err['compile'])}, total {_err(err['total'])}).")


def _check(row: dict[str, Any]) -> str:
    """A validation row's check: pass, or FAIL with its non-finite values."""
    if row["passed"] is not False:
        return "pass"
    return f"**FAIL** ({row['non_finite']} non-finite)" if row["non_finite"] else "**FAIL**"


def _model_bench(bench: dict[str, Any] | None) -> list[str]:
    """The whole-model table (``report --model``) beside tt-xla's ratios; none without it."""
    if bench is None:
        return []
    ratios = {r["seq_len"]: r for r in bench["ratios"] if r["num_seqs"] == 1}
    return [
        "### Whole-model forward (measured)", "",
        (f"`attnpolicy bench --model`: {bench['model']}, one sequence per length, the whole forward compiled "
         f"({bench['backend']}, {bench['threads']} thread(s)) and eager; medians of {bench['repeats']} runs."), "",
        table(("L", "compile s causal", "compile s mask", "causal ms", "mask ms", "mask / causal", "rows / causal",
               "eager mask / causal", "tt-xla mask / causal"),
              [(n, *(next(r[f] for r in bench["rows"] if r["seq_len"] == n and r["num_seqs"] == 1 and r["mode"] == m)
                     for f, m in (("compile_s", "causal"), ("compile_s", "mask"), ("compiled_ms", "causal"),
                                  ("compiled_ms", "mask"))),
                f"{ratio['compiled']['mask']:.2f}×", f"{ratio['compiled']['rows']:.2f}×",
                f"{ratio['eager']['mask']:.2f}×",
                f"{TT_XLA[n]:.2f}×" if n in TT_XLA else "") for n, ratio in ratios.items()]), "",
    ]


def _whole_requests(whole: dict[str, Any] | None) -> list[str]:
    """Section 5 (``report --model-cost``): the warm-up schemes on whole requests, and
    the rows measured on a slice; none without it."""
    if whole is None:
        return []
    limits = whole["limits"]
    return [
        "## 5. Warm-up schemes on whole requests (modelled, measured on a slice)", "",
        f"**Takeaway:** {whole['summary'].removeprefix('* ')}.", "",
        (f"Cost model `{whole['cost_model']}` ({whole['model']}); the server's limits: max_num_seqs "
         f"{limits['max_num_seqs']}, max_num_batched_tokens {limits['max_num_batched_tokens']}, max_model_len "
         f"{limits['max_model_len']}, block {limits['block_size']}. The plan's host settings, vllm-gaudi "
         f"bucketing file and every row's graph set (`{GRAPH_SETS_FILE}`, which `attnpolicy run --model SPEC "
         f"--plan DIR --graph-set LABEL` serves): `{whole['dir']}`. {COMPARISON_LEGEND} Here every row is "
         "priced on the whole workload; the table below measures two of them on a slice."), "",
        table(whole["columns"], whole["table"]), "",
        *_measured_slice(whole["measured_slice"]),
    ]


def _measured_slice(sliced: dict[str, Any] | None) -> list[str]:
    """Section 5's rows measured on a slice (``None``: nothing measured)."""
    head = "### Measured on a slice"
    if sliced is None:
        return [head, "", "Nothing measured (`--measure-requests 0`): every row above is modelled.", ""]
    limits = sliced["limits"]
    where = (f"first {sliced['requests']} requests, {sliced['steps']} steps, max_num_seqs {limits['max_num_seqs']}, "
             f"max_num_batched_tokens {limits['max_num_batched_tokens']}, max_model_len {limits['max_model_len']}")

    def counted(r: dict[str, Any], key: str) -> str:
        modelled, m = r["modelled"][key], r["measured"]
        if m is None:
            return f"{modelled} (modelled)"
        return str(m[key]) if m[key] == modelled else f"{m[key]} (modelled {modelled})"

    rows = [(where, r["scheme"], f"{r['modelled']['total_seconds']:.4g}",
             "modelled" if r["measured"] is None else f"{r['measured']['total_seconds']:.4g}",
             "" if r["modelled_over_measured"] is None else f"{r['modelled_over_measured']:.2f}×",
             counted(r, "graphs"), counted(r, "runtime_compiles")) for r in sliced["rows"]]
    left = [f"- `{r['scheme']}` stays modelled ({r['modelled']['total_seconds']:.4g} modelled s): "
            f"{r['left_modelled']}." for r in sliced["rows"] if r["left_modelled"]]
    return [
        head, "",
        (f"The plan's gaudi form and then the runtime default of the lowest modelled total that this runner "
         f"serves, each planned and priced on the slice as above and, while the modelled totals of the rows "
         f"measured stay within {sliced['budget_seconds']:g} s (`--measure-seconds`), run here through "
         f"{sliced['model']} (backend {sliced['backend']}): warm-up (every graph of the set compiled), run-time "
         "compiles and run, CPU seconds (`--measure-requests` sets the slice)."), "",
        table(("slice", "scheme", "modelled total s", "measured total s (CPU)", "modelled / measured", "graphs",
               "run-time compiles"), rows), "",
        *([*left, ""] if left else []),
    ]


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: the answer first, then bench, sweep, simulator check,
    the plan in detail, and the full sweep as an appendix."""
    s = data["settings"]
    bench = data["bench"]
    env = data["env"]
    model = data["cost_model"]
    rec = data["recommendation"]
    lines = [
        "# attnpolicy report", "",
        *first_screen(data), "",
        (f"Command: `{data['command']}`; {env['machine']}, torch {env['torch']}, {env['threads']} threads, "
         f"{env.get('date', '')}. Took {data['seconds']:.0f} s (the plan step {rec['plan_seconds']:.0f} s)."), "",
        ("Details: 1. mask vs mask-free, 2. the sweep, 3. simulator vs real compute, 4. the plan per policy"
         + ("; 5. warm-up schemes on whole requests" if data.get("whole_requests") else "")
         + "; appendix: every sweep row (also in report.json)."), "",
        "## 1. Mask vs mask-free attention (measured)", "",
        f"**Takeaway:** {_plot_title(data, 'bench.png')}.", "",
        (f"`attnpolicy bench` settings: {bench['env']}. Medians of {bench['env']['repeats']} runs, "
         "modes interleaved; MASK includes building its mask (also shown alone)."), "",
        table(("L", "seqs", "split", "mode", "median ms", "min ms", "max ms", "mask build ms"),
              [(r["seq_len"], r["num_seqs"], r["split"], r["mode"], r["median_ms"], r["min_ms"], r["max_ms"],
                r["mask_build_ms"]) for r in bench["rows"]]), "",
        table(("L", "seqs", "split", "faster", "slower / faster", "noisy (median > 2 × min)"),
              [(sp["seq_len"], sp["num_seqs"], sp["split"], sp["faster"], sp["ratio"], "yes" if sp["noisy"] else "")
               for sp in bench["speedups"]]), "",
        "tt-xla (Tenstorrent's compiler, tenstorrent/tt-xla#1784, their accelerator, 1 sequence, "
        "mask / causal): " + ", ".join(f"{v}× @ {k}" for k, v in TT_XLA.items()) + ".", "",
        "![bench](bench.png)", "",
        *_model_bench(data.get("model_bench")),
        "### Implementations per family (measured)", "",
        f"**Takeaway:** {_kernel_takeaway(data['kernels']['rows'])}", "",
        (f"`attnpolicy bench --kernels`: every registered implementation (plugins' included) per family, "
         f"{data['kernels']['seqs']} sequences per batch, against the per-sequence SDPA loop; flex runs "
         "compiled with inductor, the others uncompiled; a MASK call's mask build is shown apart"
         + (f"; left out: {', '.join(data['kernels']['skip'])}" if data['kernels']['skip'] else "") + "."), "",
        table(("batch", "family", "impl", "backend", "median ms", "vs loop", "mask build ms"),
              [(f"{r['num_seqs']}x{r['total_tokens'] // r['num_seqs']}", r["family"], r["impl"], r["backend"],
                r["median_ms"], f"{r['vs_loop']:.2f}x", r["build_ms"]) for r in data["kernels"]["rows"]]), "",
        "## 2. Bucket schemes × policies × graph-cache bounds × eviction (simulated)", "",
        f"**Takeaway:** {_plot_title(data, 'frontier.png')}; {_plot_title(data, 'hit_rate.png')}.", "",
        f"Workload: {_workload(data)}. Cost model: {data['cost_model_source']} "
        f"({model['backend']}, {model['impl']}, H={model['heads']}/{model['kv_heads']} D={model['head_dim']}, "
        f"{model['threads']} thread(s)).{_outside(data)} Buckets: pow2 (tt-xla), vllm (vLLM's default capture sizes), "
        "exact (one graph per length), gaudi-linear, gaudi-exponential, rbln, tpu (those runtimes' prefill "
        "lengths) or a config's. Total = attention (incl. dispatch overhead and mask "
        f"builds) + compiles. {len(data['sweep'])} rows: every one in the appendix and in report.json."
        + _options(data["sweep"]), "",
        "![frontier](frontier.png)", "",
        "![hit rate](hit_rate.png)", "",
        ("### Best policy per capacity (first bucket scheme, best online eviction; belady = offline bound "
         "on misses)"), "",
        table(("capacity", "best policy", "total s", "cost-aware vs best fixed policy"),
              [(capacity_text(c["capacity"]), c["best_policy"], c["total_seconds"], c["vs_best_fixed"])
               for c in data["summary"]]), "",
        *_bounds(data), "",
        "## 3. Simulator vs real compute (same prefix, config and batches)", "",
        f"**Takeaway:** {_validation_takeaway(data)}", "",
        (f"First {s['validate_requests']} requests, capacity {s['validate_capacity']}, LRU, "
         "real tensors and real compiles, every output checked against the float64 reference."), "",
        table(("policy", "batches", "misses pred/meas", "compile s pred/meas", "attention s pred/meas",
               "total s pred/meas", "max abs err", "check"),
              [(v["policy"], v["batches"], f"{v['predicted_misses']} / {v['measured_misses']}",
                f"{v['predicted_compile_seconds']:.3g} / {v['measured_compile_seconds']:.3g}",
                f"{v['predicted_attention_seconds']:.3g} / {v['measured_attention_seconds']:.3g}",
                f"{v['predicted_total_seconds']:.3g} / {v['measured_total_seconds']:.3g}",
                v["max_abs_err"], _check(v)) for v in data["validation"]]), "",
        "## 4. The plan per policy (attnpolicy plan)", "",
        (f"**Takeaway:** `{rec['policy']}` with the plan's buckets takes {_pct(rec['saving_vs_base_lru'])} time "
         f"than {rec['base_buckets']} buckets + LRU at {bound_text(rec['max_graphs'], rec['max_bytes'])} (the plan "
         f"tries those buckets beside its own lists). The full plan (warm set, candidates) is "
         f"`{rec['config_dir']}/plan.md`."), "",
        table(("policy", "planned buckets", "eviction", "plan total s", "peak MiB", f"{rec['base_buckets']} + lru s",
               f"{rec['base_buckets']} + belady s"),
              [(p["policy"], sizes_text(p["buckets"]), p["eviction"], p["total_seconds"],
                p["peak_bytes"] / MIB, p["base_lru_seconds"], p["base_belady_seconds"]) for p in data["plan"]]), "",
        *_whole_requests(data.get("whole_requests")),
        "## Appendix: every sweep row", "",
        ("Bound = max graphs (∞: unbounded), max bytes. Modes c/m/v: batches run causal / mask / varlen."), "",
        table(("buckets", "policy", "bound", "eviction", "misses", "hit rate", "compile s", "attention s",
               "total s", "over lower bound", "peak MiB", "modes c/m/v"),
              [(r["buckets"], r["policy"], _bound(r), r["eviction"], r["misses"], r["hit_rate"],
                r["compile_seconds"], r["attention_seconds"], r["total_seconds"], f"{r['bound_gap']:+.1%}",
                r["peak_bytes"] / MIB, "/".join(str(r["modes"][m]) for m in ("causal", "mask", "varlen")))
               for r in data["sweep"]]), "",
        *_baselines(data["sweep"]),
    ]
    return "\n".join(lines)
