"""What ``plan --whole-requests`` plans, run: every row's warm set written to
graph_sets.json and read back, the plan's set served by ``run --model --plan`` with
its tokens checked, and ``--measure`` running each set this runner serves beside its
modelled row. One tiny model, three short requests, a few graphs."""

from __future__ import annotations

import json

import pytest

from attnpolicy.cli import main
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.runtime_sets import GRAPH_SETS_FILE, GraphSetsFile
from attnpolicy.planning.scheme_comparison import plan_whole_requests
from attnpolicy.planning.warmup_plan import Budget
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import load_trace
from tests.cost_models import of_model, with_rows, with_steps

TINY = "qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64"
LIMITS = ["--max-seq-len", "256", "--max-num-batched-tokens", "128", "--max-num-seqs", "2"]
#: The rows this runner serves (vllm-gaudi's and vllm-rbln's forms), on the trace below.
SERVED = {"gaudi-linear", "gaudi-exponential", "rbln", "plan (gaudi form)", "rbln-plan"}
#: The ragged rows, which do not run here.
RAGGED = {"tpu", "vllm", "plan (ragged form)"}


def _files(tmp_path, backend="aot_eager"):
    """A cost model of TINY (compiled with ``backend``) and a trace of three short
    requests, one of them chunked."""
    model = of_model(with_rows(with_steps(compile_base=0.05)), TINY).model_copy(update={"backend": backend})
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0,{n},3\n" for i, n in enumerate((20, 150, 38))))
    return str(CostFile(model=model).save(tmp_path / "m.json")), str(trace)


def _plan(cost, trace, out, *extra):
    return main(["plan", "--family", "model", "--whole-requests", "--cost-model", cost, "--trace", trace,
                 "--out", str(out), *LIMITS, *extra])


def _strict(path):
    return json.loads(path.read_text(), parse_constant=pytest.fail)


def test_graph_sets_json_holds_every_rows_warm_set_by_its_label(tmp_path, capsys):
    """Each row with a warm set, by its label, with the runtime whose form runs it;
    read back, each set is the row's own."""
    cost, trace = _files(tmp_path)
    out = tmp_path / "plan"
    assert _plan(cost, trace, out) == 0
    assert f"{out / GRAPH_SETS_FILE}, " in capsys.readouterr().out
    _strict(out / GRAPH_SETS_FILE)
    saved = GraphSetsFile.load(out)
    former = BatchFormer(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256)
    limits = PeerLimits(2, 128, 256)
    steps = [s.layout for s in former.steps(load_trace(trace))]
    comparison, _ = plan_whole_requests(steps, limits, CostFile.load(cost).model_fits(cost, steps=True), Budget(),
                                        16)
    rows = {r.scheme: r for r in comparison.rows}
    plan = _strict(out / "plan.json")
    assert list(saved.sets) == [r["scheme"] for r in plan["schemes"] if "graphs" in r] == list(rows)
    assert saved.peer_limits() == limits
    peers = {}
    for label in saved.sets:
        peer, warm = saved.chosen(label)
        assert warm.graphs == rows[label].warm.graphs and len(warm.graphs) == rows[label].cost.graphs
        peers[label] = peer
    assert {label for label, peer in peers.items() if peer == "gaudi"} == {
        "gaudi-linear", "gaudi-exponential", "pow2", "plan (gaudi form)", "plan @ gaudi-linear (gaudi form)",
        "plan @ gaudi-exponential (gaudi form)"}
    assert {label for label, peer in peers.items() if peer == "rbln"} == {"rbln", "rbln-plan"}
    assert {label for label, peer in peers.items() if peer == "tpu"} == RAGGED | {
        label for label in saved.sets if label.endswith("(ragged form)")}


def test_run_serves_the_plans_gaudi_form_with_its_tokens_checked(tmp_path, capsys):
    """``run --model --plan DIR`` compiles the plan's gaudi-form set at start, nothing
    after it, strict mode silent, every greedy token ``generate``'s; a ragged label of
    the plan is refused with the reason."""
    cost, trace = _files(tmp_path)
    out = tmp_path / "plan"
    assert _plan(cost, trace, out) == 0
    _, warm = GraphSetsFile.load(out).chosen("plan (gaudi form)")
    result = tmp_path / "run.json"
    argv = ["run", "--model", TINY, "--plan", str(out), "--trace", trace, *LIMITS, "--backend", "none"]
    assert main([*argv, "--check", "--json", str(result)]) == 0
    data = _strict(result)
    g = data["graph_set"]
    assert g["name"] == "plan (gaudi form)" and g["peer"] == "gaudi"
    assert data["compiles"] == g["measured"]["graphs"] == len(warm.graphs)
    assert g["measured"]["runtime_compiles"] == g["measured"]["strict_violations"] == 0
    assert data["token_mismatches"] == 0 and data["passed"] is True and data["requests"] == 3
    capsys.readouterr()
    assert main([*argv, "--graph-set", "plan (ragged form)"]) == 2
    err = capsys.readouterr().err
    assert "argument --plan: graph set 'plan (ragged form)' does not run here: its graphs are ragged" in err


def test_measure_runs_each_set_served_here_and_marks_the_rest_modelled(tmp_path, capsys):
    """``--measure SPEC``: every row this runner serves runs on the planned steps, its
    warm-up the row's graphs and nothing compiled after it; the ragged rows and the
    comparisons no file sets up stay modelled, in plan.json and in the table."""
    cost, trace = _files(tmp_path, backend="none")
    out = tmp_path / "plan"
    assert _plan(cost, trace, out, "--measure", TINY) == 0
    printed = capsys.readouterr().out
    plan = _strict(out / "plan.json")
    schemes = {r["scheme"]: r for r in plan["schemes"]}
    assert {name for name, r in schemes.items() if r["measured"] is not None} == SERVED
    for name in SERVED:
        m, row = schemes[name]["measured"], schemes[name]
        assert m["graphs"] == row["graphs"] and m["runtime_compiles"] == row["runtime_compiles"] == 0
        assert m["strict_violations"] == 0 and m["padding"] == pytest.approx(row["padding"])
        assert m["total_seconds"] == pytest.approx(m["warmup_seconds"] + m["runtime_compile_seconds"]
                                                   + m["run_seconds"])
    markdown = (out / "plan.md").read_text()
    cells = {line.split(" | ")[0].lstrip("| ").removesuffix(" *"): line.split(" | ")[8]
             for line in markdown.splitlines() if line.startswith("| ") and " | " in line}
    for name in SERVED:
        assert cells[name] == f"{schemes[name]['measured']['total_seconds']:.1f}"
    for name in (*RAGGED, "pow2", "plan @ gaudi-linear (gaudi form)"):
        assert cells[name] == "modelled" and schemes[name]["measured"] is None
    assert cells["floor"] == "" and "plan --measure" not in printed  # the progress line is on stderr


@pytest.mark.parametrize(("extra", "error"), [
    (["--measure", "qwen3:layers=2,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64"],
     "argument --cost-model: {cost} prices another model: calibrated on " + TINY + " (layers 1), not on "
     "--measure qwen3:layers=2"),
    (["--measure", TINY + ",max_positions=128"],
     "argument --max-seq-len: 256 is more than the 128 positions of --measure " + TINY),
    (["--measure", "qwen3:layer=2"], "argument --measure: "),
], ids=["another-model", "positions", "malformed"])
def test_a_bad_measure_is_refused_before_any_work(tmp_path, capsys, extra, error):
    cost, trace = _files(tmp_path)
    out = tmp_path / "plan"
    assert _plan(cost, trace, out, *extra) == 2
    captured = capsys.readouterr()
    assert error.format(cost=cost) in captured.err and captured.out == ""
    assert not out.exists()


def test_measure_needs_whole_requests(tmp_path, capsys):
    cost, trace = _files(tmp_path)
    assert main(["plan", "--family", "model", "--cost-model", cost, "--trace", trace, "--out",
                 str(tmp_path / "plan"), *LIMITS, "--measure", TINY]) == 2
    assert "argument --measure: needs --family model --whole-requests" in capsys.readouterr().err
    assert not (tmp_path / "plan").exists()
