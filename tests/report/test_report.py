"""The report's answer (first screen, recommendation, saved config) and its plots."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

import attnpolicy.report.build as report_build
from attnpolicy.bench.mode_timing import Ratio
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import dumps
from attnpolicy.errors import AllocationError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.modelling.bucket_schemes import bucket_scheme
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.runtime_sets import GraphSetsFile
from attnpolicy.modelling.simulation import simulate, simulate_layouts, simulation_config
from attnpolicy.planning.scheme_comparison import plan_whole_requests
from attnpolicy.planning.warmup_plan import Budget
from attnpolicy.report.build import ReportSettings, ValidationRow, whole_requests
from attnpolicy.report.markdown import _whole_requests, first_screen, markdown, sizes_text
from attnpolicy.report.plots import (
    MIB,
    TT_XLA,
    Marked,
    best_rows,
    mask_ratios,
    plot_bench,
    plot_hit_rate,
    plot_sweep,
)
from attnpolicy.report.recommend import (
    FASTEST,
    LEANEST,
    LEANEST_TOLERANCE,
    RECOMMENDED,
    NamedRow,
    explain,
    plan_bound,
    recommend,
    simulator_error,
)
from attnpolicy.report.units import human_bytes
from attnpolicy.workloads.batching import BatchFormer, Workload
from attnpolicy.workloads.traces import Request
from tests.cost_models import of_model, synthetic, with_rows, with_steps

REQUESTS = [Request(0.0, 40, 3), Request(0.1, 150, 2), Request(0.2, 7, 4), Request(0.3, 90, 1),
            Request(0.4, 300, 2), Request(0.5, 64, 3)]
FORMER = {"max_num_seqs": 3, "max_num_batched_tokens": 256}
SMALL = ["--limit", "8", "--policies", "dynamic,varlen", "--capacities", "2,inf", "--evictions", "lru,lfu,belady",
         "--buckets", "pow2,vllm", "--bench-lengths", "64", "--bench-repeats", "1", "--validate-requests", "1",
         "--kernel-lengths", "64", "--kernel-skip", "flex"]
TINY = "qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64"
MODEL = ["--model", TINY,
         "--model-lengths", "16,128", "--model-backend", "aot_eager"]


#: The report the tests read: ``REQUESTS`` under ``FORMER`` (the 300-token prompt is chunked), a cost
#: model calibrated on the smallest grid of every shape kind. Real compute (the validation, the
#: calibration) runs on short sequences: on the default trace the first request alone is 3724 tokens.
SMALL_WORKLOAD = ["--max-num-seqs", str(FORMER["max_num_seqs"]),
                  "--max-num-batched-tokens", str(FORMER["max_num_batched_tokens"]), "--calibrate-sizes", "16,64"]


def _trace(path):
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:{r.arrival:010.7f},{r.prompt_tokens},{r.output_tokens}\n" for r in REQUESTS))
    return path


#: The requests of section 5's slice in the report the tests read: fewer than ``REQUESTS``.
SLICE = 4


def _tiny_cost():
    """A whole-model cost model of TINY, its graphs run uncompiled (quick to measure)."""
    return of_model(with_rows(with_steps(compile_base=0.05)), TINY).model_copy(update={"backend": "none"})


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    trace = _trace(out.parent / "trace.csv")
    model_cost = CostFile(model=_tiny_cost()).save(out.parent / "model.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", "--out", str(out), "--trace", str(trace), *SMALL, *SMALL_WORKLOAD, *MODEL,
                     "--model-cost", str(model_cost), "--measure-requests", str(SLICE)]) == 0
    return out, json.loads((out / "report.json").read_text()), " ".join(printed.getvalue().split())


def test_first_40_lines_hold_the_answer_and_agree_with_the_json(small_report):
    out, data, _ = small_report
    rec = data["recommendation"]
    assert data["cost_model_source"].startswith("calibrated now on this machine (sizes 16,64, ")  # the default
    assert data["workload"]["requests"] == len(REQUESTS) and data["workload"]["former"]["max_num_seqs"] == 3
    top = "\n".join((out / "report.md").read_text().splitlines()[:40])
    assert f"| policy | `{rec['policy']}` |" in top
    assert f"| buckets | {sizes_text(rec['buckets'], ', ')} |" in top
    assert f"| eviction | `{rec['eviction']}` |" in top
    assert f"| warm set | {rec['warm_graphs']} graphs" in top
    assert f"**Predicted total {rec['total_seconds']:.4g} s**" in top
    saving = rec["saving_vs_defaults"]
    assert f"{abs(saving):.0%} {'less' if saving >= 0 else 'more'} than the defaults" in top
    assert f"({rec['default_total_seconds']:.4g} s: varlen" in top
    assert f"**Peak graph memory {human_bytes(rec['peak_bytes'])}**" in top
    assert f"than {rec['base_buckets']} buckets + LRU at the same capacity ({rec['base_lru_total_seconds']:.4g} s)" in top
    err = rec["simulator_error"]
    assert f"compile seconds {err['compile']:+.0%}, total seconds {err['total']:+.0%}" in top
    assert ("WARNING" in top) == (not err["trusted"])
    assert err["trusted"] == (abs(err["compile"]) <= 0.2 and abs(err["total"]) <= 0.2)
    for command in rec["apply"]:
        assert command in top
    assert f"ATTNPOLICY_CONFIG={out / 'config'}" in top
    # the numbers are those of the sweep and the validation
    defaults = next(r for r in data["sweep"] if (r["buckets"], r["policy"], r["capacity"], r["eviction"])
                    == ("pow2", "varlen", None, "lru"))
    assert rec["default_total_seconds"] == pytest.approx(defaults["total_seconds"])
    measured = sum(v["measured_compile_seconds"] for v in data["validation"])
    predicted = sum(v["predicted_compile_seconds"] for v in data["validation"])
    assert err["compile"] == pytest.approx(predicted / measured - 1)
    assert rec["total_seconds"] == pytest.approx(
        next(p["total_seconds"] for p in data["plan"] if p["policy"] == rec["policy"]))
    assert rec["total_seconds"] == min(p["total_seconds"] for p in data["plan"])


IDENTITY = ("policy", "buckets", "capacity", "max_bytes", "eviction")


def _online(rows):
    return [r for r in rows if r["eviction"] != "belady"]


def _fastest_and_leanest(rows):
    """The fastest online row of a sweep (JSON rows) and its leanest within 10 %, first of equals."""
    runnable = _online(rows)
    fastest = min(runnable, key=lambda r: r["total_seconds"])
    good = [r for r in runnable if r["total_seconds"] <= 1.1 * fastest["total_seconds"]]
    return fastest, min(good, key=lambda r: (r["peak_bytes"], r["total_seconds"]))


def _undominated(rows):
    """(peak MiB, total s) of the online rows that no other online row beats on one and equals on the other."""
    runnable = _online(rows)
    return sorted({(r["peak_bytes"] / MIB, r["total_seconds"]) for r in runnable if not any(
        (o["peak_bytes"], o["total_seconds"]) != (r["peak_bytes"], r["total_seconds"])
        and o["peak_bytes"] <= r["peak_bytes"] and o["total_seconds"] <= r["total_seconds"] for o in runnable)})


def test_first_screen_names_the_recommendation_the_fastest_and_the_leanest_rows(small_report):
    out, data, printed = small_report
    rec = data["recommendation"]
    fastest, leanest = _fastest_and_leanest(data["sweep"])
    named = {r["name"]: r for r in data["frontier"]["rows"]}
    assert list(named) == [RECOMMENDED, FASTEST, LEANEST]
    for name, row in ((FASTEST, fastest), (LEANEST, leanest)):
        got = named[name]
        assert [got[k] for k in IDENTITY] == [row[k] for k in IDENTITY]
        assert (got["total_seconds"], got["peak_bytes"], got["peak_graphs"], got["distinct_graphs"]) == (
            row["total_seconds"], row["peak_bytes"], row["peak_graphs"], row["distinct_keys"])
        assert got["vs_fastest"] == pytest.approx(row["total_seconds"] / fastest["total_seconds"])
    mine = named[RECOMMENDED]
    assert (mine["policy"], mine["capacity"], mine["max_bytes"], mine["eviction"], mine["total_seconds"],
            mine["peak_bytes"]) == (rec["policy"], rec["max_graphs"], rec["max_bytes"], rec["eviction"],
                                    rec["total_seconds"], rec["peak_bytes"])
    assert mine["vs_fastest"] == pytest.approx(rec["total_seconds"] / fastest["total_seconds"])
    # coherent: the plan runs at the leanest good bound and is no slower than the sweep's best row there
    assert (rec["max_graphs"], rec["max_bytes"]) == (leanest["capacity"], leanest["max_bytes"])
    at = [r for r in _online(data["sweep"]) if (r["capacity"], r["max_bytes"]) == (rec["max_graphs"], rec["max_bytes"])]
    assert rec["total_seconds"] <= min(r["total_seconds"] for r in at) * (1 + 1e-9)
    # the first screen: right after the workload line, before every other table
    lines = (out / "report.md").read_text().splitlines()
    assert lines[2].startswith("**Workload:**")
    head = next(i for i, line in enumerate(lines) if line.startswith("| row | policy | buckets |"))
    assert head <= 6
    later = min(i for i, line in enumerate(lines) if line.startswith("| ") and i > head + 4)
    assert lines[later].startswith("| setting | value |")
    for i, row in enumerate(named.values()):
        line = lines[head + 2 + i]
        assert line.startswith(f"| {row['name']} | `{row['policy']}` | {row['buckets']} |")
        assert (f"| {row['total_seconds']:.4g} | {row['vs_fastest']:.2f}× | {human_bytes(row['peak_bytes'])} "
                f"| {row['peak_graphs']} | {row['distinct_graphs']} |") in line
    why = data["frontier"]["why"]
    assert (why is None) == (abs(mine["vs_fastest"] - 1) <= 0.005 and mine["peak_bytes"] == leanest["peak_bytes"])
    if why is not None:
        assert lines[head + 6] == why
    for row in named.values():  # the command prints the first screen (rich draws the table)
        assert f"{row['name']} {row['policy']} {row['buckets']}" in printed


def test_frontier_plot_marks_the_three_rows_and_draws_the_pareto_frontier(small_report):
    _, data, _ = small_report
    plot = next(p for p in data["plots"] if p["file"] == "frontier.png")
    assert [m["name"] for m in plot["marks"]] == [RECOMMENDED, FASTEST, LEANEST]
    for row, mark in zip(data["frontier"]["rows"], plot["marks"]):
        assert [mark["x"], mark["y"]] == pytest.approx([row["peak_bytes"] / MIB, row["total_seconds"]])
        assert mark["label"].startswith(f"{row['name']}: {row['policy']}, {row['buckets']}, ")
        assert f"{row['name']} {row['total_seconds']:.4g} s at {row['peak_bytes'] / MIB:.0f} MiB" in plot["title"]
    drawn = sorted(map(tuple, plot["frontier"]))
    expected = _undominated(data["sweep"])
    assert len(drawn) == len(expected) > 0
    assert [v for p in drawn for v in p] == pytest.approx([v for p in expected for v in p])
    hits = next(p for p in data["plots"] if p["file"] == "hit_rate.png")
    assert [m["name"] for m in hits["marks"]] == [RECOMMENDED, FASTEST, LEANEST]  # no byte bound: all three


def test_saved_config_applies_the_recommendation(small_report):
    out, data, _ = small_report
    rec = data["recommendation"]
    config = AttnPolicyConfig.load(out / "config")
    assert (config.policy, config.eviction, config.max_graphs, config.max_bytes) == (
        rec["policy"], rec["eviction"], rec["max_graphs"], rec["max_bytes"])
    assert list(config.buckets.sizes_up_to(config.max_batch_tokens)) == rec["buckets"]
    assert len(config.warmup) == rec["warm_graphs"]
    assert (out / "config" / "plan.md").read_text().startswith("# Graph plan")


def test_plots_mark_the_recommendation_of_the_json(small_report):
    out, data, _ = small_report
    rec = data["recommendation"]
    plots = {p["file"]: p for p in data["plots"]}
    assert set(plots) == {"frontier.png", "hit_rate.png", "bench.png"}
    assert plots["frontier.png"]["marked"] == pytest.approx([rec["peak_bytes"] / MIB, rec["total_seconds"]])
    capacities = sorted({r["capacity"] for r in data["sweep"]}, key=lambda c: (c is None, c or 0))
    assert plots["hit_rate.png"]["marked"] == pytest.approx(
        [capacities.index(rec["max_graphs"]), 100 * rec["hit_rate"]])
    assert plots["bench.png"]["marked"] is None
    for name in plots:
        assert (out / name).stat().st_size > 1000


def test_a_failed_check_of_the_validation_is_said_in_its_section(small_report):
    """Every validation row passed its check; one that had not (a NaN in an output) is
    marked in the table and named in the section's takeaway."""
    out, data, _ = small_report
    assert all(v["passed"] and v["non_finite"] == 0 for v in data["validation"])
    section = (out / "report.md").read_text().split("## 3. Simulator vs real compute")[1].split("## 4.")[0]
    assert "| check |" in section and "failed their check" not in section
    bad = {**data["validation"][0], "passed": False, "non_finite": 32}
    text = markdown({**data, "validation": [bad, *data["validation"][1:]]})
    section = text.split("## 3. Simulator vs real compute")[1].split("## 4.")[0]
    assert f"**the outputs of {bad['policy']} failed their check**" in section and "**FAIL** (32 non-finite)" in section


def test_report_prints_the_first_screen(small_report):
    _, data, printed = small_report
    assert "Recommended for this workload on this machine" in printed
    assert f"Predicted total {data['recommendation']['total_seconds']:.4g} s" in printed
    assert data["recommendation"]["apply"][1] in printed


def _sweep():
    return simulate(REQUESTS, ["dynamic", "varlen"], [1, 2, 4, None], ["lru", "belady"], former_options=FORMER)


def test_plan_bound_is_the_leanest_bound_near_the_best():
    rows = _sweep()
    capacity, nbytes = plan_bound(rows, ["dynamic", "varlen"])
    online = [r for r in rows if r.eviction != "belady"]
    best = min(r.total_seconds for r in online)
    at = [r for r in online if r.capacity == capacity]
    assert nbytes is None and min(r.total_seconds for r in at) <= (1 + LEANEST_TOLERANCE) * best
    chosen_peak = min(r.peak_bytes for r in at if r.total_seconds <= (1 + LEANEST_TOLERANCE) * best)
    for cap in {r.capacity for r in online} - {capacity}:
        good = [r for r in online if r.capacity == cap and r.total_seconds <= (1 + LEANEST_TOLERANCE) * best]
        assert all(r.peak_bytes >= chosen_peak for r in good)


def _validation(compile_pred, compile_meas, total_pred, total_meas):
    return ValidationRow("varlen", 4, 10, 3, 3, compile_pred, compile_meas, 0.1, 0.1, total_pred, total_meas, 0.0)


def test_simulator_error_is_flagged_past_20_percent():
    ok = simulator_error([_validation(1.0, 1.1, 2.0, 2.1)])
    assert ok.trusted and ok.compile == pytest.approx(1.0 / 1.1 - 1)
    off = simulator_error([_validation(1.0, 2.6, 2.0, 2.1), _validation(1.0, 2.6, 2.0, 2.1)])
    assert not off.trusted and off.compile == pytest.approx(2.0 / 5.2 - 1)
    assert simulator_error([_validation(0.0, 0.0, 0.0, 0.0)]).compile is None


def test_first_screen_warns_when_the_simulator_is_off():
    rec = {"policy": "varlen", "buckets": [16, 64], "max_graphs": 4, "max_bytes": None, "eviction": "lfu",
           "warm_graphs": 2, "warm_compile_seconds": 0.5, "warm_calls": 9, "calls": 10, "total_seconds": 8.0,
           "peak_bytes": 3 * MIB, "default_total_seconds": 10.0, "default_peak_bytes": 5 * MIB,
           "base_buckets": "pow2", "base_lru_total_seconds": 9.0, "base_lru_peak_bytes": 4 * MIB,
           "config_dir": "r/config",
           "apply": ["attnpolicy run --config r/config", "ATTNPOLICY_CONFIG=r/config vllm serve MODEL"],
           "saving_vs_defaults": 0.2, "saving_vs_base_lru": 1 - 8 / 9,
           "simulator_error": {"compile": -0.6, "total": 0.1, "trusted": False}}
    row = {"name": RECOMMENDED, "policy": "varlen", "buckets": "pow2", "capacity": 4, "max_bytes": None,
           "eviction": "lfu", "total_seconds": 8.0, "vs_fastest": 1.0, "peak_bytes": 3 * MIB, "peak_graphs": 4,
           "distinct_graphs": 7, "hit_rate": 0.9}
    workload = {"settings": {"trace": "default", "limit": None},
                "workload": Workload(400, 0, 2173, BatchFormer().knobs).to_json(),
                "frontier": {"rows": [row, {**row, "name": FASTEST}, {**row, "name": LEANEST}], "why": None}}
    text = "\n".join(first_screen({**workload, "recommendation": rec, "cost_model_source": "built-in"}))
    assert "WARNING" in text and "compile seconds -60%" in text and "20% less than the defaults" in text
    assert "11% less than pow2 buckets + LRU at the same capacity (9 s)" in text
    assert "| fastest | `varlen` | pow2 | 4 graphs | `lfu` | 8 | 1.00× | 3 MiB | 4 | 7 |" in text
    assert "attnpolicy calibrate" in text
    assert text.startswith("**Workload:** `default`: 400 requests (400 admitted, 0 rejected) → 2173 batches")
    calibrated = "\n".join(first_screen({**workload, "recommendation": rec, "cost_model_source": "calibrated now"}))
    assert "WARNING" in calibrated and "quieter machine" in calibrated
    rec["simulator_error"] = {"compile": 0.05, "total": -0.1, "trusted": True}
    assert "WARNING" not in "\n".join(first_screen({**workload, "recommendation": rec,
                                                     "cost_model_source": "built-in"}))


def test_plots_render_from_a_small_sweep_with_findings_in_their_titles(tmp_path):
    rows = _sweep()
    per_policy = best_rows(rows, "pow2")
    assert all(len(rs) == 4 for rs in per_policy.values())  # one point per capacity, belady left out
    mark = Marked(RECOMMENDED, "varlen, 2 graphs", 1.5, 3.0, 2, 2, None, 0.8)
    frontier = plot_sweep(rows, tmp_path / "f.png", [mark])
    assert frontier.marked == (1.5, 3.0) and "recommended 3 s at 2 MiB" in frontier.title
    assert [(p.name, p.label) for p in frontier.marks] == [(RECOMMENDED, "recommended: varlen, 2 graphs")]
    drawn = [v for p in sorted(frontier.frontier) for v in p]
    assert drawn == pytest.approx([v for p in _undominated([r.to_json() for r in rows]) for v in p])
    wins = {}
    for cap in (1, 2, 4, None):
        winner = min((r for rs in per_policy.values() for r in rs if r.capacity == cap),
                     key=lambda r: r.total_seconds)
        wins[winner.policy] = wins.get(winner.policy, 0) + 1
    top = max(wins, key=wins.get)
    assert frontier.title.startswith(f"{top} is fastest at {wins[top]} of 4 cache bounds")
    hits = plot_hit_rate(rows, tmp_path / "h.png", [mark])
    assert hits.marked == (1.0, 80.0)  # capacity 2 is the second of 1, 2, 4, ∞
    for policy, rs in per_policy.items():
        by_capacity = sorted(rs, key=lambda r: (r.capacity is None, r.capacity or 0))
        enough = [r.capacity for r in by_capacity if r.hit_rate >= 0.9]
        expected = "never" if not enough else ("∞" if enough[0] is None else str(enough[0]))
        assert f"{policy} {expected}" in hits.title
    assert plot_hit_rate(rows, tmp_path / "h2.png", [Marked("x", "x", 1.0, 1.0, 3, 3, None, 0.5)]).marked is None
    def one(length: int, mask: float, rows: float) -> Ratio:  # over causal; rows the fastest of three
        over = {"causal": 1.0, "mask": mask, "rows": rows}
        return Ratio(length, 1, "rows", "causal", 1 / rows, over={"call": over})
    bench = plot_bench([one(128, 1.3, 0.9), one(1024, 2.1, 0.8),
                        Ratio(128, 4, "varlen", "rows", 1.1, over={"call": {"mask": 1.0, "varlen": 0.5, "rows": 0.6}})],
                       tmp_path / "b.png")
    assert bench.title.startswith(f"one sequence at L 1024: MASK costs 2.10× causal here, {TT_XLA[1024]:.2f}× on tt-xla")
    assert "0.50× causal" in plot_bench([one(100, 0.5, 2.0)], tmp_path / "b2.png").title
    spread = Ratio(128, 4, "varlen", "mask", 10.0, over={"call": {"mask": 1.0, "varlen": 0.1}}, split="spread")
    assert mask_ratios([Ratio(128, 4, "varlen", "mask", 2.0, over={"call": {"mask": 1.0, "varlen": 0.5}}), spread],
                       4) == [(128, 2.0)]  # the equal split's only
    for plot in (frontier, hits, bench):
        assert (tmp_path / plot.file).stat().st_size > 1000


def test_report_model_adds_the_whole_model_table_beside_tt_xla(small_report):
    out, data, _ = small_report
    bench = data["model_bench"]
    assert [(r["seq_len"], r["num_seqs"], r["mode"]) for r in bench["rows"]] == [
        (16, 1, "causal"), (16, 1, "mask"), (16, 1, "rows"), (128, 1, "causal"), (128, 1, "mask"), (128, 1, "rows")]
    assert all(r["compiled_ms"] > 0 and r["compile_s"] > 0 for r in bench["rows"])
    text = (out / "report.md").read_text()
    section = text[text.index("### Whole-model forward (measured)"):text.index("### Implementations per family")]
    assert text.index("## 1. Mask vs mask-free") < text.index("### Whole-model forward")
    [row128] = [line for line in section.splitlines() if line.startswith("| 128 |")]
    [ratio] = [r for r in bench["ratios"] if r["seq_len"] == 128]
    assert f"{ratio['compiled']['mask']:.2f}× | {ratio['compiled']['rows']:.2f}×" in row128
    assert f"{TT_XLA[128]:.2f}×" in row128
    assert "Whole-model" not in markdown({**data, "model_bench": None})  # off by default: no section


def test_report_model_cost_adds_the_warm_up_schemes_on_whole_requests(small_report):
    out, data, printed = small_report
    whole = data["whole_requests"]
    schemes = {r["scheme"]: r for r in whole["schemes"]}
    assert {"gaudi-exponential", "tpu", "vllm", "pow2", "plan (gaudi form)", "plan (ragged form)"} <= set(schemes)
    assert whole["limits"]["max_num_seqs"] == FORMER["max_num_seqs"]
    runnable = [r for r in whole["schemes"] if r.get("runtime_compiles") == 0 and not r["reference"]]
    best = min(runnable, key=lambda r: r["total_seconds"])
    assert whole["recommended"] == best["scheme"]
    text = (out / "report.md").read_text()
    screen = text[:text.index("## 1. Mask vs mask-free")]
    line = f"Warm-up schemes on whole requests** ({TINY}, modelled, section 5): lowest modelled total: {best['scheme']}"
    assert f"**{line}" in screen and f"Warm-up schemes on whole requests ({TINY}, modelled, section 5)" in printed
    section = text[text.index("## 5. Warm-up schemes on whole requests"):text.index("## Appendix")]
    assert f"| {best['scheme']} * |" in section and "| floor |" in section
    host = json.loads((out / "whole_requests" / "host_settings.json").read_text())
    assert host["tpu"]["num_tokens_paddings"] == whole["plans"]["ragged"]["grid"]["tokens"]
    assert (out / "whole_requests" / "gaudi_buckets.txt").read_text().startswith("# vllm-gaudi buckets")
    assert "## 5." not in markdown({**data, "whole_requests": None})  # off by default: no section


def _strict(path):
    return json.loads(path.read_text(), parse_constant=pytest.fail)


def _slice_rows(requests, cost):
    """The plan's gaudi-form row and the runtime defaults this runner serves, planned on
    ``requests`` under ``FORMER`` as section 5 plans (unbounded budget)."""
    former = BatchFormer(**FORMER)
    steps = [st.layout for st in former.steps(requests)]
    comparison, _ = plan_whole_requests(steps, PeerLimits(former.max_num_seqs, former.max_num_batched_tokens,
                                                          former.max_model_len), cost, Budget(), 8)
    defaults = [r for r in comparison.measurable() if r.default]
    return next(r for r in comparison.rows if r.scheme == "plan (gaudi form)"), defaults


def test_report_measures_the_plan_and_the_best_runtime_default_on_a_slice(small_report):
    """Section 5 runs exactly two rows on the first ``--measure-requests`` requests: the
    plan's gaudi form, then the served default of the lowest modelled total on the slice;
    each warm-up compiles the row's graphs and nothing compiles after it."""
    out, data, _ = small_report
    sliced = _strict(out / "report.json")["whole_requests"]["measured_slice"]
    plan, defaults = _slice_rows(REQUESTS[:SLICE], _tiny_cost())
    best = min(defaults, key=lambda r: r.cost.total_seconds)
    assert {r.scheme for r in defaults} == {"gaudi-linear", "gaudi-exponential", "rbln"}
    assert sliced["requests"] == SLICE and sliced["steps"] == len(list(BatchFormer(**FORMER).steps(REQUESTS[:SLICE])))
    assert sliced["model"] == TINY and sliced["budget_seconds"] == 120
    assert [r["scheme"] for r in sliced["rows"]] == [plan.scheme, best.scheme]
    for row, modelled in zip(sliced["rows"], (plan.cost, best.cost)):
        m = row["measured"]
        assert row["left_modelled"] is None and row["modelled"] == modelled.to_json()
        assert m["graphs"] == modelled.graphs and m["runtime_compiles"] == modelled.runtime_compiles == 0
        assert m["strict_violations"] == 0 and m["total_seconds"] > 0
        assert row["modelled_over_measured"] == pytest.approx(modelled.total_seconds / m["total_seconds"])
    text = (out / "report.md").read_text()
    section = text[text.index("### Measured on a slice"):text.index("## Appendix")]
    for row in sliced["rows"]:
        m = row["measured"]
        assert (f"| {row['scheme']} | {row['modelled']['total_seconds']:.4g} | {m['total_seconds']:.4g} | "
                f"{row['modelled_over_measured']:.2f}× | {m['graphs']} | 0 |") in section
    assert f"| first {SLICE} requests, {sliced['steps']} steps, max_num_seqs 3, " in section
    screen = text[:text.index("## 1. Mask vs mask-free")]
    ratios = ", ".join(f"{r['scheme']} {r['modelled_over_measured']:.2f}×" for r in sliced["rows"])
    assert f"Modelled / measured total on a slice of {SLICE} requests: {ratios}." in screen
    sets = GraphSetsFile.load(out / "whole_requests")  # every row's set, for run --model --plan
    assert list(sets.sets) == [r["scheme"] for r in data["whole_requests"]["schemes"] if "graphs" in r]


def _section(tmp_path, **settings):
    """Section 5 of ``REQUESTS`` (report.json's part and report.md's) under ``settings``."""
    path = CostFile(model=_tiny_cost()).save(tmp_path / "m.json")
    s = ReportSettings(out=tmp_path / "r", model_cost=str(path), former=FORMER, **settings)
    former = BatchFormer(**FORMER)
    whole = whole_requests(s, REQUESTS, list(former.steps(REQUESTS)), former, lambda label: None)
    dumps(whole, "whole_requests")  # strict JSON
    text = "\n".join(_whole_requests(whole))
    return whole, text[text.index("### Measured on a slice"):]


def test_measure_requests_0_measures_nothing_and_the_section_says_so(tmp_path):
    whole, section = _section(tmp_path, measure_requests=0)
    assert whole["measured_slice"] is None
    assert "Nothing measured (`--measure-requests 0`): every row above is modelled." in section
    assert "| slice |" not in section


@pytest.mark.parametrize("over", ["the default", "both"])
def test_a_row_over_measure_seconds_stays_modelled_with_the_reason(tmp_path, over):
    """The rows are measured in order while the modelled totals measured stay within the
    budget: at the plan's own total the default goes over; at none both do."""
    plan, defaults = _slice_rows(REQUESTS, _tiny_cost())
    best = min(defaults, key=lambda r: r.cost.total_seconds)
    budget = plan.cost.total_seconds if over == "the default" else 0.0
    whole, section = _section(tmp_path, measure_seconds=budget)
    rows = {r["scheme"]: r for r in whole["measured_slice"]["rows"]}
    assert list(rows) == [plan.scheme, best.scheme]
    left = [best.scheme] if over == "the default" else [plan.scheme, best.scheme]
    for scheme, row in rows.items():
        total = row["modelled"]["total_seconds"]
        if scheme in left:
            reached = total + (plan.cost.total_seconds if over == "the default" else 0.0)
            assert row["measured"] is None and row["modelled_over_measured"] is None
            assert row["left_modelled"] == (f"measured, the rows would reach {reached:.4g} modelled s, over the "
                                            f"budget of {budget:g} (--measure-seconds)")
            assert f"- `{scheme}` stays modelled ({total:.4g} modelled s): {row['left_modelled']}." in section
            assert f"| {scheme} | {total:.4g} | modelled |  | {row['modelled']['graphs']} (modelled) |" in section
        else:
            assert row["measured"]["graphs"] == row["modelled"]["graphs"] and row["left_modelled"] is None


def test_a_slice_whose_run_fails_stays_modelled_and_the_report_keeps_its_work(tmp_path, monkeypatch):
    """A run the machine cannot make (its KV cache not allocated) leaves the rows modelled,
    saying why, and the section is still written."""
    def fails(*args, **kwargs):
        raise AllocationError("a KV cache of 2 slots needs 99 bytes, more than cpu can allocate")
    monkeypatch.setattr(report_build, "measured_sets", fails)
    whole, section = _section(tmp_path)
    rows = whole["measured_slice"]["rows"]
    assert rows and all(r["measured"] is None for r in rows)
    assert all(r["left_modelled"] == "the run failed: a KV cache of 2 slots needs 99 bytes, more than cpu can "
               "allocate" for r in rows)
    assert "stays modelled" in section


@pytest.mark.parametrize(("argv", "error"), [
    (["--model-cost", "{synthetic}"],
     "argument --model-cost: {synthetic} prices a model that cannot be loaded here to measure on a slice: model "
     "spec 'synthetic'"),
    (["--measure-requests", "3"], "argument --measure-requests: needs --model-cost PATH"),
    (["--model-cost", "{tiny}", "--measure-seconds", "inf"], "argument --measure-seconds: "),
    (["--model-cost", "{tiny}", "--max-seq-len", "9000"],
     "argument --max-seq-len: 9000 is more than the 8192 positions of --model-cost " + TINY),
], ids=["unloadable", "without-model-cost", "infinite", "positions"])
def test_report_refuses_a_slice_it_cannot_measure_before_any_work(capsys, tmp_path, argv, error):
    files = {"synthetic": str(CostFile(model=with_rows(with_steps())).save(tmp_path / "s.json")),
             "tiny": str(CostFile(model=_tiny_cost()).save(tmp_path / "t.json"))}
    assert main(["report", "--out", str(tmp_path / "r"), *SMALL, *(a.format(**files) for a in argv)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and error.format(**files) in lines[0] and captured.out == ""
    assert not (tmp_path / "r").exists()


def test_measure_requests_0_takes_a_model_cost_this_machine_cannot_load(tmp_path):
    path = CostFile(model=with_rows(with_steps(compile_base=0.05))).save(tmp_path / "m.json")  # spec "synthetic"
    s = ReportSettings(out=tmp_path / "r", model_cost=str(path), former=FORMER, measure_requests=0)
    former = BatchFormer(**FORMER)
    whole = whole_requests(s, REQUESTS, list(former.steps(REQUESTS)), former, lambda label: None)
    assert whole["model"] == "synthetic" and whole["measured_slice"] is None


def test_report_refuses_a_model_cost_without_step_fits_before_any_work(capsys, tmp_path):
    path = CostFile(model=synthetic()).save(tmp_path / "m.json")
    assert main(["report", "--out", str(tmp_path / "r"), "--model-cost", str(path), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "argument --model-cost" in err and "no step-graph fits" in err
    assert not (tmp_path / "r").exists()


def test_report_model_refuses_a_bad_spec_before_any_work(capsys, tmp_path):
    assert main(["report", "--out", str(tmp_path / "r"), "--model", "qwen3:depth=2", *SMALL]) == 2
    assert "unknown field 'depth'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


LONG = [Request(0.1 * i, n, 2) for i, n in enumerate((1100, 1500, 600, 700, 1030, 530, 2100, 1300))]


def _cheap_compiles(scale: float = 1e-3) -> CostModel:
    """The built-in cost model with compiles ``scale`` times as dear: padding dominates."""
    model = CostModel.default()
    return model.model_copy(update={"compile": {
        f: Fit(base=fit.base * scale, per_cell=fit.per_cell * scale, per_token=fit.per_token * scale)
        for f, fit in model.compile.items()}})


def test_the_plan_is_not_slower_than_the_sweeps_best_row_at_its_bound(tmp_path):
    """With compiles nearly free, vLLM's fine buckets beat pow2's severalfold; a plan of
    one-size lists started from pow2 was far above the sweep's best at its bound, and
    the report said nothing. The plan now starts from the bucket scheme of that row."""
    model = _cheap_compiles()
    former = BatchFormer(max_num_seqs=3, max_num_batched_tokens=4096)
    base = simulation_config(model, former)
    schemes = [bucket_scheme(b, base.max_seq_len, base.max_batch_tokens) for b in ("pow2", "vllm")]
    steps = list(former.steps(LONG))
    rows = simulate_layouts(steps, ["varlen", "dynamic"], [2, None], ["lru", "belady"], base, model, buckets=schemes)
    rec, _, frontier = recommend(steps, rows, base, model, ["varlen", "dynamic"], ["lru", "belady"], [], tmp_path,
                                 1, "test", schemes)
    online = [r for r in rows if r.eviction != "belady"]
    at = min((r for r in online if (r.capacity, r.max_bytes) == (rec.max_graphs, rec.max_bytes)),
             key=lambda r: r.total_seconds)
    pow2 = min((r for r in online if r.buckets == "pow2"), key=lambda r: r.total_seconds)
    assert at.buckets == "vllm" and pow2.total_seconds > 2 * at.total_seconds  # the case
    assert rec.total_seconds <= at.total_seconds * (1 + 1e-9)
    assert rec.total_seconds <= (1 + LEANEST_TOLERANCE) * min(r.total_seconds for r in online)
    assert rec.base_buckets == "vllm" and frontier.rows[0].buckets == "vllm (kept by the plan)"
    config = AttnPolicyConfig.load(tmp_path / "config")
    assert tuple(config.buckets.sizes_up_to(config.max_batch_tokens)) == rec.buckets


def test_explain_says_why_the_recommendation_is_not_the_fastest_or_the_leanest_row():
    rows = _sweep()
    leanest = next(r for r in rows if (r.policy, r.capacity, r.eviction) == ("varlen", None, "lru"))
    fastest = replace(leanest, policy="cost-aware", total_seconds=leanest.total_seconds / 2)
    seed = replace(leanest, buckets="exact", capacity=2, total_seconds=fastest.total_seconds * 2)
    rec = NamedRow(RECOMMENDED, "varlen", "planned: 16, 64 (2 sizes)", 2, None, "lru", fastest.total_seconds * 3, 3.0,
                leanest.peak_bytes * 2, 2, 5, 0.9)
    why = explain(rec, fastest, leanest, seed, ["varlen", "dynamic"], 4)
    assert why is not None and why.startswith(
        f"The recommendation is 200% slower than the fastest row ({fastest.total_seconds:.4g} s): ")
    assert "the fastest row's `cost-aware` decides from the cache state" in why
    assert "the plan runs at 2 graphs, the leanest bound within 10%" in why and "holds ∞ graphs" in why
    assert "lists of at most 4 planned sizes" in why and "are 50% slower than the sweep's exact row" in why
    assert "as exact buckets, one graph per length, are no list a plan can hold" in why
    assert (f"holds {human_bytes(rec.peak_bytes)} of graphs at peak (2 held, 5 compiled) against the leanest row's "
            f"{human_bytes(leanest.peak_bytes)}") in why and why.endswith("the plan minimises time at its bound, not memory.")
    same = replace(rec, total_seconds=fastest.total_seconds, vs_fastest=1.0, peak_bytes=leanest.peak_bytes)
    assert explain(same, fastest, leanest, seed, ["varlen"], 4) is None  # as fast and as lean: nothing to say
    faster = explain(replace(same, vs_fastest=0.9, peak_bytes=MIB), fastest, leanest, seed, ["varlen"], 4)
    assert faster == (f"The recommendation is 10% faster than the fastest row ({fastest.total_seconds:.4g} s): "
                      f"its planned buckets beat every swept scheme; it holds less: 1 MiB of graphs at peak "
                      f"(2 held, 5 compiled) against the leanest row's {human_bytes(leanest.peak_bytes)} "
                      f"({leanest.peak_graphs} held, {leanest.distinct_keys} compiled).")


def test_report_refuses_a_calibration_size_off_pow2_before_any_work(capsys, tmp_path):
    assert main(["report", "--out", str(tmp_path / "r"), *SMALL, "--calibrate-sizes", "16,48"]) == 2
    assert "argument --calibrate-sizes: must be one or more powers of two, got 16,48" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_report_refuses_a_sweep_without_a_live_eviction_before_any_work(capsys, tmp_path):
    assert main(["report", "--out", str(tmp_path / "r"), *SMALL, "--evictions", "belady"]) == 2
    err = capsys.readouterr().err
    assert "--evictions" in err and "live eviction" in err and "belady" in err
    assert not (tmp_path / "r").exists()
