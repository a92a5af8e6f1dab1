"""The layout stream: what a runtime records per step, read back and replayed."""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest

from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.modelling.simulation import simulate_run
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.layout_stream import (
    LayoutStreamWriter,
    read_layout_stream,
    select_run,
)
from attnpolicy.workloads.traces import synthetic_default

SPEC = TensorSpec("float32", 4, 2, 32, 0.125)


def _record(path, policy: str, max_graphs: int | None, eviction: str = "lru", requests: int = 24) -> list[BatchLayout]:
    """Run a dispatcher over a batch former's steps the way the vLLM backend does
    (one prepare per step, nothing computed) and record each step."""
    config = AttnPolicyConfig(policy=policy, max_graphs=max_graphs, eviction=eviction, backend="none",
                              max_seq_len=4096, max_batch_tokens=16 * 4096)
    dispatcher = Dispatcher(config)
    writer = LayoutStreamWriter(path, config, SPEC, {"max_model_len": 4096})
    layouts = [s.layout for s in BatchFormer(max_num_seqs=6, max_num_batched_tokens=512,
                                             max_model_len=4096).steps(synthetic_default(requests))]
    for layout in layouts:
        decision = dispatcher.prepare(layout, SPEC).decision
        writer.write_step(layout, decision.mode, dispatcher.context_for(SPEC).keys_for(layout, decision.mode),
                          dispatcher.cache.stats().to_json())
    writer.close()
    return layouts


@pytest.mark.parametrize(("policy", "max_graphs", "eviction"),
                         [("varlen", 3, "lru"), ("dynamic", 2, "fifo"), ("cost-aware", 4, "lru"),
                          ("always-mask", None, "lru")])
def test_replay_under_the_recorded_config_reproduces_the_misses(tmp_path, policy, max_graphs, eviction):
    path = tmp_path / "layouts.jsonl"
    layouts = _record(path, policy, max_graphs, eviction)
    [run] = read_layout_stream(path)
    assert run.layouts == layouts
    assert (run.config.policy, run.config.max_graphs, run.spec) == (policy, max_graphs, SPEC)
    assert run.runtime == {"max_model_len": 4096}
    steps = run.steps
    assert [s.step for s in steps] == list(range(len(layouts)))
    assert all(b.misses >= a.misses and b.hits >= a.hits for a, b in itertools.pairwise(steps))
    if max_graphs is not None:
        assert steps[-1].evictions > 0 and max(s.graphs for s in steps) <= max_graphs
    [row] = simulate_run(run, [policy], [max_graphs], [eviction])
    assert (row.misses, row.hits) == (run.misses, steps[-1].hits)
    assert row.evictions == steps[-1].evictions
    # another capacity on the same stream: a different trade-off, same batches
    [bigger] = simulate_run(run, [policy], [None], ["lru"])
    assert bigger.batches == len(layouts) and bigger.misses <= row.misses


def test_stream_holds_several_runs_and_padded_layouts(tmp_path):
    path = tmp_path / "layouts.jsonl"
    config = AttnPolicyConfig(backend="none")
    first = LayoutStreamWriter(path, config, SPEC)
    second = LayoutStreamWriter(path, config.model_copy(update={"policy": "varlen"}), SPEC)
    padded = BatchLayout.from_lens([3, 5], padded_to=12)
    counters = {"hits": 0, "misses": 1, "evictions": 0, "graphs": 1}
    key = str(GraphKey(CallKind.MASK, 16, 16, True, SPEC, "sdpa", None, "none"))
    first.write_step(padded, Dispatcher(config).preview(padded, SPEC).mode, [key], counters)
    second.write_step(BatchLayout.from_lens([1, 1], [9, 4]), Dispatcher(config).preview(padded, SPEC).mode, [], counters)
    first.close()
    second.close()
    runs = read_layout_stream(path)
    assert [r.run for r in runs] == [first.run, second.run] and first.run != second.run
    assert runs[0].layouts == [padded] and runs[0].steps[0].keys == (key,)
    assert runs[1].layouts[0].kv_lens == (9, 4)
    assert select_run(runs, second.run, "f") is runs[1]
    with pytest.raises(ConfigError, match="holds 2 runs .*choose one with --run"):
        select_run(runs, None, "f")
    with pytest.raises(ConfigError, match="run 'nope' is not in f"):
        select_run(runs, "nope", "f")


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "layouts.jsonl:2: not a JSON line"),
    ('{"event": "step", "run": "x", "step": 0}', "step of run 'x' before its header"),
    ('{"event": "step", "run": "R", "step": 0, "q": [2], "causal": true}', "layouts.jsonl:2: missing field 'kv'"),
    (('{"event": "step", "run": "R", "step": 0, "q": [4], "kv": [2], "causal": true, "mode": "mask", '
      '"keys": [], "hits": 0, "misses": 0, "evictions": 0, "graphs": 0}'), r"kv_lens\[0\] must be >= q_lens\[0\]"),
])
def test_bad_stream_lines_are_named(tmp_path, line, message):
    path = tmp_path / "layouts.jsonl"
    header = {"event": "header", "run": "R", "config": {"backend": "none"},
              "spec": {"dtype": "float32", "heads": 4, "kv_heads": 2, "head_dim": 32}}
    path.write_text(json.dumps(header) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message):
        read_layout_stream(path)


def test_two_recordings_with_one_pid_keep_every_step(tmp_path, monkeypatch):
    """Two containers whose processes have the same pid append to one file: both runs
    are read back whole."""
    path = tmp_path / "layouts.jsonl"
    monkeypatch.setattr(os, "getpid", lambda: 8225)
    runs = []
    for requests in (3, 5):
        monkeypatch.setattr(LayoutStreamWriter, "_runs", itertools.count())  # a fresh process
        runs.append(_record(path, "varlen", None, requests=requests))
    read = read_layout_stream(path)
    assert [r.layouts for r in read] == runs
    assert len({r.run for r in read}) == 2 and all(r.run.startswith("8225-0-") for r in read)


def _stream(tmp_path, lines: list[dict]) -> str:
    path = tmp_path / "layouts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


HEADER = {"event": "header", "run": "R", "config": {"backend": "none"},
          "spec": {"dtype": "float32", "heads": 4, "kv_heads": 2, "head_dim": 32}}
KEY = "mask/q16/float32/h4kv2d32/sdpa/none"


def _step(n: int, misses: int = 1, **fields) -> dict:
    return {"event": "step", "run": "R", "step": n, "q": [2, 3], "kv": [2, 3], "causal": True, "mode": "mask",
            "keys": [KEY], "hits": n, "misses": misses, "evictions": 0, "graphs": 1, **fields}


@pytest.mark.parametrize(("lines", "message"), [
    ([HEADER, _step(0), _step(2)], r":3: run 'R' has step 2 where step 1 belongs \(a step is missing"),
    ([HEADER, _step(0), _step(0)], r":3: run 'R' has step 0 where step 1 belongs \(a step is duplicated"),
    ([HEADER, _step(1), _step(0)], r":2: run 'R' has step 1 where step 0 belongs"),
    ([HEADER, _step(0), {"event": "stats", "run": "R"}], r":3: unknown event 'stats'"),
    ([HEADER, _step(0), HEADER, _step(0)], r":3: a second header for run 'R' \(the first is on line 1\)"),
    ([HEADER, _step(0, misses=3), _step(1, misses=2)], r":3: misses went down from 3 to 2"),
    ([HEADER, _step(0, mode="causal")], r":2: recorded mode causal is illegal .*2 sequences packed"),
    ([HEADER, _step(0, keys=["mask/q16/float32/h8kv8d64/sdpa/none"])],
     r":2: graph key .*h8kv8d64.* is not of the header's tensor spec \(line 1: float32/h4kv2d32\)"),
    ([{**HEADER, "spec": {**HEADER["spec"], "heads": 0}}], r":1: spec.heads must be an integer >= 1, got 0"),
    ([{**HEADER, "spec": {**HEADER["spec"], "kv_heads": 3}}], r":1: spec.kv_heads 3 must divide spec.heads 4"),
    ([{**HEADER, "spec": {**HEADER["spec"], "dtype": "float8"}}], r":1: spec.dtype must be one of .*'float8'"),
    ([{**HEADER, "spec": {**HEADER["spec"], "head_dim": "32"}}], r":1: spec.head_dim must be an integer"),
], ids=["dropped", "duplicated", "shuffled", "unknown event", "two headers", "counter down", "illegal mode",
        "key of another spec", "heads 0", "kv_heads not dividing", "bad dtype", "head_dim a string"])
def test_a_tampered_stream_is_refused_with_file_and_line(tmp_path, lines, message):
    path = _stream(tmp_path, lines)
    with pytest.raises(ConfigError, match=re.escape(path) + message):
        read_layout_stream(path)


def test_a_run_of_only_a_header_is_an_error(tmp_path, capsys):
    path = _stream(tmp_path, [HEADER])
    [run] = read_layout_stream(path)
    with pytest.raises(ConfigError, match="run R of f holds no steps"):
        select_run([run], None, "f")
    for command in (["simulate", "--layouts", path], ["plan", "--layouts", path, "--out", str(tmp_path / "p")]):
        assert main(command) == 2
        assert "holds no steps (only its header)" in capsys.readouterr().err


def test_a_replay_says_whether_it_reproduced_the_recorded_misses(tmp_path, capsys):
    path = tmp_path / "layouts.jsonl"
    _record(path, "varlen", 3, requests=8)
    same = ["simulate", "--layouts", str(path), "--policies", "varlen", "--capacities", "3,inf",
            "--evictions", "lru", "--workers", "1", "--json", str(tmp_path / "r.json")]
    assert main([*same, "--strict"]) == 0
    out = capsys.readouterr().out
    assert "reproduced: the row varlen capacity=3 lru has the recorded" in out
    assert json.loads((tmp_path / "r.json").read_text())["reproduced"] is True
    # the same stream with one more miss recorded on every step: no longer reproduced
    edited = tmp_path / "edited.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    edited.write_text("".join(json.dumps({**x, "misses": x["misses"] + 1} if x["event"] == "step" else x) + "\n"
                              for x in lines))
    same[2] = str(edited)
    assert main(same) == 0
    assert "not reproduced: the row varlen capacity=3 lru has" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["reproduced"] is False
    assert main([*same, "--strict"]) == 1
    # --strict needs the recorded row in the sweep, and says so before any work
    assert main([*same[:6], "4", *same[7:], "--strict"]) == 2
    err = capsys.readouterr().err
    assert "--strict: the sweep has no row under the recorded config" in err and "add 3 to --capacities" in err
