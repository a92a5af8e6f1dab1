"""``plan --family model --whole-requests`` under tight budgets: a phase the budget
cannot hold is left out and named, never an abort; the recommendation and every file
written (host_settings.json, vllm-gaudi's bucketing file) keep the budget asked; every
host's settings are the plan's; what is left out is named in plan.md, plan.json,
host_settings.json and the bucketing file; every JSON written is strict."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attnpolicy.cli import main
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.peer_buckets import (
    PeerGraph,
    PeerLimits,
    gaudi_file_buckets,
    rbln_env_warmup,
    tpu_env_paddings,
)
from attnpolicy.modelling.warmup_costs import Pricing, WarmupCost
from attnpolicy.planning.scheme_comparison import HostChoice, SchemeRow
from attnpolicy.planning.warmup_plan import Budget
from tests.cost_models import with_rows, with_steps

MODEL = with_rows(with_steps(compile_base=0.05))
#: A small slice of the built-in workload; a step budget that is no power of two, so the
#: ragged form's cover (512) is above it and vLLM's sizes are cut to it.
FLAGS = ("--limit", "12", "--max-seq-len", "2048", "--max-num-batched-tokens", "500", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return CostFile(model=MODEL).save(tmp_path_factory.mktemp("model") / "m.json")


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _plan(model_file: Path, out: Path, max_graphs: int | None, max_bytes: int | None,
          seconds: float | None) -> dict[str, Any]:
    flags = [*(["--max-graphs", str(max_graphs)] if max_graphs is not None else []),
             *(["--max-bytes", str(max_bytes)] if max_bytes is not None else []),
             *(["--warmup-seconds", repr(seconds)] if seconds is not None else [])]
    assert main(["plan", "--family", "model", "--whole-requests", "--cost-model", str(model_file), *FLAGS,
                 *flags, "--out", str(out)]) == 0
    return {"plan": _strict((out / "plan.json").read_text()), "md": (out / "plan.md").read_text(),
            "host": _strict((out / "host_settings.json").read_text()),
            "file": (out / "gaudi_buckets.txt").read_text()}


def _file_graphs(text: str) -> list[PeerGraph]:
    """The bucketing file's buckets as graphs (query 1: a decode bucket)."""
    return [PeerGraph("decode", b, 1, n) if q == 1 else PeerGraph("prefill", b, q, n)
            for b, q, n in gaudi_file_buckets(text)]


def check_written(written: dict[str, Any], budget: Budget) -> None:
    """The acceptance: the recommendation and every file keep ``budget``, every host's
    settings are the plan's, and what the budget leaves out is named everywhere."""
    plan, host, md, text = written["plan"], written["host"], written["md"], written["file"]
    limits = PeerLimits(**plan["limits"])
    pricing = Pricing(MODEL, limits)
    rows = {r["scheme"]: r for r in plan["schemes"]}
    best = rows[plan["recommended"]]
    assert budget.why_over(best["graphs"], best["warm_bytes"], best["warmup_seconds"]) is None
    assert best["over_budget"] is None and not best["refused"] and not best["reference"]
    for r in plan["schemes"]:  # each row says whether it keeps the budget, as the budget itself says
        if "graphs" in r:
            assert r["over_budget"] == budget.why_over(r["graphs"], r["warm_bytes"], r["warmup_seconds"])
    # vllm-gaudi: the file and its section hold the gaudi form's graphs, within the budget
    gaudi_graphs = _file_graphs(text)
    assert budget.over_graphs(gaudi_graphs, pricing) is None
    assert len(gaudi_graphs) == plan["plans"]["gaudi"]["cost"]["graphs"]
    section = host["gaudi"]
    assert [list(g) for g in gaudi_file_buckets(text)] == sorted(
        [[1, q, c] for _, q, c in section["prompt_buckets"]] + [[b, 1, n] for b, n in section["decode_buckets"]])
    # tpu-inference and vLLM: the ragged form's paddings (vLLM's cut to the step budget)
    paddings = plan["plans"]["ragged"]["grid"]["tokens"]
    tpu, vllm = host["tpu"], host["vllm"]
    assert tpu["num_tokens_paddings"] == paddings
    if paddings:
        read = tpu_env_paddings(limits, tpu["env"], tpu["additional_config"]["compilation_sizes"]).warmup()
        assert [g.query_tokens for g in read.graphs] == paddings
    else:
        assert tpu["env"] == {}
    sizes = vllm["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == sorted({min(t, limits.max_num_batched_tokens) for t in paddings})
    for tokens in (paddings, sizes):
        assert budget.over_graphs([PeerGraph("mixed", limits.max_num_seqs, t) for t in tokens], pricing) is None
    # vllm-rbln: the gaudi form's decode batches, its warm-up within the budget or said to break it
    batches = sorted({b for b, _ in section["decode_buckets"]}) or [limits.max_num_seqs]
    assert host["rbln"]["decode_batch_buckets"] == batches
    rbln = rbln_env_warmup(limits, host["rbln"]["env"])
    over = budget.over_graphs(rbln.graphs, pricing)
    assert (over is None) == (not any(m.startswith("the budget:") for m in host["rbln"]["missing"]))
    # what is left out, named in every file that omits it
    for form, sections in (("gaudi", ("gaudi", "static")), ("ragged", ("tpu", "vllm"))):
        for line in plan["plans"][form]["outside"]:
            assert f"- {line}" in md
            for name in sections:
                assert line in host[name]["missing"], (name, line)
            if form == "gaudi":
                assert f"# missing: {line}" in text
    for phase, buckets in (("prompt", section["prompt_buckets"]), ("decode", section["decode_buckets"])):
        assert bool(buckets) or any(m.startswith(f"{phase}: ") for m in section["missing"])
        assert bool(buckets) or f"# missing: {phase}: " in text
    if not paddings:
        assert vllm["compilation_config"]["cudagraph_mode"] == "NONE" and vllm["missing"]


@settings(max_examples=25, deadline=None)
@given(st.none() | st.integers(1, 12), st.none() | st.integers(1, 3 * 10**7),
       st.none() | st.floats(0, 4, allow_nan=False))
@example(None, None, 0.0).via("the issue: --warmup-seconds 0 aborted")
@example(None, 1, None).via("the issue: --max-bytes 1 aborted")
@example(3, None, 0.6).via("the issue: the ragged form's largest graph alone over the seconds")
@example(1, None, None).via("the issue: --max-graphs 1 recommended a 2-graph row")
def test_plan_budgets_are_kept_by_the_recommendation_and_every_file(model_file, max_graphs, max_bytes, seconds):
    with tempfile.TemporaryDirectory() as out:
        written = _plan(model_file, Path(out), max_graphs, max_bytes, seconds)
    check_written(written, Budget(max_graphs, max_bytes, seconds))


def test_a_budget_holding_no_graph_leaves_every_phase_out_and_names_it(model_file, tmp_path, capsys):
    written = _plan(model_file, tmp_path, None, None, 0.0)
    err = capsys.readouterr().err
    plan, host = written["plan"], written["host"]
    assert plan["plans"]["ragged"]["grid"]["tokens"] == [] and plan["plans"]["ragged"]["outside"]
    assert "outside the budget: mixed: its largest graph" in err
    assert any("tpu-inference always compiles its cover of 512 tokens" in m for m in host["tpu"]["missing"])
    assert "# missing: prompt: " in written["file"] and "# missing: decode: " in written["file"]
    rows = {r["scheme"]: r for r in plan["schemes"]}
    assert rows["plan (gaudi form)"]["refused"].endswith("vllm-gaudi refuses to start")  # a file without buckets
    assert rows["plan (ragged form)"]["hosts"] == ["vllm"]  # tpu-inference always compiles its cover
    assert plan["recommended"] == "plan (ragged form)"
    assert "graphs compiled at run time" in plan["summary"]


def test_one_graph_recommends_a_one_graph_row_whose_settings_are_written(model_file, tmp_path):
    written = _plan(model_file, tmp_path, 1, None, None)
    plan, host = written["plan"], written["host"]
    rows = {r["scheme"]: r for r in plan["schemes"]}
    best = rows[plan["recommended"]]
    assert best["graphs"] <= 1 and best["scheme"] in ("plan (gaudi form)", "plan (ragged form)")
    ragged = plan["plans"]["ragged"]["grid"]["tokens"]
    assert len(ragged) == 1 and host["tpu"]["num_tokens_paddings"] == ragged
    assert host["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == [500]  # 512 cut to the step budget
    assert host["gaudi"]["decode_buckets"] == [] and any(m.startswith("decode: ") for m in host["gaudi"]["missing"])
    assert "# missing: decode: " in written["file"]
    assert rows["rbln-plan"]["over_budget"] == "2 graphs > max_graphs 1"
    assert "the budget: vllm-rbln's warm-up under these settings breaks it (2 graphs > max_graphs 1)" in \
        host["rbln"]["missing"]
    assert "lowest modelled total within max_graphs 1:" in plan["summary"]


def _row(scheme: str, total: float, **kw: Any) -> SchemeRow:
    return SchemeRow(scheme, ("rbln",), WarmupCost(scheme, 2, 1.0, total - 1.0, 0, 0, 0.0, 10, 0, 5, 5), **kw)


def test_a_hosts_summary_names_its_default_when_nothing_within_the_budget_beats_it():
    default = _row("rbln", 5.0, default=True)
    assert HostChoice("rbln", default, default).describe() == "rbln: its default rbln"
    assert HostChoice("rbln", None, default).describe() == "rbln: no set it runs within the budget"
    over = _row("rbln", 5.0, default=True, over="2 graphs > max_graphs 1")
    assert HostChoice("rbln", _row("plan", 10.0), over).describe() == "rbln: plan, 2.000× above rbln (over the budget)"
    assert HostChoice("rbln", _row("plan", 2.5), default).describe() == "rbln: plan, 2.000× below rbln"
