"""simulate: the real dispatcher path with a cost model, Belady's bound, rows, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey
from attnpolicy.measure.batching import BatchFormer
from attnpolicy.measure.simulation import (
    ROW_FIELDS,
    belady_cache,
    next_uses,
    simulate,
    simulation_config,
)
from attnpolicy.measure.workload import Request, synthetic_default

MODEL = CostModel.default()
FIXED = ("always-mask", "dynamic", "varlen")
SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 1024}


def gkey(i: int) -> GraphKey:
    return GraphKey(MaskMode.CAUSAL, 16 * (i + 1), 16 * (i + 1), True, MODEL.spec, "sdpa", None, "aot_eager")


def requests(n: int = 40) -> list[Request]:
    return [Request(r.arrival, min(r.prompt_tokens, 600), min(r.output_tokens, 40)) for r in synthetic_default(n)]


def test_next_uses():
    keys = [gkey(i) for i in (0, 1, 0, 2, 1)]
    assert next_uses(keys) == [2, 4, math.inf, math.inf, math.inf]


@given(st.lists(st.integers(0, 7), max_size=80), st.integers(1, 5))
def test_belady_never_misses_more_than_lru(stream, capacity):
    keys = [gkey(i) for i in stream]
    lru = GraphCache(max_graphs=capacity)
    for k in keys:
        lru.get_or_compile(k, lambda: None)
    config = AttnPolicyConfig(max_graphs=capacity, backend="aot_eager")
    belady = belady_cache(keys, config, MODEL).stats()
    assert belady["misses"] <= lru.stats()["misses"]
    assert belady["misses"] >= len(set(keys))
    # modelled compile seconds: every distinct key compiled at least once
    assert belady["compile_seconds"] >= sum(MODEL.compile_seconds(gkey(i)) for i in set(stream)) - 1e-9


def test_rows_hold_every_field_and_add_up():
    rows = simulate(requests(), ["dynamic", "varlen"], [2, None], ["lru", "cost", "belady"],
                    former_options=SMALL)
    assert [(r.policy, r.capacity, r.eviction) for r in rows] == [
        (p, c, e) for p in ("dynamic", "varlen") for c in (2, None) for e in ("lru", "cost", "belady")]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r.to_json())
        assert r.total_seconds == pytest.approx(r.attention_seconds + r.compile_seconds)
        assert r.hit_rate == pytest.approx(r.hits / (r.hits + r.misses))
        assert r.hits + r.misses == r.calls
        assert r.peak_bytes > 0 and r.compiles == r.misses
    varlen = [r for r in rows if r.policy == "varlen"]
    assert all(r.mask_builds == 0 for r in varlen)
    assert all(r.modes["mask"] == 0 and r.modes["varlen"] > 0 for r in varlen)


def test_unbounded_capacity_misses_each_key_once():
    for policy in (*FIXED, "cost-aware"):
        (row,) = simulate(requests(), [policy], [None], ["lru"], former_options=SMALL)
        assert row.misses == row.distinct_keys == row.compiles
        assert row.evictions == 0


def test_deterministic():
    args = (requests(), ["varlen", "cost-aware"], [2, 4], ["lru", "belady"])
    assert simulate(*args, former_options=SMALL) == simulate(*args, former_options=SMALL)


def test_belady_bounds_lru_on_the_default_workload():
    rows = simulate(synthetic_default(120), [*FIXED, "cost-aware"], [2, 4, 8], ["lru", "belady"])
    by = {(r.policy, r.capacity, r.eviction): r for r in rows}
    for policy in (*FIXED, "cost-aware"):
        for capacity in (2, 4, 8):
            lru, belady = by[policy, capacity, "lru"], by[policy, capacity, "belady"]
            assert belady.misses <= lru.misses
            assert belady.attention_seconds == lru.attention_seconds


def test_mask_builds_mirror_the_mask_cache():
    # a prefill-only workload of identical requests repeats one layout: one build
    same = [Request(0.0, 100, 0)] * 3
    (row,) = simulate(same, ["always-mask"], [None], ["lru"],
                      former_options={"max_num_seqs": 1, "max_num_batched_tokens": 128, "prefill_only": True})
    assert row.batches == 3 and row.mask_builds == 1


def test_simulated_misses_equal_a_real_run():
    """The acceptance check: a real Dispatcher with real tensors misses exactly as simulated."""
    model = MODEL.model_copy(update={"heads": 2, "kv_heads": 1, "head_dim": 8, "backend": "none"})
    reqs = requests(12)
    for policy, capacity in (("dynamic", 2), ("varlen", 3), ("cost-aware", 2)):
        config = simulation_config(model, BatchFormer(**SMALL), policy=policy, max_graphs=capacity)
        (row,) = simulate(reqs, [policy], [capacity], ["lru"], config, model, SMALL)
        real = Dispatcher(config, cost_model=model)
        gen = torch.Generator().manual_seed(0)
        for step in BatchFormer(**SMALL).steps(reqs):
            lay = step.layout
            q = torch.randn(lay.q_tokens, 2, 8, generator=gen)
            k = torch.randn(lay.kv_tokens, 1, 8, generator=gen)
            real.attend(q, k, k, lay)
        stats = real.stats()
        assert (stats["cache"]["misses"], stats["cache"]["hits"], stats["modes"]) == (
            row.misses, row.hits, row.modes), policy


def test_config_must_match_the_model():
    config = AttnPolicyConfig(backend="inductor")
    with pytest.raises(ConfigError, match="backend='inductor'"):
        simulate(requests(3), ["varlen"], [2], ["lru"], config, MODEL)


def test_unknown_eviction_is_named():
    with pytest.raises(ConfigError, match="eviction 'nope'"):
        simulate(requests(3), ["varlen"], [2], ["nope"])


def test_simulation_config_fits_packed_batches():
    former = BatchFormer(max_num_seqs=16, max_model_len=8192)
    config = simulation_config(MODEL, former, policy="varlen")
    assert config.max_seq_len == 8192 and config.max_batch_tokens == 16 * 8192
    assert (config.backend, config.attn_impl, config.policy) == ("aot_eager", "sdpa", "varlen")


def test_simulate_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["simulate", "--trace", "default", "--limit", "20", "--policies", "varlen,cost-aware",
                 "--capacities", "2,4", "--evictions", "lru,belady", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "512", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 20 and len(data["rows"]) == 8
    assert data["config"]["max_seq_len"] == 8192 and data["former"]["max_num_seqs"] == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "cost-aware" in capsys.readouterr().out
