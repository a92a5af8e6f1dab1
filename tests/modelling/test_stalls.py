"""The modelled clock of compile stalls: sync against background compiles with pad-up."""

from __future__ import annotations

import json

import pytest
from cost_models import synthetic

from attnpolicy import AttnPolicyConfig, BatchLayout
from attnpolicy.cli import main
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.modelling.simulation import model_config, simulate_layouts, simulation_config
from attnpolicy.modelling.stalls import (
    AttentionLevel,
    StallRow,
    WholeModelLevel,
    compare_stalls,
    stall_configs,
    stall_row,
    warm_layouts,
)
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import load_trace

#: every call runs 1 s, every compile takes 10 s, nothing else costs
FLAT = CostModel.default().model_copy(update={
    "run": {f: Fit(base=1.0) for f in CostModel.default().run},
    "compile": {f: Fit(base=10.0) for f in CostModel.default().compile},
    "mask_build": Fit(), "call_overhead_seconds": 0.0})


def _config(mode, **fields):
    return AttnPolicyConfig(backend=FLAT.backend, attn_impl=FLAT.impl, max_seq_len=256, compile_mode=mode,
                            switch_after=2, **fields)


def test_the_clock_by_hand():
    """A miss at batch 2 pads up to the warm q256 graph; its compile (10 s from t=1)
    switches in at batch 4, which waits for it from t=3 to t=11."""
    stream = [BatchLayout.from_lens([256])] + [BatchLayout.from_lens([20])] * 4
    bg = stall_row(stream, _config("background"), AttentionLevel(FLAT), warm="prefix:1")
    assert (bg.warm_keys, bg.warmup_seconds) == (1, 10.0)
    assert (bg.pad_up_calls, bg.pad_up_tokens) == (2, 2 * (256 - 32))
    assert (bg.background_compiles, bg.compiles, bg.background_compile_seconds) == (1, 1, 10.0)
    assert bg.stall_seconds == 11 - 3  # requested at t=1, done at 11; batch 4 starts at t=3
    assert (bg.stalled_batches, bg.stall_max, bg.stall_p99, bg.stall_p50) == (1, 8.0, 8.0, 0.0)
    assert bg.total_seconds == 5 + 8
    sync = stall_row(stream, _config("sync"), AttentionLevel(FLAT), warm="prefix:1")
    assert (sync.stall_seconds, sync.total_seconds, sync.compiles, sync.pad_up_calls) == (10.0, 15.0, 1, 0)


def test_background_compiles_queue_on_one_worker():
    stream = [BatchLayout.from_lens([256]), BatchLayout.from_lens([20]), BatchLayout.from_lens([40])] + \
        [BatchLayout.from_lens([256])] * 3
    row = stall_row(stream, _config("background"), AttentionLevel(FLAT), warm="prefix:1")
    # q32 requested at t=1 (done at 11), q64 at t=2 (queued: done at 21); switches at batches 4 and 5
    assert row.background_compiles == 2
    assert row.stall_seconds == (11 - 3) + (21 - 12)
    assert row.total_seconds == 6 + 17


def test_warm_sets():
    layouts = [BatchLayout.from_lens([n]) for n in (5, 50, 500)]
    assert warm_layouts(layouts, "none") == [] and warm_layouts(layouts, "all") == layouts
    assert warm_layouts(layouts, "prefix:2") == layouts[:2]
    for bad in ("prefix", "prefix:-1", "first:2", "some"):
        with pytest.raises(ConfigError, match="warm must be"):
            warm_layouts(layouts, bad)


def _steps(limit):
    former = BatchFormer()
    return list(former.steps(load_trace("default", limit))), simulation_config(CostModel.default(), former)


def test_sync_rows_agree_with_the_simulation():
    steps, base = _steps(30)
    row = stall_row(steps, base.model_copy(update={"max_graphs": 8}), AttentionLevel())
    sim = simulate_layouts(steps, [base.policy], [8], ["lru"], base)[0]
    assert row.compiles == sim.compiles
    assert row.compile_seconds == pytest.approx(sim.compile_seconds)
    assert row.stall_seconds == pytest.approx(sim.compile_seconds)
    assert row.total_seconds == pytest.approx(sim.total_seconds)


def test_background_is_no_worse_and_warm_plans_never_stall():
    steps, base = _steps(40)
    rows = compare_stalls(steps, AttentionLevel(), stall_configs(base, ["varlen"], [8, None]), ["none", "all"])
    assert [(r.capacity, r.warm, r.compile_mode) for r in rows[:2]] == [(8, "none", "sync"), (8, "none", "background")]
    for sync, bg in zip(rows[::2], rows[1::2]):
        assert bg.total_seconds <= sync.total_seconds
    warm = [r for r in rows if r.capacity is None and r.warm == "all"]
    assert all(r.stall_p99 == r.stall_max == 0 and r.compiles == 0 for r in warm)
    assert any(r.pad_up_calls for r in rows)


def test_stalls_command(tmp_path, capsys):
    out = tmp_path / "stalls.json"
    assert main(["stalls", "--limit", "10", "--capacities", "4,inf", "--warm", "prefix:5", "--switch-after", "3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "switch_after=3" in text and "vs sync" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["capacity"], r["compile_mode"]) for r in rows] == [(4, "sync"), (4, "background"),
                                                                 (None, "sync"), (None, "background")]
    assert main(["stalls", "--limit", "10", "--warm", "first:3"]) == 2
    assert "argument --warm" in capsys.readouterr().err


def test_both_levels_replay_through_one_entry_point_into_one_row_type():
    """One compare over a level: each level's rows are StallRows whose JSON keeps that
    level's keys (the run seconds named per level, level-only fields only where they are)."""
    layouts = [BatchLayout.from_lens(lens) for lens in ([20], [3, 3], [5], [5], [20], [40])]
    model = synthetic()
    config = model_config(model, 64, 128, policy="varlen", max_graphs=2, switch_after=1)
    whole = compare_stalls(layouts, WholeModelLevel(model), [config])
    attention = compare_stalls(layouts, AttentionLevel(FLAT), [_config("sync", max_graphs=2)], ["none", "all"])
    assert all(isinstance(r, StallRow) for r in whole + attention)
    assert [(r.compile_mode, r.warm) for r in whole] == [("sync", "none"), ("background", "none")]
    assert [(r.compile_mode, r.warm) for r in attention] == [("sync", "none"), ("background", "none"),
                                                             ("sync", "all"), ("background", "all")]
    assert list(whole[1].to_json()) == [
        "policy", "capacity", "compile_mode", "switch_after", "batches", "compiles", "compile_seconds", "padded_up",
        "eager_served", "run_seconds", "stall_seconds", "stall_p50", "stall_p99", "stall_max", "stalled_batches",
        "total_seconds"]
    assert whole[1].to_json()["padded_up"] == whole[1].pad_up_calls > 0
    assert list(attention[0].to_json()) == [
        "policy", "capacity", "eviction", "compile_mode", "switch_after", "warm", "warm_keys", "warmup_seconds",
        "batches", "attention_seconds", "stall_seconds", "total_seconds", "stall_p50", "stall_p99", "stall_max",
        "stalled_batches", "compiles", "compile_seconds", "background_compiles", "background_compile_seconds",
        "pad_up_calls", "pad_up_tokens", "distinct_keys"]
    for rows, key in ((whole, "run_seconds"), (attention, "attention_seconds")):
        for row in rows:
            assert row.to_json()[key] + row.stall_seconds == row.to_json()["total_seconds"] == row.total_seconds
    with pytest.raises(ConfigError, match="no warm-up is modelled"):
        compare_stalls(layouts, WholeModelLevel(model), [config], ["all"])
