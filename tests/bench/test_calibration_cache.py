"""The calibration cache: keyed by what a fit depends on, tolerant of broken files, and the
cost model every pricing command names on its first line (no real calibration here:
the calibration function is replaced by a counting fake)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from cost_models import synthetic

from attnpolicy.bench import calibration_cache as cc
from attnpolicy.bench.settings import CalibrationSettings, ModelCalibrationSettings
from attnpolicy.cli import calibrate as cli_calibrate
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.report.build import ReportSettings

#: A calibration that is not the built-in model.
CALIBRATED = CostModel.default().model_copy(update={"call_overhead_seconds": 7e-6})
BUILT_IN = "cost model: built-in (not calibrated on this machine; run `attnpolicy calibrate` or `attnpolicy report` first"
SIMULATE = ["simulate", "--limit", "3", "--policies", "varlen", "--capacities", "inf", "--evictions", "lru",
            "--workers", "1"]
CHEAP_REPORT = ["--policies", "always-mask", "--buckets", "pow2", "--capacities", "inf", "--evictions", "lru",
                "--workers", "1", "--bench-lengths", "64", "--bench-repeats", "1", "--kernel-lengths", "64",
                "--kernel-skip", "flex", "--plan-max-buckets", "2", "--limit", "3"]


def run(argv: list[str]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calibrations of ``attnpolicy calibrate`` and ``report``; each returns :data:`CALIBRATED`."""
    made: list[CalibrationSettings] = []

    def fake(s, progress=None):
        made.append(s)
        return CALIBRATED

    monkeypatch.setattr("attnpolicy.cli.calibrate.calibrate", fake)
    monkeypatch.setattr("attnpolicy.report.build.calibrate", fake)
    return made


def test_the_cache_dir_honours_the_environment(tmp_path, monkeypatch, calibration_cache_dir):
    assert cc.cache_dir() == calibration_cache_dir
    entry = cc.store(CalibrationSettings(), CALIBRATED)
    assert entry.path.parent == calibration_cache_dir / "costmodels" and CostModel.load(entry.path) == CALIBRATED
    monkeypatch.delenv(cc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir() == tmp_path / "xdg" / "attnpolicy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.cache_dir() == tmp_path / "home" / ".cache" / "attnpolicy"


def test_a_hit_needs_the_same_machine_code_and_settings(monkeypatch):
    s = CalibrationSettings(sizes=(16, 64), repeats=1)
    warnings: list[str] = []
    assert cc.lookup(s, warnings.append) is None
    cc.store(s, CALIBRATED)
    hit = cc.lookup(s, warnings.append)
    assert hit is not None and hit.model == CALIBRATED
    assert cc.find("aot_eager", "sdpa", warnings.append).path == hit.path
    # another grid, backend or spec is another entry
    for other in (CalibrationSettings(sizes=(16, 128), repeats=1), CalibrationSettings(sizes=(16, 64), repeats=2),
                  CalibrationSettings(sizes=(16, 64), repeats=1, backend="eager"),
                  CalibrationSettings(heads=4, kv_heads=4, sizes=(16, 64), repeats=1)):
        assert cc.lookup(other, warnings.append) is None, other
    assert cc.find("eager", "sdpa", warnings.append) is None
    assert cc.find("aot_eager", "eager", warnings.append) is None
    # another torch, CPU or calibration code misses, by lookup and by find
    for target, name, value in ((cc, "torch_version", lambda: "9.9.9"), (cc, "cpu_model", lambda: "another cpu"),
                                (cc, "calibration_code", lambda: "0" * 16)):
        with monkeypatch.context() as m:
            m.setattr(target, name, value)
            assert cc.lookup(s, warnings.append) is None, name
            assert cc.find("aot_eager", "sdpa", warnings.append) is None, name
    assert warnings == []


def test_find_takes_the_newest_entry():
    old = cc.store(CalibrationSettings(sizes=(16,)), CALIBRATED)
    old_key = old.path.with_name(old.path.stem + ".key.json")
    old_key.write_text(json.dumps({**json.loads(old_key.read_text()), "created": "2000-01-01 00:00 UTC"}))
    newer = CALIBRATED.model_copy(update={"call_overhead_seconds": 9e-6})
    new = cc.store(CalibrationSettings(sizes=(32,)), newer)
    assert new.path != old.path
    assert cc.find("aot_eager", "sdpa", lambda message: pytest.fail(message)).model == newer


@pytest.mark.parametrize("broken", ["key", "model"])
def test_a_corrupt_cache_file_is_ignored_with_one_warning(broken):
    s = ReportSettings().calibration
    entry = cc.store(s, CALIBRATED)
    file = entry.path if broken == "model" else entry.path.with_name(entry.path.stem + ".key.json")
    file.write_text("{ not json")
    warnings: list[str] = []
    assert cc.lookup(s, warnings.append) is None
    assert len(warnings) == 1 and str(file) in warnings[0] and "unreadable calibration cache file" in warnings[0]
    out, err = run(SIMULATE)
    assert out.startswith(BUILT_IN)
    assert [line for line in err.splitlines() if "calibration cache" in line] == [
        f"attnpolicy: warning: {warnings[0]}"]


def test_plan_and_simulate_name_their_cost_model_first_and_reuse_a_calibration(tmp_path, calls):
    outputs = {"simulate": [*SIMULATE, "--json", str(tmp_path / "sim.json")],
               "plan": ["plan", "--limit", "3", "--policies", "varlen", "--out", str(tmp_path / "plan")],
               "stalls": ["stalls", "--limit", "3", "--capacities", "4", "--warm", "none",
                          "--json", str(tmp_path / "stalls.json")]}
    files = {"simulate": tmp_path / "sim.json", "plan": tmp_path / "plan" / "plan.json",
             "stalls": tmp_path / "stalls.json"}
    for name, argv in outputs.items():  # nothing cached: the built-in model, said first
        out, _ = run(argv)
        assert out.splitlines()[0].startswith(BUILT_IN), name
        assert json.loads(files[name].read_text())["cost_model_provenance"] == {
            "kind": "built-in", "file": None, "created": None}
    out, err = run(["calibrate", "--out", str(tmp_path / "model.json"), "--sizes", "16,32", "--repeats", "1"])
    assert len(calls) == 1
    cached = cc.find("aot_eager", "sdpa", lambda message: pytest.fail(message))
    assert cached is not None and cached.model == CALIBRATED and str(cached.path) in "".join(err.split())
    for _ in range(2):  # a second run reuses the calibration: nothing is calibrated again
        for name, argv in outputs.items():
            out, _ = run(argv)
            assert out.splitlines()[0] == f"cost model: calibrated here {cached.created}, {cached.path}", name
            assert json.loads(files[name].read_text())["cost_model_provenance"] == {
                "kind": "calibrated", "file": str(cached.path), "created": cached.created}
    assert len(calls) == 1
    given = CostModel.default().save(tmp_path / "given.json")
    out, _ = run([*SIMULATE, "--cost-model", str(given)])
    assert out.splitlines()[0] == f"cost model: {given} (--cost-model)"
    # a config's backend chooses the calibration: none of its own, then one
    config = tmp_path / "eager"
    AttnPolicyConfig(backend="eager").save(config)
    assert cc.find("eager", "sdpa", lambda message: pytest.fail(message)) is None
    eager = cc.store(CalibrationSettings(backend="eager"), CALIBRATED.model_copy(update={"backend": "eager"}))
    out, _ = run([*SIMULATE, "--config", str(config)])
    assert out.splitlines()[0] == f"cost model: calibrated here {eager.created}, {eager.path}"


#: Runs ``attnpolicy ARGV...`` with every import of torch refused.
NO_TORCH = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch refused")
sys.meta_path.insert(0, Refuse())
from attnpolicy.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["plan", "--out", "{tmp}/plan"], ["simulate"]])
def test_plan_and_simulate_name_a_cached_calibration_without_loading_torch(tmp_path, command):
    """The first line needs neither torch nor the plugins: with torch refused the commands
    still name their (cached) cost model first. ``plan`` needs no torch at all (its
    kernels are chosen by name) and writes the same plan; ``simulate`` runs dispatchers,
    which load it, and fails after its first line."""
    cached = cc.store(CalibrationSettings(), CALIBRATED)
    assert cc.torch_version() == torch.__version__  # what the key holds is what torch says
    argv = [a.format(tmp=tmp_path) for a in command] + ["--limit", "3"]
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=600)
    assert done.stdout.splitlines()[0] == f"cost model: calibrated here {cached.created}, {cached.path}", done.stderr
    if command[0] == "simulate":
        assert done.returncode != 0 and "torch refused" in done.stderr  # what follows needs torch
        return
    assert done.returncode == 0, done.stderr
    refused = json.loads((tmp_path / "plan" / "plan.json").read_text())
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    run(argv)  # in this process, torch loaded
    assert json.loads((tmp_path / "again" / "plan.json").read_text()) == refused


def test_one_file_keeps_both_families_and_the_cache_keeps_the_attention_fits(tmp_path, calls, monkeypatch):

    from attnpolicy.modelling.cost_file import CostFile

    whole = synthetic()
    attention = cli_calibrate.calibrate  # the calls fixture's

    def calibrating(model):  # the model level's calibration returns ``model``
        monkeypatch.setattr(cli_calibrate, "calibrate", lambda s, progress=None: model if isinstance(
            s, ModelCalibrationSettings) else attention(s, progress))

    calibrating(whole)
    path = tmp_path / "costs.json"
    run(["calibrate", "--model", "llama:layers=1", "--out", str(path)])  # no file yet: the model section only
    assert CostFile.load(path) == CostFile(model=whole)
    run(["calibrate", "--out", str(path), "--sizes", "16", "--repeats", "1"])  # adds the attention section
    assert CostFile.load(path) == CostFile(CALIBRATED, whole) and len(calls) == 1
    cached = cc.find("aot_eager", "sdpa", lambda message: pytest.fail(message))
    assert cached is not None and cached.model == CALIBRATED and "model" not in json.loads(cached.path.read_text())
    newer = whole.model_copy(update={"warmup_seconds": 9.0})
    calibrating(newer)
    run(["calibrate", "--model", "llama:layers=1", "--out", str(path)])  # replaces the model section only
    assert CostFile.load(path) == CostFile(CALIBRATED, newer)
    out, _ = run([*SIMULATE, "--cost-model", str(path)])  # each family reads its own section
    assert out.splitlines()[0] == f"cost model: {path} (--cost-model)"
    out, _ = run([*SIMULATE, "--cost-model", str(path), "--family", "model", "--max-seq-len", "2048",
                  "--json", str(tmp_path / "m.json")])
    assert json.loads((tmp_path / "m.json").read_text())["model"] == "synthetic"


def test_a_second_report_reuses_its_calibration(tmp_path, calls):
    first, _ = run(["report", "--out", str(tmp_path / "a"), *CHEAP_REPORT])
    path = cc.entry_path(ReportSettings().calibration)
    assert first.splitlines()[0] == f"cost model: calibrated now on this machine, kept in {path}"
    assert len(calls) == 1 and calls[0] == ReportSettings().calibration
    second, _ = run(["report", "--out", str(tmp_path / "b"), *CHEAP_REPORT])
    assert len(calls) == 1
    entry = cc.lookup(ReportSettings().calibration, lambda message: pytest.fail(message))
    assert entry is not None and entry.path == path
    assert second.splitlines()[0] == f"cost model: calibrated here {entry.created}, {path}"
    data = json.loads((tmp_path / "b" / "report.json").read_text())
    assert data["cost_model_provenance"] == {"kind": "calibrated", "file": str(path), "created": entry.created}
    assert data["cost_model_source"].startswith(f"calibrated here {entry.created}")
    assert data["outside_calibrated_range"]["calibrated"] == f"{CALIBRATED.calibrated_len} tokens"
    # plan and simulate find the report's calibration too
    out, _ = run(SIMULATE)
    assert out.splitlines()[0] == f"cost model: calibrated here {entry.created}, {path}"
