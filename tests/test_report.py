"""The report's answer (first screen, recommendation, saved config) and its plots."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from attnpolicy.bench.mode_timing import Speedup
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.modelling.simulation import simulate
from attnpolicy.report.build import ValidationRow
from attnpolicy.report.markdown import first_screen, markdown
from attnpolicy.report.plots import MIB, TT_XLA, Marked, best_rows, plot_bench, plot_hit_rate, plot_sweep
from attnpolicy.report.recommend import TOLERANCE, plan_bound, simulator_error
from attnpolicy.workloads.batching import BatchFormer, Workload
from attnpolicy.workloads.traces import Request

REQUESTS = [Request(0.0, 40, 3), Request(0.1, 150, 2), Request(0.2, 7, 4), Request(0.3, 90, 1),
            Request(0.4, 300, 2), Request(0.5, 64, 3)]
FORMER = {"max_num_seqs": 3, "max_num_batched_tokens": 256}
SMALL = ["--limit", "8", "--policies", "dynamic,varlen", "--capacities", "2,inf", "--evictions", "lru,lfu,belady",
         "--buckets", "pow2", "--bench-lengths", "64", "--bench-repeats", "1", "--validate-requests", "1",
         "--kernel-lengths", "64", "--kernel-skip", "flex"]
MODEL = ["--model", "qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64",
         "--model-lengths", "16,128", "--model-backend", "aot_eager"]


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["report", "--out", str(out), *SMALL, *MODEL]) == 0
    return out, json.loads((out / "report.json").read_text()), " ".join(printed.getvalue().split())


def test_first_40_lines_hold_the_answer_and_agree_with_the_json(small_report):
    out, data, _ = small_report
    rec = data["recommendation"]
    assert data["cost_model_source"].startswith("calibrated now on this machine")  # the default
    top = "\n".join((out / "report.md").read_text().splitlines()[:40])
    assert f"| policy | `{rec['policy']}` |" in top
    assert f"| buckets | {', '.join(map(str, rec['buckets']))} |" in top
    assert f"| eviction | `{rec['eviction']}` |" in top
    assert f"| warm set | {rec['warm_graphs']} graphs" in top
    assert f"**Predicted total {rec['total_seconds']:.4g} s**" in top
    saving = rec["saving_vs_defaults"]
    assert f"{abs(saving):.0%} {'less' if saving >= 0 else 'more'} than the defaults" in top
    assert f"({rec['default_total_seconds']:.4g} s: varlen" in top
    assert f"**Peak graph memory {rec['peak_bytes'] / MIB:.0f} MiB**" in top
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
    assert nbytes is None and min(r.total_seconds for r in at) <= (1 + TOLERANCE) * best
    chosen_peak = min(r.peak_bytes for r in at if r.total_seconds <= (1 + TOLERANCE) * best)
    for cap in {r.capacity for r in online} - {capacity}:
        good = [r for r in online if r.capacity == cap and r.total_seconds <= (1 + TOLERANCE) * best]
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
           "pow2_lru_total_seconds": 9.0, "pow2_lru_peak_bytes": 4 * MIB, "config_dir": "r/config",
           "apply": ["attnpolicy run --config r/config", "ATTNPOLICY_CONFIG=r/config vllm serve MODEL"],
           "saving_vs_defaults": 0.2, "saving_vs_pow2_lru": 1 - 8 / 9,
           "simulator_error": {"compile": -0.6, "total": 0.1, "trusted": False}}
    workload = {"settings": {"trace": "default", "limit": None},
                "workload": Workload(400, 0, 2173, BatchFormer().knobs).to_json()}
    text = "\n".join(first_screen({**workload, "recommendation": rec, "cost_model_source": "built-in"}))
    assert "WARNING" in text and "compile seconds -60%" in text and "20% less than the defaults" in text
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
    mark = Marked(2, None, 1.5, 3.0, 0.8, "varlen, 2 graphs")
    frontier = plot_sweep(rows, tmp_path / "f.png", mark)
    assert frontier.marked == (1.5, 3.0) and "recommended: varlen, 2 graphs" in frontier.title
    wins = {}
    for cap in (1, 2, 4, None):
        winner = min((r for rs in per_policy.values() for r in rs if r.capacity == cap),
                     key=lambda r: r.total_seconds)
        wins[winner.policy] = wins.get(winner.policy, 0) + 1
    top = max(wins, key=wins.get)
    assert frontier.title.startswith(f"{top} is fastest at {wins[top]} of 4 cache bounds")
    hits = plot_hit_rate(rows, tmp_path / "h.png", mark)
    assert hits.marked == (1.0, 80.0)  # capacity 2 is the second of 1, 2, 4, ∞
    for policy, rs in per_policy.items():
        by_capacity = sorted(rs, key=lambda r: (r.capacity is None, r.capacity or 0))
        enough = [r.capacity for r in by_capacity if r.hit_rate >= 0.9]
        expected = "never" if not enough else ("∞" if enough[0] is None else str(enough[0]))
        assert f"{policy} {expected}" in hits.title
    assert plot_hit_rate(rows, tmp_path / "h2.png", Marked(3, None, 1.0, 1.0, 0.5, "x")).marked is None
    bench = plot_bench([Speedup(128, 1, "causal", "mask", 1.3), Speedup(1024, 1, "causal", "mask", 2.1),
                        Speedup(128, 4, "varlen", "mask", 1.5)], tmp_path / "b.png")
    assert bench.title.startswith(f"one sequence at L 1024: MASK costs 2.10× causal here, {TT_XLA[1024]:.2f}× on tt-xla")
    assert "2.00× causal" in plot_bench([Speedup(100, 1, "mask", "causal", 0.5)], tmp_path / "b2.png").title
    for plot in (frontier, hits, bench):
        assert (tmp_path / plot.file).stat().st_size > 1000


def test_report_model_adds_the_whole_model_table_beside_tt_xla(small_report):
    out, data, _ = small_report
    bench = data["model_bench"]
    assert [(r["seq_len"], r["mode"]) for r in bench["rows"]] == [
        (16, "causal"), (16, "mask"), (128, "causal"), (128, "mask")]
    assert all(r["compiled_ms"] > 0 and r["compile_s"] > 0 for r in bench["rows"])
    text = (out / "report.md").read_text()
    section = text[text.index("### Whole-model forward (measured)"):text.index("### Implementations per family")]
    assert text.index("## 1. Mask vs mask-free") < text.index("### Whole-model forward")
    [row128] = [line for line in section.splitlines() if line.startswith("| 128 |")]
    [ratio] = [r for r in bench["ratios"] if r["seq_len"] == 128]
    assert f"{ratio['compiled']:.2f}×" in row128 and f"{TT_XLA[128]:.2f}×" in row128
    assert "Whole-model" not in markdown({**data, "model_bench": None})  # off by default: no section


def test_report_model_refuses_a_bad_spec_before_any_work(capsys, tmp_path):
    assert main(["report", "--out", str(tmp_path / "r"), "--model", "qwen3:depth=2", *SMALL]) == 2
    assert "unknown field 'depth'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
