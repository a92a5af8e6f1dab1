"""The guarantees of docs/reliability.md: isolation, owned and bounded memory, exact
compile accounting, clear errors for bad values, faults that leave nothing behind."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.core.names import IMPLS
from attnpolicy.errors import BucketOverflowError, ConfigError, LayoutError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.attention import attention
from attnpolicy.kernels.masks import layout_mask
from attnpolicy.modelling.simulation import _replays, simulate
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

SPEC = TensorSpec("float32", 4, 2, 16)
BAD = (float("nan"), float("inf"), float("-inf"))




# -- isolation ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", [MaskMode.MASK, MaskMode.VARLEN, MaskMode.ROWS])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", BAD)
def test_a_bad_value_in_one_sequence_never_reaches_another(impl, mode, where, value):
    layout = BatchLayout.from_lens([5, 7], [9, 7], causal=True)  # with cached context
    q, k, v = random_qkv(layout)
    clean = attend(q, k, v, layout, mode, impl, partition_len=4)
    {"k": k, "v": v}[where][1, 0, 3] = value  # a context key of sequence 0
    out = attend(q, k, v, layout, mode, impl, partition_len=4)
    assert torch.equal(out[5:], clean[5:])  # sequence 1: bit for bit the clean run
    assert out[:5].isnan().any()  # sequence 0 sees its own bad key (as SDPA would)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_issue_example_is_isolated_by_the_default_policy(impl):
    layout = BatchLayout.from_lens([5, 7])
    q, k, v = random_qkv(layout)
    k[0, 0, 0] = float("nan")
    config = AttnPolicyConfig(policy="dynamic", backend="none", attn_impl=impl,
                              partition_len=8 if impl == "flash" else None, max_seq_len=64)
    out = Dispatcher(config).attend(q, k, v, layout)
    assert not out[5:].isnan().any()
    torch.testing.assert_close(out[5:].double(), reference_for(q, k, v, layout)[5:], atol=1e-5, rtol=1e-5)


def test_a_masked_out_key_never_matters_but_an_attended_one_poisons_its_row():
    q, k, v = (torch.randn(2, 4, 8) for _ in range(3))
    mask = torch.tensor([[True, True, False, False]] * 2 + [[True, True, True, True]] * 2)
    v[0, 3] = float("inf")  # kv head 0, key 3: seen by query rows 2 and 3 only
    for impl in IMPLS:
        out = attention(q, k, v, impl=impl, mask=mask, partition_len=2)
        assert not out[:, :2].isnan().any() and out[:, 2:].isnan().all()


# -- fp64, bad values --------------------------------------------------------------------

FP64_LAYOUTS = {  # mode -> a layout it runs: CAUSAL needs one unpadded causal sequence
    MaskMode.MASK: BatchLayout.from_lens([7, 9], [10, 9], padded_to=20),
    MaskMode.VARLEN: BatchLayout.from_lens([7, 9], [10, 9], padded_to=20),
    MaskMode.ROWS: BatchLayout.from_lens([7, 9], [10, 9], padded_to=20),
    MaskMode.CAUSAL: BatchLayout.from_lens([9]),
}


@pytest.mark.parametrize("mode", list(FP64_LAYOUTS), ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_fp64_is_computed_in_fp64(impl, mode):
    layout = FP64_LAYOUTS[mode]
    q, k, v = random_qkv(layout, dtype=torch.float64)
    out = attend(q, k, v, layout, mode, impl, partition_len=4)
    assert out.dtype == torch.float64
    # a pass through fp32 anywhere would be ~1e-7 off
    torch.testing.assert_close(out, reference_for(q, k, v, layout), atol=1e-12, rtol=1e-12)
    d = Dispatcher(AttnPolicyConfig(policy={MaskMode.MASK: "always-mask", MaskMode.VARLEN: "varlen",
                                            MaskMode.CAUSAL: "dynamic", MaskMode.ROWS: "always-rows"}[mode], attn_impl=impl, backend="none",
                                    partition_len=4 if impl == "flash" else None, max_seq_len=64))
    out = d.attend(q, k, v, layout)
    assert d.stats().modes[mode.value] == 1 and out.dtype == torch.float64
    torch.testing.assert_close(out, reference_for(q, k, v, layout), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, "abc", True])
def test_scale_must_be_a_finite_positive_number(scale):
    layout = BatchLayout.from_lens([4])
    d = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=64))
    with pytest.raises(ValueError, match=rf"scale must be a finite number > 0.*got {scale!r}"):
        d.attend(*random_qkv(layout), layout, scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        attend(*random_qkv(layout), layout, "varlen", scale=scale)
    assert d.stats().cache.misses == 0  # refused before any graph


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)), "q has dtype torch.int32"),
    (lambda q, k, v: (q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64)),
     "q has dtype torch.complex64"),
    (lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]), r"at least one head .* got shape \(6, 0, 16\)"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), r"head_dim >= 1, got shape \(6, 4, 0\)"),
])
def test_bad_tensors_get_a_clear_error(change, message):
    layout = BatchLayout.from_lens([2, 4])
    d = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=64))
    with pytest.raises(LayoutError, match=message):
        d.attend(*change(*random_qkv(layout)), layout)


@pytest.mark.parametrize("policy", ["always-mask", "dynamic", "varlen", "always-causal", "cost-aware", "always-rows"])
def test_one_rule_for_sequences_longer_than_max_seq_len(policy):
    layout = BatchLayout.from_lens([70, 10])
    strict = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_seq_len=64))
    with pytest.raises(BucketOverflowError, match=r"length 70 exceeds the largest bucket 64 .*max_seq_len=64"):
        strict.prepare(layout, SPEC)
    assert strict.stats().batches == 0 and strict.stats().cache.misses == 0
    lenient = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_seq_len=64, on_overflow="eager"))
    out = lenient.attend(*random_qkv(layout), layout)
    q, k, v = random_qkv(layout)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)


# -- memory ------------------------------------------------------------------------------

def test_a_mask_over_max_mask_bytes_is_refused_before_allocating():
    # the default bound (256 MiB) refuses a 4 GiB mask the same way; a small bound here keeps a
    # regression from allocating gigabytes
    assert AttnPolicyConfig().max_mask_bytes == 256 * 2**20
    layout = BatchLayout.from_lens([40, 30])  # MASK rows bucket 128: a 16 KiB mask
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=64, max_mask_bytes=4096))
    with pytest.raises(BucketOverflowError, match=r"128 x 128 mask \(16384 bytes\), more than "
                                                  r"max_mask_bytes=4096"):
        d.prepare(layout, SPEC)
    assert d.stats().cache.misses == 0 and d.stats().masks.bytes == 0


def test_an_oversized_mask_runs_in_varlen_under_on_overflow_eager():
    layout = BatchLayout.from_lens([40, 30])  # MASK rows bucket 128: 16 KiB mask
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=64,
                                    max_mask_bytes=4096, on_overflow="eager"))
    q, k, v = random_qkv(layout)
    out = d.attend(q, k, v, layout)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
    s = d.stats()
    assert s.mask_fallbacks == 1 and s.modes["varlen"] == 1 and s.modes["mask"] == 0
    cached = d.cache.keys()
    assert {key.kind for key in cached} == {CallKind.CAUSAL}
    assert s.to_json()["mask_fallbacks"] == 1


def test_masks_are_bounded_reported_and_freed_with_the_dispatcher():
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=256,
                                    max_mask_bytes=3 * 256 * 256))
    seen = []
    for n in range(20):  # 20 distinct layouts of one 256 x 256 bucket
        layout = BatchLayout.from_lens([100 + n, 100 - n])
        d.attend(*random_qkv(layout), layout)
        assert d.stats().masks.bytes <= 3 * 256 * 256
    s = d.stats().masks
    assert (s.masks, s.misses, s.evictions) == (3, 20, 17)
    seen.append(weakref.ref(layout_mask(d.masks, layout, 256, 256, torch.device("cpu"))))  # the last layout's: a hit
    assert d.stats().masks.misses == 20
    assert s.to_json()["bytes"] == 3 * 256 * 256
    del d
    gc.collect()
    assert seen[0]() is None  # nothing outlives its dispatcher


# -- compile accounting ------------------------------------------------------------------

def test_the_graphs_of_a_running_batch_are_pinned_so_compiles_are_exact():
    counter = []
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="eager", max_graphs=1, max_seq_len=64),
                   compile_counter=counter.append)
    layout = BatchLayout.from_lens([10, 20, 40])
    q, k, v = random_qkv(layout)
    out = d.attend(q, k, v, layout)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
    s = d.stats().cache
    assert s.compiles == len(counter) == 3
    assert s.graphs == 1 and s.peak_graphs == 1 and s.peak_held_graphs == 2 and s.held_graphs == 0


_REQUESTS = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=5)


@settings(max_examples=12, deadline=None)
@given(reqs=_REQUESTS, policy=st.sampled_from(["dynamic", "varlen", "always-mask"]),
       capacity=st.integers(1, 3), eviction=st.sampled_from(["lru", "fifo", "lfu"]))
def test_stats_compiles_equal_backend_compiles_and_the_simulation(reqs, policy, capacity, eviction):
    """Random workloads, tiny capacities: ``stats`` counts every backend compile, and the
    simulator (same batches, no compute) counts exactly what the real run did."""
    requests = [Request(float(i), p, o) for i, (p, o) in enumerate(reqs)]
    former = BatchFormer(max_num_seqs=3, max_num_batched_tokens=48, max_model_len=64)
    steps = list(former.steps(requests))
    config = AttnPolicyConfig(policy=policy, backend="eager", max_graphs=capacity, eviction=eviction,
                              max_seq_len=64, max_batch_tokens=256,
                              buckets={"kind": "list", "sizes": [16, 64, 256]})
    counter = []
    real = Dispatcher(config, compile_counter=counter.append)
    for step in steps:
        layout = step.layout
        real.attend(*random_qkv(layout, heads=2, kv_heads=1, head_dim=8), layout)
    stats = real.stats()
    assert stats.cache.compiles == len(counter)
    model = CostModel.default().model_copy(update={"heads": 2, "kv_heads": 1, "head_dim": 8,
                                                   "backend": "eager", "impl": "sdpa", "partition_len": None})
    simulated = _replays(steps, [config], model)[0].stats["cache"]
    for field in ("hits", "misses", "compiles", "evictions", "peak_graphs", "peak_held_graphs"):
        assert simulated[field] == getattr(stats.cache, field), field


# -- faults ------------------------------------------------------------------------------

def test_an_unwritable_decisions_log_is_refused_when_installed(tmp_path):
    from attnpolicy.integrations.runtime import DECISIONS_LOG_ENV, install_decision_log

    path = tmp_path / "missing-dir" / "log.jsonl"
    with pytest.raises(ConfigError, match=rf"{DECISIONS_LOG_ENV}=.*log.jsonl: cannot append"):
        install_decision_log({DECISIONS_LOG_ENV: str(path)})


def test_a_failed_cost_model_save_keeps_the_previous_file(tmp_path, monkeypatch):
    model = CostModel.default()
    path = model.save(tmp_path / "model.json")
    changed = model.model_copy(update={"heads": model.heads + 1})

    def broken_replace(src, dst):
        raise OSError(27, "File too large")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="File too large"):
        changed.save(path)
    monkeypatch.undo()
    assert CostModel.load(path) == model
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]  # no temporary left


def test_simulate_reports_a_trace_whose_every_request_is_rejected():
    requests = [Request(0.0, 10**23, 5), Request(1.0, 9000, 1)]
    with pytest.raises(ConfigError, match=r"2 of 2 requests rejected: longer than max_model_len=8192 tokens "
                                          r"\(prompt \+ output; the first: 100000000000000000000000 \+ 5\): "
                                          r"nothing to simulate"):
        simulate(requests, ["dynamic"], [4], ["lru"])
    (row,) = simulate([*requests, Request(2.0, 100, 5)], ["dynamic"], [4], ["lru"])
    assert row.rejected == 2 and row.batches > 0
