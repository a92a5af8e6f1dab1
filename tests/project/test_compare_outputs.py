"""tools/compare_outputs.py: it records simulate, stalls and plan, and finds a changed output."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from cost_models import synthetic

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_outputs", REPO / "tools" / "compare_outputs.py")
assert _spec is not None and _spec.loader is not None
compare_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_outputs)


def test_a_recording_equals_itself_and_a_changed_row_is_found(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    compare_outputs.record(REPO, a, ["--trace", "default", "--limit", "12"])
    assert {"simulate.json", "stalls.json", "plan/plan.json", "plan/plan.md", "plan/attnpolicy_config.json"} <= {
        str(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
    shutil.copytree(a, b)
    assert compare_outputs.compare(a, b) == []

    data = json.loads((b / "simulate.json").read_text())
    data["wall_seconds"] = 1.5  # timing only: ignored
    (b / "simulate.json").write_text(json.dumps(data))
    assert compare_outputs.compare(a, b) == []

    data["rows"][0]["hits"] += 1
    (b / "simulate.json").write_text(json.dumps(data))
    (b / "plan" / "plan.md").write_text("changed")
    assert compare_outputs.compare(a, b) == ["plan/plan.md", "simulate.json"]


def test_the_model_level_is_recorded_and_a_real_runs_seconds_are_not_compared(tmp_path):

    from attnpolicy.modelling.cost_file import CostFile

    cost = CostFile(model=synthetic()).save(tmp_path / "m.json")
    a = tmp_path / "a"
    compare_outputs.record(REPO, a, ["--trace", "default", "--limit", "12"], model_cost=cost)
    recorded = {str(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
    assert {"model_simulate.json", "model_stalls.json", "model_plan/plan.json"} <= recorded
    model_rows = json.loads((a / "model_simulate.json").read_text())["rows"]
    assert model_rows and json.loads((a / "simulate.json").read_text())["rows"] != model_rows

    b = tmp_path / "b"
    b.mkdir()
    run = {"misses": 3, "compile_seconds": 1.0, "stalls": {"p99": 0.5, "batches": 4}, "max_abs_err": 1e-7}
    (a / "run.json").write_text(json.dumps(run))
    shutil.copytree(a, b, dirs_exist_ok=True)
    (b / "run.json").write_text(json.dumps({**run, "compile_seconds": 2.0, "stalls": {"p99": 0.7, "batches": 4}}))
    assert compare_outputs.compare(a, b) == []  # measured seconds differ run to run
    (b / "run.json").write_text(json.dumps({**run, "misses": 4}))
    assert compare_outputs.compare(a, b) == ["run.json"]
    # in a modelled output, seconds are results and are compared
    data = json.loads((b / "model_simulate.json").read_text())
    data["rows"][0]["total_seconds"] += 1.0
    (b / "model_simulate.json").write_text(json.dumps(data))
    assert compare_outputs.compare(a, b) == ["model_simulate.json", "run.json"]


def test_a_checkout_gets_the_model_flags_its_cli_takes_and_the_flag_line_compares_as_one(tmp_path):
    cost = tmp_path / "m.json"
    assert compare_outputs.model_flags(REPO, cost) == ["--cost-model", str(cost.resolve()), "--family", "model"]
    old = tmp_path / "old" / "attnpolicy"  # a CLI from before --family: its simulate takes --model-cost
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "__main__.py").write_text("print('usage: attnpolicy simulate [--model-cost PATH] [--cost-model PATH]')\n")
    assert compare_outputs.model_flags(old.parent, cost) == ["--model-cost", str(cost.resolve())]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "model_simulate.stdout").write_text(f"cost model: {cost} (--model-cost)\n")
    (b / "model_simulate.stdout").write_text(f"cost model: {cost} (--cost-model)\n")
    assert compare_outputs.compare(a, b) == []
    (b / "model_simulate.stdout").write_text(f"cost model: {cost} (--cost-model)\nworkload: 3 requests\n")
    assert compare_outputs.compare(a, b) == ["model_simulate.stdout"]


def test_a_file_naming_its_own_folder_compares_equal_in_another_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, other in ((a, "x"), (b, "x")):
        (root / "plan").mkdir(parents=True)
        (root / "plan" / "host_settings.json").write_text(json.dumps(
            {"file": str((root / "plan" / "buckets.txt").resolve()), "other": other}))
    assert compare_outputs.compare(a, b) == []
    (b / "plan" / "host_settings.json").write_text(json.dumps({"file": str(tmp_path / "c" / "plan" / "buckets.txt"), "other": "x"}))
    assert compare_outputs.compare(a, b) == ["plan/host_settings.json"]


def test_a_pinned_cost_model_prices_every_attention_level_command_and_no_model_level_one():
    commands = compare_outputs._commands(["--trace", "default"], ["--cost-model", "m.json", "--family", "model"],
                                         cost=("--cost-model", "a.json"))
    for name in ("simulate", "stalls", "plan"):
        assert commands[name][commands[name].index("--cost-model") + 1] == "a.json", name
    for name in ("model_simulate", "model_stalls", "model_plan"):
        assert "a.json" not in commands[name], name
