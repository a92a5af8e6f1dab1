"""CostModel: fits, predictions, JSON files, the built-in default, calibration."""

from __future__ import annotations

import json

import pytest

from attnpolicy.bench.calibration import calibrate, shapes
from attnpolicy.bench.settings import CalibrationSettings
from attnpolicy.cli import main
from attnpolicy.core.modes import CallKind
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.graphs.keys import GraphKey, TensorSpec


def key(kind: str, q: int, kv: int, model: CostModel, backend: str = "aot_eager") -> GraphKey:
    return GraphKey(CallKind(kind), q, kv, True, model.spec, model.impl, None, backend)


def test_fit_recovers_exact_coefficients():
    truth = Fit(base=1e-4, per_cell=2e-9, per_token=3e-7)
    samples = [(q, kv, truth(q, kv)) for q in (16, 64, 256, 1024) for kv in (q, 4 * q)]
    fit = Fit.to_samples(samples)
    for q, kv, seconds in samples:
        assert fit(q, kv) == pytest.approx(seconds, rel=1e-6)


def test_fit_never_has_negative_coefficients():
    # decreasing seconds would need a negative slope: the fit clamps it to a constant
    fit = Fit.to_samples([(16, 16, 3e-3), (256, 256, 2e-3), (4096, 4096, 1e-3)])
    assert fit.per_cell == 0.0 and fit.per_token == 0.0 and fit.base > 0


def test_fit_rejects_bad_samples():
    with pytest.raises(ConfigError, match="at least one"):
        Fit.to_samples([])
    with pytest.raises(ConfigError, match="seconds > 0"):
        Fit.to_samples([(16, 16, 0.0)])


def test_fit_is_the_documented_formula():
    # base + per_cell·rows·cols + per_token·(rows + cols), written out: 1 + 2·20 + 3·9
    assert Fit(base=1.0, per_cell=2.0, per_token=3.0)(4, 5) == 68.0


def test_predictions_use_the_fit_of_the_key_kind():
    """Each kind has its own fit (distinct bases here); ``none`` compiles nothing."""
    model = CostModel(run={f: Fit(base=b) for f, b in zip(CallKind, (1.0, 2.0, 3.0))},
                      compile={f: Fit(base=b) for f, b in zip(CallKind, (10.0, 20.0, 30.0))},
                      mask_build=Fit(per_cell=0.5))
    for kind, run, compile_s in zip(CallKind, (1.0, 2.0, 3.0), (10.0, 20.0, 30.0)):
        assert model.run_seconds(key(kind, 64, 256, model)) == run
        assert model.call_seconds(kind, 64, 256) == run
        assert model.compile_seconds(key(kind, 64, 256, model)) == compile_s
        assert model.compile_seconds(key(kind, 64, 256, model, backend="none")) == 0.0
    assert model.mask_build_seconds(4, 8) == 16.0


def test_json_keys_are_the_kind_names():
    data = json.loads(CostModel.default().model_dump_json())
    assert sorted(data["run"]) == sorted(data["compile"]) == ["causal", "mask", "rows", "varlen"]


@pytest.mark.parametrize("kind", list(CallKind))
def test_default_predictions_monotone_in_work(kind):
    model = CostModel.default()
    sizes = [16 << i for i in range(10)]
    for what in (model.run_seconds, model.compile_seconds):
        square = [what(key(kind, n, n, model)) for n in sizes]
        decode = [what(key(kind, 16, n, model)) for n in sizes]
        assert square == sorted(square) and square[0] < square[-1]
        assert decode == sorted(decode) and decode[0] < decode[-1]
    builds = [model.mask_build_seconds(n, n) for n in sizes]
    assert builds == sorted(builds) and builds[0] < builds[-1]


def test_default_model_describes_its_calibration():
    model = CostModel.default()
    assert model.spec.heads == model.heads and model.backend == "aot_eager"
    assert model.samples and model.call_overhead_seconds > 0
    k = key("mask", 64, 256, model)
    assert model.graph_bytes(k) > 0


def test_json_round_trip(tmp_path):
    model = CostModel.default()
    path = model.save(tmp_path / "sub" / "model.json")
    loaded = CostModel.load(path)
    assert loaded == model
    k = key("causal", 512, 512, model)
    assert loaded.run_seconds(k) == model.run_seconds(k)


@pytest.mark.parametrize("text, match", [
    ("{not json", "invalid JSON at line 1"),
    ("[1, 2]", "expected a JSON object"),
    ('{"version": 7}', "unsupported cost model version 7"),
    ("{}", "run: Field required"),
])
def test_corrupt_files_name_the_file_and_problem(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        CostModel.load(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["run"]["mask"].update(per_cell=-1.0), "run.mask.per_cell: Input should be greater"),
    (lambda d: d["compile"].pop("varlen"), "compile needs a fit for every call kind; missing: varlen"),
    (lambda d: d.update(kv_heads=3), "kv_heads 3 must divide heads 8"),
    (lambda d: d.update(colour="red"), "colour: Extra inputs are not permitted"),
    # strict: nothing coerced
    (lambda d: d["run"]["mask"].update(base=True), r"run.mask.base: Input should be a valid number \(got True\)"),
    (lambda d: d["run"]["mask"].update(base="0.1"), r"run.mask.base: Input should be a valid number \(got '0.1'\)"),
    (lambda d: d.update(heads=8.0), "heads: Input should be a valid integer"),
    (lambda d: d.update(version=True), "unsupported cost model version True"),
    # every prediction finite: bounded coefficients, run fits above the floor
    (lambda d: d["run"]["mask"].update(base=1e308), r"run.mask.base: must be at most 1e\+12 .*\(got 1e\+308\)"),
    (lambda d: d["compile"]["causal"].update(per_token=1e300), "compile.causal.per_token: must be at most 1e"),
    (lambda d: d.update(warmup_seconds=float("nan")), "warmup_seconds: Input should be a finite number"),
    (lambda d: d["run"].update(varlen={"base": 0.0}), "run.varlen predicts 0 s for a call of one token"),
    (lambda d: d["run"].update(causal={"base": 5e-324}), "run.causal predicts 4.94066e-324 s"),
])
def test_bad_field_values_are_named(tmp_path, edit, match):
    data = json.loads(CostModel.default().model_dump_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        CostModel.load(path)


def test_a_model_derived_in_code_may_exceed_the_bound_of_a_file():
    """The bound guards what is read: a planner's model with compiles some times dearer
    (or any model built in code) may hold larger coefficients, and still predicts finitely."""
    model = CostModel.default()
    dearer = model.model_copy(update={"compile": {k: Fit(base=64 * 1e12) for k in model.compile}})
    assert dearer.compile_seconds(key("mask", 16, 16, model)) == 64e12
    with pytest.raises(ConfigError, match="compile.mask.base: must be at most"):
        CostModel.from_json(dearer.model_dump_json(), "dearer.json")


def test_the_spec_a_model_was_calibrated_on_is_compared():
    model = CostModel.default()
    assert model.spec_differs(model.spec) is None
    assert model.spec_differs(TensorSpec("float16", 4, 1, 8)) == ("calibrated on float32 h8/kv8/d64, not "
                                                                  "float16 h4/kv1/d8")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        CostModel.load(tmp_path / "nope.json")


def test_quick_grid_is_a_subset_with_every_kind():
    full = shapes(CalibrationSettings())
    quick = shapes(CalibrationSettings(quick=True))
    assert set(quick) < set(full) and len(set(full)) == len(full)
    assert {kind for kind, _, _ in quick} == set(CallKind)
    assert ("causal", 4096, 4096) in quick and ("varlen", 16, 4096) in quick


def test_calibrate_cli_measures_through_the_dispatcher(tmp_path):
    out = tmp_path / "model.json"
    assert main(["calibrate", "--out", str(out), "--backend", "eager", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "8", "--max-len", "64", "--repeats", "1", "--quick"]) == 0
    model = CostModel.load(out)
    settings = CalibrationSettings(2, 1, 8, backend="eager", max_len=64, repeats=1, quick=True)
    grid = shapes(settings)
    assert (model.heads, model.kv_heads, model.head_dim, model.backend, model.threads) == (2, 1, 8, "eager", 1)
    assert [(s.kind, s.rows, s.cols) for s in model.samples if s.what == "compile"] == grid
    assert sum(s.what == "mask_build" for s in model.samples) == sum(k == "mask" for k, _, _ in grid)
    assert all(s.seconds > 0 for s in model.samples if s.what != "mask_build")


def test_calibrate_fits_each_kind_to_its_own_samples():
    model = calibrate(CalibrationSettings(heads=2, kv_heads=2, head_dim=8, backend="eager", max_len=32,
                                          repeats=1))
    for kind in CallKind:
        for what in ("run", "compile"):
            mine = [(x.rows, x.cols, max(x.seconds, 1e-9)) for x in model.samples
                    if x.what == what and x.kind is kind]
            assert mine and getattr(model, what)[kind] == Fit.to_samples(mine), (what, kind)
    builds = [(x.rows, x.cols, max(x.seconds, 1e-9)) for x in model.samples if x.what == "mask_build"]
    assert model.mask_build == Fit.to_samples(builds)


# -- the one-off backend start-up, call statistics, the report's validation ------------------

def _model(warmup: float, backend: str = "aot_eager") -> CostModel:
    return CostModel(run={f: Fit(base=1e-3) for f in CallKind}, compile={f: Fit(base=0.1) for f in CallKind},
                     mask_build=Fit(per_cell=1e-9), warmup_seconds=warmup, backend=backend)


def test_warmup_is_charged_once_per_compiling_backend():
    model = _model(2.5)
    keys = [key("causal", 16, 16, model), key("mask", 64, 64, model), key("causal", 16, 16, model)]
    assert model.warmup_cost(keys) == 2.5
    assert model.warmup_cost([*keys, key("mask", 16, 16, model, backend="inductor")]) == 5.0
    assert model.warmup_cost([key("causal", 16, 16, model, backend="none")]) == 0.0
    assert model.warmup_cost([]) == 0.0


@pytest.mark.parametrize("policy", ["dynamic", "cost-aware"])
def test_simulator_charges_the_warmup_once_per_row(policy):
    """Stream replays (a fixed policy) and dispatcher runs (cost-aware) alike: every row
    that compiles pays the start-up once, in compile, total and bound seconds, however
    many misses it has."""
    from attnpolicy.modelling.simulation import simulate, simulation_config
    from attnpolicy.workloads.batching import BatchFormer
    from attnpolicy.workloads.traces import Request

    requests = [Request(0.0, 40, 3), Request(0.1, 150, 2), Request(0.2, 7, 4), Request(0.3, 300, 2)]
    former = {"max_num_seqs": 3, "max_num_batched_tokens": 256}
    rows = {}
    for warmup in (0.0, 7.0):
        model = _model(warmup)
        config = simulation_config(model, BatchFormer(**former))
        rows[warmup] = simulate(requests, [policy], [1, None], ["lru", "belady"], config, model, former)
    for cold, warm in zip(rows[0.0], rows[7.0]):
        assert cold.misses == warm.misses > 1 and warm.warmup_seconds == 7.0 and cold.warmup_seconds == 0.0
        assert warm.compile_with_warmup_seconds == pytest.approx(cold.compile_with_warmup_seconds + 7.0)
        assert warm.total_seconds == pytest.approx(cold.total_seconds + 7.0)
        assert warm.bound_seconds == pytest.approx(cold.bound_seconds + 7.0)


def test_round_trip_keeps_the_warmup_and_older_files_load_without_it(tmp_path):
    model = _model(1.25)
    assert CostModel.load(model.save(tmp_path / "m.json")).warmup_seconds == 1.25
    data = json.loads((tmp_path / "m.json").read_text())
    del data["warmup_seconds"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert CostModel.load(tmp_path / "old.json").warmup_seconds == 0.0


def test_sizes_choose_the_grid():
    grid = shapes(CalibrationSettings(sizes=(256, 16)))
    assert {kv for _, _, kv in grid} == {16, 256} and {k for k, _, _ in grid} == set(CallKind)
    with pytest.raises(ValueError, match="sizes\n.*powers of two"):
        CalibrationSettings(sizes=(16, 100))


@pytest.mark.parametrize("statistic", ["min", "mean"])
def test_calibration_statistic_and_warmup(monkeypatch, statistic):
    """Each timed call reports 1 s then 3 s: ``min`` keeps 1, ``mean`` averages the runs
    (the very first run of a shape, which caches its mask, runs untimed before the
    rounds); the warm-up is the first compile's seconds over the fitted compile of its key."""
    import attnpolicy.bench.calibration as calibration

    monkeypatch.setattr(calibration, "_run_seconds", lambda fn: [1.0, 3.0])
    monkeypatch.setattr(calibration, "warm_up", lambda backend: 9.0)
    model = calibrate(CalibrationSettings(heads=2, kv_heads=2, head_dim=8, backend="eager", sizes=(16, 64),
                                          repeats=2, statistic=statistic))
    runs = {x.seconds for x in model.samples if x.what == "run" and x.kind is not CallKind.ROWS}
    rows = {x.seconds for x in model.samples if x.what == "run" and x.kind is CallKind.ROWS}
    builds = {x.seconds for x in model.samples if x.what == "mask_build"}
    assert (runs, builds) == (({1.0}, {1.0}) if statistic == "min" else ({2.0}, {2.0}))
    assert rows == {min(runs) / calibration.CALIBRATION_ROWS}  # a rows sample is one row's seconds
    assert model.warmup_seconds == pytest.approx(9.0 - model.compile[CallKind.CAUSAL](16, 16))


def test_validation_rows_carry_predictions_without_the_warmup_and_their_ratios():
    from attnpolicy.modelling.simulation import simulate, simulation_config
    from attnpolicy.report.build import ReportSettings, validate_predictions
    from attnpolicy.workloads.batching import BatchFormer
    from attnpolicy.workloads.traces import Request

    requests = [Request(0.0, 40, 3), Request(0.1, 90, 2)]
    s = ReportSettings(former={"max_num_seqs": 2, "max_num_batched_tokens": 128}, validate_capacity=2,
                       policies=("dynamic", "varlen"))
    model = CostModel(run={f: Fit(base=1e-4) for f in CallKind}, compile={f: Fit(base=0.05) for f in CallKind},
                      mask_build=Fit(per_cell=1e-9), warmup_seconds=3.0, heads=2, kv_heads=1, head_dim=8)
    rows = validate_predictions(model, requests, s, lambda label: None)
    assert [v.policy for v in rows] == ["dynamic", "varlen"]
    former = BatchFormer(**s.former)
    for v in rows:
        config = simulation_config(model, former, policy=v.policy, max_graphs=2)
        (sim,) = simulate(requests, [v.policy], [2], ["lru"], config, model, s.former)
        assert v.predicted_misses == v.measured_misses == sim.misses > 0
        assert v.predicted_warmup_seconds == 3.0
        assert v.predicted_compile_seconds == pytest.approx(sim.compile_with_warmup_seconds - 3.0)
        assert v.predicted_total_seconds == pytest.approx(sim.total_seconds - 3.0)
        assert v.compile_ratio == pytest.approx(v.predicted_compile_seconds / v.measured_compile_seconds)
        assert v.attention_ratio == pytest.approx(v.predicted_attention_seconds / v.measured_attention_seconds)
        assert v.total_ratio == pytest.approx(v.predicted_total_seconds / v.measured_total_seconds)
        assert v.max_abs_err is not None and v.max_abs_err < 1e-4


def test_calibrate_cli_sizes_and_statistic(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert main(["calibrate", "--out", str(out), "--backend", "eager", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "8", "--sizes", "16,64", "--statistic", "mean", "--repeats", "1"]) == 0
    model = CostModel.load(out)
    grid = shapes(CalibrationSettings(sizes=(16, 64)))
    assert [(s.kind, s.rows, s.cols) for s in model.samples if s.what == "compile"] == grid
    assert model.samples[0].what == "compile" and {s.seconds > 0 for s in model.samples if s.what == "run"} == {True}
    assert main(["calibrate", "--out", str(out), "--sizes", "16,100"]) == 2
    assert "argument --sizes: must be one or more powers of two" in capsys.readouterr().err
