"""`attnpolicy run` (real compute replay) and `attnpolicy report` end to end, small."""

from __future__ import annotations

import json
import os

import pytest

from attnpolicy.bench.replay import AttentionReplay, replay
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.simulation import simulate
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

REQUESTS = [Request(0.0, 40, 3), Request(0.1, 150, 2), Request(0.2, 7, 4), Request(0.3, 90, 1)]
FORMER = {"max_num_seqs": 3, "max_num_batched_tokens": 128}
SPEC = TensorSpec("float32", 4, 2, 16)


def test_run_checks_every_output_and_counts_like_the_simulator():
    former = BatchFormer(**FORMER)
    for policy in ("dynamic", "varlen", "always-mask"):
        config = AttnPolicyConfig(policy=policy, backend="none", max_graphs=3, max_seq_len=512,
                                  max_batch_tokens=2048)
        result = replay(AttentionReplay(REQUESTS, config, SPEC, former, check=True))
        assert result.max_abs_err < 1e-5
        assert result.batches == len(list(former.steps(REQUESTS)))
        assert sum(result.modes.values()) == result.batches
        assert result.total_seconds >= result.run_seconds >= 0
        # the built-in cost model is for aot_eager; the backend does not change hits and misses
        modelled = AttnPolicyConfig.model_validate({**config.model_dump(), "backend": "aot_eager"})
        (row,) = simulate(REQUESTS, [policy], [3], ["lru"], modelled, None, FORMER)
        assert (row.hits, row.misses) == (result.figures["cache"]["hits"], result.misses)


def test_run_command_writes_json(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:17:03.9799600,60,3\n2023-11-16 18:17:04.0319600,30,2\n")
    out = tmp_path / "run.json"
    assert main(["run", "--trace", str(trace), "--policy", "varlen", "--backend", "none", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "16", "--max-seq-len", "256", "--check",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["max_abs_err"] < 1e-5 and data["modes"]["varlen"] + data["modes"]["causal"] == data["batches"]
    assert data["config"]["policy"] == "varlen" and "cache" in data
    assert "max abs err" in capsys.readouterr().out


def test_report_writes_markdown_json_and_plots(tmp_path):
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--limit", "12", "--policies", "dynamic,varlen,cost-aware",
                 "--capacities", "2,inf", "--evictions", "lru,belady", "--buckets", "pow2,vllm",
                 "--bench-lengths", "64,128", "--bench-repeats", "1", "--validate-requests", "1",
                 "--kernel-lengths", "64", "--kernel-skip", "flex", "--calibrate-sizes", "16,64"]) == 0
    data = json.loads((out / "report.json").read_text())
    rows = {(r["buckets"], r["policy"], r["capacity"], r["eviction"]): r for r in data["sweep"]}
    assert len(rows) == 2 * 3 * 2 * 2
    for (buckets, policy, capacity, eviction), row in rows.items():
        assert row["total_seconds"] >= row["bound_seconds"] - 1e-9
        if eviction == "belady":
            assert row["misses"] <= rows[(buckets, policy, capacity, "lru")]["misses"]
    assert {(b["buckets"], b["policy"]) for b in data["bounds"]} == {
        (s, p) for s in ("pow2", "vllm") for p in ("dynamic", "varlen", "cost-aware")}
    assert {r["seq_len"] for r in data["bench"]["rows"]} == {64, 128}
    for v in data["validation"]:
        assert v["predicted_misses"] == v["measured_misses"] and v["max_abs_err"] < 1e-4
    text = (out / "report.md").read_text()
    for section in ("## 1. Mask vs mask-free", "## 2. Bucket schemes", "### How far from optimal",
                    "### Bucket schemes side by side", "## 3. Simulator vs real compute"):
        assert section in text
    assert (out / "frontier.png").stat().st_size > 1000 and (out / "bench.png").stat().st_size > 1000
    # the first screen names the fastest online row of every scheme and policy (cost-aware's included)
    fastest = min((r for r in data["sweep"] if r["eviction"] != "belady"), key=lambda r: r["total_seconds"])
    recommended, first, _ = data["frontier"]["rows"]
    assert (first["buckets"], first["policy"], first["total_seconds"]) == (
        fastest["buckets"], fastest["policy"], fastest["total_seconds"])
    assert recommended["policy"] in ("dynamic", "varlen")  # a plan runs stateless policies only
    assert "| recommended |" in text[:text.index("## 1. Mask vs mask-free")]


def test_report_kernel_table_has_a_row_for_a_plugin_kernel(tmp_path, fresh_plugins):
    """A third-party kernel registered through ``attnpolicy_register_kernels`` is timed
    in the report's kernel table (``bench --kernels``) in every kind it serves."""
    from plugin_kernels import recording_sdpa

    from attnpolicy.plugins.hookspecs import hookimpl
    from attnpolicy.plugins.kernels import KernelInfo
    from attnpolicy.plugins.registry import get_plugin_manager

    plain, calls = recording_sdpa()

    class Plugin:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            for kind in ("causal", "varlen", "mask"):
                register(KernelInfo("plain", kind, plain, gqa=False))

    get_plugin_manager().register(Plugin(), name="plain-plugin")
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--limit", "3", "--policies", "varlen", "--capacities", "2",
                 "--evictions", "lru", "--bench-lengths", "32", "--bench-repeats", "1", "--validate-requests", "1",
                 "--kernel-lengths", "32", "--kernel-skip", "flex", "--calibrate-sizes", "16,64"]) == 0
    data = json.loads((out / "report.json").read_text())
    rows = {(r["family"], r["impl"]): r for r in data["kernels"]["rows"]}
    assert {("varlen", "plain"), ("mask", "plain"), ("loop", "sdpa")} <= set(rows)
    assert not any(impl == "flex" for _, impl in rows)
    assert rows[("mask", "plain")]["build_ms"] is not None and rows[("varlen", "plain")]["build_ms"] is None
    assert calls  # the rows timed the plugin's kernel
    section = (out / "report.md").read_text().split("### Implementations per family")[1]
    for kind in ("varlen", "mask"):
        assert f"| 4x8 | {kind} | plain | none |" in section


def test_report_kernel_skip_must_name_a_registered_kernel(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path), "--kernel-skip", "nosuch"]) != 0
    err = capsys.readouterr().err
    assert "--kernel-skip" in err and "nosuch" in err


def _crash_on_fsync(monkeypatch):
    """The next fsync (an atomic write's text is written, not yet renamed) kills the process."""
    def crash(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", crash)


@pytest.mark.parametrize("argv", [
    ["simulate", "--limit", "4", "--policies", "varlen", "--capacities", "2", "--evictions", "lru", "--json"],
    ["stalls", "--limit", "4", "--capacities", "2", "--warm", "none", "--json"],
    ["run", "--limit", "2", "--backend", "none", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--json"],
], ids=lambda a: a[0])
def test_a_crash_while_writing_cli_json_leaves_the_previous_file_whole(tmp_path, monkeypatch, argv):
    path = tmp_path / "out.json"
    path.write_text('{"previous": true}\n')
    _crash_on_fsync(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        main([*argv, str(path)])
    assert path.read_text() == '{"previous": true}\n' and list(tmp_path.iterdir()) == [path]


def test_a_crash_while_writing_the_report_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    out = tmp_path / "report"
    out.mkdir()
    old = {"report.json": '{"previous": true}\n', "report.md": "# previous\n"}
    for name, text in old.items():
        (out / name).write_text(text)
    _crash_on_fsync(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        main(["report", "--out", str(out), "--limit", "3", "--policies", "varlen", "--capacities", "2",
              "--evictions", "lru", "--bench-lengths", "32", "--bench-repeats", "1", "--validate-requests", "1",
              "--kernel-lengths", "32", "--kernel-skip", "flex", "--calibrate-sizes", "16,64"])
    assert {name: (out / name).read_text() for name in old} == old
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def _priced(tmp_path, kind: str, scale: float):
    """The built-in cost model with ``kind``'s run fit scaled by ``scale``."""
    from attnpolicy.graphs.costmodel import CostModel

    data = CostModel.default().model_dump(mode="json")
    data["run"][kind] = {term: value * scale for term, value in data["run"][kind].items()}
    path = tmp_path / f"model_{kind}_{scale:g}.json"
    path.write_text(json.dumps(data))
    return CostModel.load(path)


def test_run_prices_cost_aware_with_the_cost_model_it_is_given(tmp_path):
    """cost-aware decides on the run's cost model: a model whose MASK calls are 100×
    dearer makes other decisions than the built-in one, and the run given it decides
    and misses exactly as the simulation with it does."""
    former = BatchFormer(**FORMER)
    requests = [Request(0.1 * i, n, 2) for i, n in enumerate((40, 150, 7, 90, 33, 120, 64, 18, 200, 75))]
    config = AttnPolicyConfig(policy="cost-aware", backend="aot_eager", max_graphs=2, max_seq_len=512,
                              max_batch_tokens=2048)
    dear = _priced(tmp_path, "mask", 100.0)
    (cheap_row,) = simulate(requests, ["cost-aware"], [2], ["lru"], config, None, FORMER)
    (dear_row,) = simulate(requests, ["cost-aware"], [2], ["lru"], config, dear, FORMER)
    assert cheap_row.modes != dear_row.modes  # the model changes the decisions
    result = replay(AttentionReplay(requests, config, SPEC, former, check=True, cost_model=dear))
    assert result.modes == dear_row.modes
    assert (result.figures["cache"]["hits"], result.misses) == (dear_row.hits, dear_row.misses)


def _register(name, fn):
    """Register ``fn`` as plugin kernel ``name`` of every call kind."""
    from attnpolicy.plugins.hookspecs import hookimpl
    from attnpolicy.plugins.kernels import KernelInfo
    from attnpolicy.plugins.registry import get_plugin_manager

    class Plugin:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            for kind in ("causal", "mask", "varlen"):
                register(KernelInfo(name, kind, fn))

    get_plugin_manager().register(Plugin(), name=f"{name}-plugin")


def test_run_check_fails_on_a_kernel_that_returns_nan_in_one_row(tmp_path, capsys, fresh_plugins):
    """A plugin kernel that passes its probe, then returns NaN in the first row of each
    prefill (the other rows right): ``run --check`` fails, naming the non-finite values,
    and its JSON stays strict (the error of the finite values, their count apart)."""
    from plugin_kernels import nan_row_0

    _register("nan-row-0", nan_row_0)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"version": 1, "kernels": dict.fromkeys(("causal", "mask", "varlen"), "nan-row-0")}))
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,60,3\n")
    out = tmp_path / "run.json"
    assert main(["run", "--trace", str(trace), "--config", str(config), "--policy", "varlen", "--backend", "none",
                 "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--max-seq-len", "256", "--check",
                 "--json", str(out)]) == 1
    captured = capsys.readouterr()
    # row 0 of the one prefill: 2 heads × 16 values
    assert "the check failed: 32 non-finite values in the outputs or their reference" in captured.err
    data = json.loads(out.read_text(), parse_constant=pytest.fail)
    assert data["passed"] is False and data["non_finite"] == 32 and data["max_abs_err"] < 1e-5
    assert "FAIL" in captured.out


def test_the_reports_validation_fails_on_outputs_that_hold_nan(monkeypatch):
    """The report's real replays go through the same check: a kernel returning NaN in the
    first row of each prefill fails its validation row."""
    from plugin_kernels import nan_row_0

    from attnpolicy.graphs.costmodel import CostModel
    from attnpolicy.kernels import attention
    from attnpolicy.report.build import ReportSettings, validate_predictions

    model = CostModel.default().model_copy(update={"backend": "none", "heads": 2, "kv_heads": 1, "head_dim": 16})
    settings = ReportSettings(policies=("varlen",), former=FORMER)
    (clean,) = validate_predictions(model, REQUESTS[:2], settings, lambda _: None)
    assert clean.passed is True and clean.non_finite == 0
    monkeypatch.setitem(attention._IMPL_FNS, "sdpa", nan_row_0)
    (row,) = validate_predictions(model, REQUESTS[:2], settings, lambda _: None)
    assert row.passed is False and row.non_finite > 0 and row.max_abs_err == row.max_abs_err  # finite, no NaN
