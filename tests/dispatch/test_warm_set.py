"""Warm sets that can stay resident: refused when built or loaded (mask budget, graph
count) or at warm-up for the runtime's tensor spec (bytes), before anything compiles."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from cost_models import PRICEY
from pydantic import ValidationError

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.dispatch.step import HostStep
from attnpolicy.errors import ConfigError, StrictModeError
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.keys import TensorSpec

SMALL = TensorSpec("float32", 4, 2, 16)
BIG = TensorSpec("float32", 32, 32, 128)  # what a real model runs: 32 heads of 128
WARM = [{"family": "causal", "q_bucket": n, "kv_bucket": n} for n in (64, 128, 256)]


class _Counted:
    def __init__(self) -> None:
        self.built = 0

    def __call__(self, call, key, spec):
        self.built += 1
        return graph_fn(call, key.impl, spec.scale, None)


def _refused_when_built_and_loaded(tmp_path, fields, match):
    with pytest.raises(ValidationError, match=match):
        AttnPolicyConfig.model_validate(fields)
    (tmp_path / "attnpolicy_config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=match):
        AttnPolicyConfig.load(tmp_path)


def test_a_mask_warm_shape_over_max_mask_bytes_is_refused(tmp_path):
    fields = {"max_seq_len": 16384, "max_batch_tokens": 16384, "max_mask_bytes": 2**20,
              "warmup": [{"family": "mask", "q_bucket": 16384, "kv_bucket": 16384, "causal": False}]}
    _refused_when_built_and_loaded(tmp_path, fields, r"warmup\.0: a mask graph of 16384 x 16384 .*max_mask_bytes")
    fits = {**fields, "warmup": [{"family": "mask", "q_bucket": 1024, "kv_bucket": 1024, "causal": False}]}
    assert AttnPolicyConfig.model_validate(fits).warmup[0].q_bucket == 1024  # exactly 1 MiB fits


def test_a_warm_set_above_max_graphs_is_refused(tmp_path):
    _refused_when_built_and_loaded(tmp_path, {"max_graphs": 2, "warmup": WARM}, "3 distinct graphs.*max_graphs=2")
    assert len(AttnPolicyConfig(max_graphs=3, warmup=WARM + WARM[:1]).warmup) == 4  # duplicates are one graph


def test_a_warm_set_that_fits_stays_resident_under_strict_raise():
    config = AttnPolicyConfig(max_graphs=3, warmup=WARM, strict="raise", backend="eager", max_seq_len=256)
    builder = _Counted()
    d = Dispatcher(config, builder=builder)
    assert len(d.warmup(SMALL)) == 3
    for n in (50, 100, 200, 60, 250):  # every warm graph, in turn: no eviction, no violation
        d.prepare(BatchLayout.from_lens([n]), SMALL)
    assert builder.built == 3 and d.stats().strict_violations == 0 and d.stats().cache.evictions == 0


def test_a_warm_set_over_max_bytes_for_the_runtime_spec_is_refused_before_any_compile():
    """Planned for a small spec, the warm set fits; run with 32 heads of 128 it does not."""
    config = AttnPolicyConfig(max_bytes=1_000_000, warmup=WARM, backend="eager", max_seq_len=256)
    builder = _Counted()
    assert len(Dispatcher(config, builder=builder).warmup(SMALL)) == 3
    builder.built = 0
    d = Dispatcher(config, builder=builder)
    with pytest.raises(ConfigError, match=r"warmup\.0: the graph .* needs \d+ bytes .*max_bytes=1000000"):
        d.warmup(BIG)
    assert builder.built == 0 and len(d.cache) == 0
    # two specs' warm sets together: refused when they would evict each other
    both = Dispatcher(config.model_copy(update={"max_bytes": 700_000}), builder=builder)
    both.warmup(SMALL)
    with pytest.raises(ConfigError, match="3 graphs .* and 3 warmed for other specs needs"):
        both.warmup(TensorSpec("float32", 4, 4, 16))


def test_a_refused_warm_set_refuses_every_attend():
    """The first attend of a spec warms; a warm set that cannot stay resident refuses
    that attend and every later one (it is never silently skipped)."""
    config = AttnPolicyConfig(max_bytes=1_000_000, warmup=WARM, backend="none", max_seq_len=256)
    d = Dispatcher(config)
    layout = BatchLayout.from_lens([30])
    q, k, v = (torch.randn(30, 32, 128) for _ in range(3))
    for _ in range(2):
        with pytest.raises(ConfigError, match="max_bytes=1000000"):
            d.attend(q, k, v, layout)
    assert d.stats().batches == 0 and d.stats().cache.compiles == 0


def _stored(tmp_path, *lens: int) -> dict[str, object]:
    """A store holding the graphs of one sequence of each of ``lens`` (aot_eager), and
    the config fields that use it."""
    fields = {"backend": "aot_eager", "store_dir": str(tmp_path), "max_seq_len": 256}
    with Dispatcher(AttnPolicyConfig(**fields)) as first:
        for n in lens:
            first.prepare(BatchLayout.from_lens([n]), SMALL)
    return fields


@pytest.mark.parametrize("strict", ["warn", "raise"])
def test_a_graph_loaded_from_the_store_after_warm_up_is_no_strict_violation(tmp_path, strict):
    """A load after warm-up compiles nothing: allowed under every ``strict``, counted in
    ``loaded_after_warmup`` and said once; a compile is still a violation."""
    fields = _stored(tmp_path, 100, 200)  # q128 and q256 in the store
    d = Dispatcher(AttnPolicyConfig(**fields, warmup=WARM[:1], strict=strict))  # warms q64
    d.warmup(SMALL)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (100, 200, 110):  # two loads, then a hit
            d.prepare(BatchLayout.from_lens([n]), SMALL)
    s = d.stats()
    assert s.loaded_after_warmup == 2 and s.strict_violations == 0
    assert s.cache.loads == 2 and s.cache.compiles == 1  # the warm set's q64
    assert [str(w.message) for w in seen] == [
        f"graph causal/q128/float32/h4kv2d16/sdpa/aot_eager loaded from the store after warm-up (strict={strict!r} "
        "allows loads: they compile nothing); further loads after warm-up are counted in "
        "stats().loaded_after_warmup, not warned about"]
    compile_after = BatchLayout.from_lens([20])  # q32: not in the store
    if strict == "raise":
        with pytest.raises(StrictModeError, match="q32.*compiled after warm-up"):
            d.prepare(compile_after, SMALL)
    else:
        with pytest.warns(RuntimeWarning, match="q32.*compiled after warm-up"):
            d.prepare(compile_after, SMALL)
    assert d.stats().strict_violations == 1 and d.stats().loaded_after_warmup == 2


def test_a_background_load_after_warm_up_is_no_strict_violation(tmp_path):
    """In background mode a stored key requested after warm-up pads up and loads in the
    worker: no violation under ``strict="raise"``, counted when it switches in."""

    fields = _stored(tmp_path, 100)  # q128
    d = Dispatcher(AttnPolicyConfig(**fields, strict="raise", compile_mode="background", switch_after=1,
                                    warmup=WARM[2:]), cost_model=PRICEY)  # warms q256
    d.warmup(SMALL)
    with pytest.warns(RuntimeWarning, match="q128.* loaded from the store after warm-up"):
        for _ in range(2):  # padded up to q256 while q128 loads, then switched in
            d.prepare(BatchLayout.from_lens([100]), SMALL)
    s = d.stats()
    d.close()
    assert s.background.pad_up_calls == 1 and s.background.loaded == 1
    assert s.strict_violations == 0 and s.loaded_after_warmup == 1 and s.cache.loads == 1


def test_a_host_runs_varlen_keys_deferred_and_a_step_that_runs_one_compiles_it():
    """With ``host_varlen`` (vLLM's kernel runs VARLEN steps) nothing the host runs is
    built: the warm set's VARLEN graph and a host step's keys enter the cache deferred,
    no strict violation; a step that runs a deferred key compiles it then, which after
    warm-up is one."""
    varlen = {"family": "varlen", "q_bucket": 16, "kv_bucket": 64, "context": True}
    config = AttnPolicyConfig(policy="varlen", warmup=[WARM[0], varlen], strict="raise", backend="eager",
                              max_seq_len=256)
    builder = _Counted()
    d = Dispatcher(config, builder=builder, host_varlen=True)
    d.warmup(SMALL)
    assert builder.built == 1 and d.stats().cache.deferred == 1  # the causal q64 compiled, the varlen one not
    d.prepare(BatchLayout.from_lens([100, 20]), SMALL)  # run by the host: q128 and q32 deferred
    s = d.stats()
    assert builder.built == 1 and s.cache.deferred == 3 and s.strict_violations == 0
    with pytest.raises(StrictModeError, match="q128.*compiled after warm-up"):
        d.prepare(BatchLayout.from_lens([100]), SMALL)  # attnpolicy's CAUSAL graph runs it: built now
    assert d.stats().strict_violations == 1


#: per policy: layouts whose steps the host runs (VARLEN, also a MASK over max_mask_bytes), and
#: layouts attnpolicy's graphs run (CAUSAL q128, whose key the host's VARLEN step requests too; MASK q32)
_HOSTED = {"varlen": ([BatchLayout.from_lens([100, 20]), BatchLayout.from_lens([40], [90])],
                      [BatchLayout.from_lens([100])]),
           "dynamic": ([BatchLayout.from_lens([100, 20])],
                       [BatchLayout.from_lens([100]), BatchLayout.from_lens([10, 20])])}


@pytest.mark.parametrize("compile_mode", ["sync", "background"])
@pytest.mark.parametrize("policy", ["varlen", "dynamic"])
def test_warming_layouts_builds_only_the_graphs_their_steps_run(policy, compile_mode):
    """With ``host_varlen``, ``warmup(layouts, spec)`` builds nothing for a layout whose
    step the host runs (not the CAUSAL graphs a VARLEN plan reuses either: their keys
    enter the cache deferred), so preparing it after warm-up compiles nothing and is no
    strict violation; a CAUSAL or MASK layout warmed by the same dispatcher builds its
    graphs (a deferred one built into its entry), and the config's warm set is built as
    by ``warmup(spec)``."""
    hosted, own = _HOSTED[policy]
    config = AttnPolicyConfig(policy=policy, warmup=WARM[:1], strict="raise", backend="eager", max_seq_len=256,
                              max_mask_bytes=4096, on_overflow="eager", compile_mode=compile_mode)
    builder = _Counted()
    with Dispatcher(config, builder=builder, host_varlen=True) as d:
        host_keys = {key for layout in hosted for key in d.graph_keys_for(layout, SMALL)}
        assert any(key.kind.value == "causal" for key in host_keys)  # the graphs warm-up used to build
        warmed = d.warmup(hosted, SMALL)
        cache = d.stats().cache
        assert builder.built == cache.compiles == 1  # the warm set's causal q64 only
        assert cache.deferred == len(host_keys) and set(warmed) >= host_keys
        for layout in hosted:
            assert isinstance(d.prepare(layout, SMALL), HostStep)
        cache = d.stats().cache
        assert builder.built == cache.compiles == 1 and cache.deferred_built == 0
        assert cache.misses == 1 + len(host_keys)  # warm-up's: every prepare hit
        d.warmup(own, SMALL)
        own_keys = {key for layout in own for key in d.graph_keys_for(layout, SMALL)}
        assert builder.built == d.stats().cache.compiles == 1 + len(own_keys)
        assert d.stats().cache.deferred_built == 1  # the causal q128 a host step deferred
        for layout in own:
            assert not isinstance(d.prepare(layout, SMALL), HostStep)
        d.prepare(BatchLayout.from_lens([200, 30]), SMALL)  # not warmed, run by the host: no violation
        assert builder.built == 1 + len(own_keys) and d.stats().strict_violations == 0
        with pytest.raises(StrictModeError, match="q256.*compiled after warm-up"):
            d.prepare(BatchLayout.from_lens([200]), SMALL)  # attnpolicy's CAUSAL graph: not warmed
        assert d.stats().strict_violations == 1
