"""What the runtimes' warm-up sets serve of a workload: each step as the runtime runs it
(step_forwards), each forward on the first graph that holds it, counted exactly; the
plan's host settings read back through the runtimes' rules serve the steps they were
made for."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.cli import main
from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    Forward,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    peer_of,
    step_forwards,
)
from attnpolicy.modelling.peer_coverage import coverage, peer_coverage
from attnpolicy.planning.host_settings import host_settings
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

LIMITS = PeerLimits(4, 512, 1024)


def test_each_runtime_runs_a_mixed_step_its_own_way():
    # two decodes over 6 and 130 tokens, a chunk of 300 new tokens on 100 of context
    q, kv = (1, 1, 300), (6, 130, 400)
    assert step_forwards("gaudi", q, kv, LIMITS) == (
        Forward("decode", 2, 1, 3, 2, 5 + 129, 6 + 130),  # together, ceil(6 / 128) + ceil(130 / 128) blocks
        Forward("prefill", 1, 300, 1, 300, 100, 300 * 400))  # alone, ceil(100 / 128) context blocks
    assert step_forwards("rbln", q, kv, LIMITS) == (Forward("decode", 2, 1, None, 2, 134, 136),
                                                    Forward("prefill", 1, 300, None, 300, 100, 300 * 400))
    # two prompts run apart, each alone
    assert [f.query_tokens for f in step_forwards("gaudi", (1, 5, 9), (8, 5, 9), LIMITS)] == [1, 5, 9]
    assert step_forwards("tpu", q, kv, LIMITS) == (Forward("mixed", 3, 302, None, 302, 234, 120136),)
    assert step_forwards("gaudi", (7,), (7,), LIMITS) == (Forward("prefill", 1, 7, 0, 7, 0, 49),)
    assert [peer_of(name) for name in WARMUPS] == ["gaudi", "gaudi", "rbln", "tpu"]
    with pytest.raises(ConfigError, match="runtimes gaudi, rbln, tpu, got 'cuda'"):
        peer_of("cuda")


def test_coverage_counts_graphs_forwards_unserved_shapes_and_padding():
    warm = PeerWarmSet.of("gaudi-x", [PeerGraph("prefill", 1, 512, 4), PeerGraph("prefill", 1, 1024, 4),
                                      PeerGraph("decode", 4, 1, 8)])
    forwards = [Forward("prefill", 1, 300, 1, 300, 0, 0),  # the 512 graph: 212 rows of padding
                Forward("decode", 2, 1, 3, 2, 0, 0),  # batch 4: 2 rows
                Forward("decode", 8, 1, 3, 8, 0, 0), Forward("decode", 8, 1, 3, 8, 0, 0),  # no graph holds batch 8
                Forward("prefill", 1, 600, 9, 600, 0, 0)]  # 9 context blocks: no graph
    row = coverage("gaudi-x", warm, forwards)
    assert (row.graphs, row.prefill_graphs, row.decode_graphs, row.mixed_graphs, row.graphs_used) == (3, 2, 1, 0, 2)
    assert (row.forwards, row.unserved, row.unserved_shapes) == (5, 3, 2)
    assert (row.tokens, row.padded_rows) == (302, 214) and row.padding == pytest.approx(214 / 302)
    assert row.to_json()["padding"] == row.padding
    assert coverage("tpu", PeerWarmSet.of("tpu", [PeerGraph("mixed", 8, 64)]),
                    [Forward("mixed", 3, 40, None, 40, 0, 0)]).padded_rows == 24  # a ragged graph pads tokens only


def _steps(prompts: list[int], output: int, seqs: int, budget: int, max_len: int) -> list[BatchLayout]:
    former = BatchFormer(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len)
    return [s.layout for s in former.steps([Request(0.0, n, output) for n in prompts])]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 900), min_size=1, max_size=6), st.integers(1, 6), st.sampled_from((2, 4, 8)),
       st.sampled_from((64, 256, 512)), st.integers(1, 4))
def test_every_token_runs_once_and_the_plans_settings_serve_the_steps_they_were_made_for(
        prompts, output, seqs, budget, max_sizes):
    max_len = 1024
    steps = _steps(prompts, output, seqs, budget, max_len)
    limits = PeerLimits(seqs, budget, max_len)
    made = host_settings(steps, [16, 64, 256, 512, 1024], limits, max_sizes)
    rows = {r.scheme: r for r in peer_coverage(made.forwards, made.warmup_sets())}
    refused = {name: r.refused for name, r in rows.items() if r.refused}
    # vllm-gaudi refuses budgets under a block (its prompt queries are whole blocks); a plan's file of no prompt
    assert set(refused) <= {"gaudi-linear", "gaudi-exponential", "gaudi-plan"}
    assert ("gaudi-linear" in refused) == (budget < 128)
    assert list(rows) == [*WARMUPS, "gaudi-plan", "tpu-plan", "rbln-plan"]
    tokens = sum(layout.q_tokens for layout in steps)
    for row in rows.values():
        if row.refused:
            assert (row.graphs, row.forwards, row.tokens) == (0, 0, 0)
            continue
        assert row.padded_rows >= 0 and row.graphs_used <= row.graphs
        assert row.forwards == (len(steps) if row.scheme.startswith("tpu") else
                                sum(len(step_forwards("gaudi", s.q_lens, s.kv_lens, limits)) for s in steps))
        assert row.tokens <= tokens and (row.unserved > 0 or row.tokens == tokens)
    # the plan's settings, read back as each runtime reads them, run every step warm
    assert rows["tpu-plan"].unserved == rows["rbln-plan"].unserved == 0
    if not made.sections["gaudi"]["missing"]:
        assert rows["gaudi-plan"].unserved == 0


def test_plan_reports_the_runtimes_warm_up_sets_on_its_workload(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:00.0,{n},3\n" for n in (5, 40, 300)))
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(trace), "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
                 "--max-seq-len", "512", "--policies", "varlen", "--max-buckets", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    peers = json.loads((out / "plan.json").read_text())["peers"]
    steps = _steps([5, 40, 300], 3, 4, 256, 512)
    limits = PeerLimits(4, 256, 512)
    settings_ = host_settings(steps, json.loads((out / "plan.json").read_text())["policies"][0]["buckets"],
                              limits, 3)
    assert peers == [r.to_json() for r in peer_coverage(settings_.forwards, settings_.warmup_sets())]
    assert [p["scheme"] for p in peers] == [*WARMUPS, "gaudi-plan", "tpu-plan", "rbln-plan"]
    assert "The runtimes' warm-up sets on this workload" in printed
    md = (out / "plan.md").read_text()
    assert "## The runtimes' warm-up sets on this workload" in md
    assert f"| rbln | {peers[2]['graphs']} | 1 / 1 / 0 |" in md and f"| tpu | {peers[3]['graphs']} | 0 / 0 / " in md
