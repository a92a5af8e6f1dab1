"""Planning that scales: key streams as runs, a sampled plan above a threshold, evaluated on every batch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.key_stream import replay_stream, runs
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.simulation import simulation_config
from attnpolicy.planning.graph_set import AttentionPlanLevel, evaluated, plan_graphs
from attnpolicy.planning.sample import PlanSample, sample_steps
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

pytestmark = pytest.mark.usefixtures("fresh_plugins")

FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-seq-len", "128"]
PROMPTS = (20, 45, 9, 70, 33, 60, 12, 90, 25, 40, 8, 100)


def _steps():
    return list(BatchFormer(**FORMER).steps([Request(float(i), p, 3) for i, p in enumerate(PROMPTS)]))


def test_a_sample_is_evenly_spaced_windows_of_consecutive_steps():
    steps = list(range(100))
    got, sample = sample_steps(steps, 20, windows=4)
    assert got == [*range(0, 5), *range(25, 30), *range(50, 55), *range(75, 80)]
    assert sample == PlanSample(20, 100, 4)
    assert sample_steps(steps, 22, windows=4)[0][:7] == [0, 1, 2, 3, 4, 5, 25]  # the remainder to the first
    assert sample_steps(steps, 100) == (steps, None) and sample_steps(steps, 0) == (steps, None)
    with pytest.raises(ConfigError, match="size -1"):
        sample_steps(steps, -1)


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "cost", "belady"])
@pytest.mark.parametrize("max_graphs,max_bytes", [(2, None), (3, None), (None, 25), (None, None)])
def test_runs_replay_as_the_expanded_stream(eviction, max_graphs, max_bytes):
    rnd = random.Random(7)
    stream = [k for _ in range(300) for k in [rnd.randrange(6)] * rnd.randrange(1, 5)]
    sizes, costs = [4, 8, 12, 30, 6, 9], [0.1, 0.7, 0.3, 0.2, 1.1, 0.05]  # key 3 is over max_bytes=25
    ids, counts = runs(stream)
    assert len(ids) < len(stream) and sum(counts) == len(stream)
    assert [k for k, n in zip(ids, counts) for _ in range(n)] == stream
    kw = {"max_graphs": max_graphs, "max_bytes": max_bytes, "eviction": eviction, "oversize": "uncached"}
    assert replay_stream(ids, sizes, costs, counts=counts, **kw) == replay_stream(stream, sizes, costs, **kw)


def test_runs_replay_over_a_disk_as_the_expanded_stream():
    rnd = random.Random(3)
    stream = [k for _ in range(200) for k in [rnd.randrange(5)] * rnd.randrange(1, 4)]
    sizes, costs = [4, 8, 12, 5, 6], [0.1, 0.7, 0.3, 0.2, 1.1]

    def disk():
        return DiskMirror(20, sizes.__getitem__, [0.01 * k for k in range(5)].__getitem__, lambda k: True)

    ids, counts = runs(stream)
    assert (replay_stream(ids, sizes, costs, max_graphs=2, counts=counts, disk=disk())
            == replay_stream(stream, sizes, costs, max_graphs=2, disk=disk()))


@pytest.mark.parametrize("max_graphs", [2, None])
def test_the_plan_evaluated_on_its_own_steps_is_its_row(max_graphs):
    model = CostModel.default()
    base = simulation_config(model, BatchFormer(**FORMER), max_graphs=max_graphs)
    steps = _steps()
    plan = plan_graphs(steps, base, AttentionPlanLevel(model), ["varlen", "dynamic"], max_buckets=4)
    assert evaluated(steps, plan.config, model).to_json() == plan.chosen.row.to_json()


def _plan(tmp_path, name, *extra):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:{i:02d}.0,{p},3\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / name
    assert main(["plan", "--trace", str(trace), *FLAGS, "--policies", "varlen,dynamic", "--max-buckets", "4",
                 "--max-graphs", "3", "--out", str(out), *extra]) == 0
    return json.loads((out / "plan.json").read_text()), (out / "plan.md").read_text()


def test_plan_samples_only_above_the_threshold_and_says_so(tmp_path, capsys):
    batches = len(_steps())
    full, full_md = _plan(tmp_path, "full", "--sample", str(batches))
    assert "planned on a sample" not in capsys.readouterr().out + full_md and "sample" not in full
    again, _ = _plan(tmp_path, "default")  # the default threshold is far above this workload
    assert again == {**full, "config": again["config"]} and again["config"] == full["config"]
    capsys.readouterr()
    sampled, md = _plan(tmp_path, "sampled", "--sample", "8")
    out = capsys.readouterr().out
    line = f"planned on a sample of 8 of {batches} batches (8 evenly spaced windows)"
    assert line in out and line[0].upper() + line[1:] in md
    assert {k: v for k, v in sampled["sample"].items() if k != "row"} == {"batches": 8, "of": batches, "windows": 8}
    row = evaluated(_steps(), AttnPolicyConfig.load(tmp_path / "sampled"), CostModel.default())
    assert sampled["sample"]["row"] == row.to_json() and f"{row.total_seconds:.4g} modelled s" in out
    assert sampled["policies"][0]["row"]["batches"] == 8


def test_a_negative_sample_is_one_line_exit_2(tmp_path, capsys):
    assert main(["plan", "--sample", "-3", "--out", str(tmp_path / "p")]) == 2
    assert "argument --sample: expected a number of batches >= 0, got '-3'" in capsys.readouterr().err


def test_jitter_trace_repeats_the_trace_shifted_with_jittered_lengths(tmp_path):
    import subprocess
    import sys

    from attnpolicy.workloads.traces import load_trace

    src, out = tmp_path / "t.csv", tmp_path / "big.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:00.0,100,10\n"
                   "2023-11-16 18:17:02.0,50,0\n")
    tool = Path(__file__).parents[2] / "tools" / "jitter_trace.py"
    subprocess.run([sys.executable, str(tool), str(src), str(out), "--requests", "5", "--output-scale", "2"],
                   check=True, capture_output=True)
    got = load_trace(str(out))
    assert [r.arrival for r in got] == [0.0, 2.0, 4.0, 6.0, 8.0]  # each copy starts a mean gap after the last
    assert [r.output_tokens == 0 for r in got] == [False, True, False, True, False]
    assert all(90 <= r.prompt_tokens <= 110 and 18 <= r.output_tokens <= 22 for r in got[::2])
    assert len({r.prompt_tokens for r in got[::2]}) > 1  # jittered
