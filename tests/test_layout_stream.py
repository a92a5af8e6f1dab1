"""The layout stream: what a runtime records per step, read back and replayed."""

from __future__ import annotations

import itertools
import json

import pytest

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.simulation import simulate_run
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.layout_stream import (
    LayoutStreamWriter,
    read_layout_stream,
    select_run,
)
from attnpolicy.workloads.traces import synthetic_default

SPEC = TensorSpec("float32", 4, 2, 32, 0.125)


def _record(path, policy: str, max_graphs: int | None, eviction: str = "lru") -> list[BatchLayout]:
    """Run a dispatcher over a batch former's steps the way the vLLM backend does
    (one prepare per step, nothing computed) and record each step."""
    config = AttnPolicyConfig(policy=policy, max_graphs=max_graphs, eviction=eviction, backend="none",
                              max_seq_len=4096, max_batch_tokens=16 * 4096)
    dispatcher = Dispatcher(config)
    writer = LayoutStreamWriter(path, config, SPEC, {"max_model_len": 4096})
    layouts = [s.layout for s in BatchFormer(max_num_seqs=6, max_num_batched_tokens=512,
                                             max_model_len=4096).steps(synthetic_default(24))]
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
    first.write_step(padded, Dispatcher(config).preview(padded, SPEC).mode, ["k"], counters)
    second.write_step(BatchLayout.from_lens([1, 1], [9, 4]), Dispatcher(config).preview(padded, SPEC).mode, [], counters)
    first.close()
    second.close()
    runs = read_layout_stream(path)
    assert [r.run for r in runs] == [first.run, second.run] and first.run != second.run
    assert runs[0].layouts == [padded] and runs[0].steps[0].keys == ("k",)
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
