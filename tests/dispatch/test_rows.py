"""The ROWS mode: each sequence in its own right-padded row. Its plan (row buckets, calls
of at most the largest row bucket, length buckets, overflow), its graph keys, its
results through the Dispatcher against the float64 reference for every layout
hypothesis draws (each built-in kernel, fp16/bf16, windows, caps, sinks), the host
masks it never builds, its warm-up shapes and its pad-up."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import features, layouts, random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.config import WarmShape
from attnpolicy.core.modes import CallKind, MaskMode, legal_modes
from attnpolicy.core.names import IMPLS
from attnpolicy.errors import BucketOverflowError, ConfigError
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.kernels import masks

SPEC = TensorSpec("float32", 4, 2, 16)
TOL = {torch.float32: 1e-5, torch.float16: 2**-8, torch.bfloat16: 2**-6}


def _config(**fields) -> AttnPolicyConfig:
    return AttnPolicyConfig(**{"policy": "always-rows", "backend": "none", "max_seq_len": 64,
                               "row_buckets": (1, 2, 4), **fields})


def test_rows_is_legal_for_every_layout():
    for layout in (BatchLayout.from_lens([5]), BatchLayout.from_lens([5, 7], [9, 7]),
                   BatchLayout.from_lens([3], causal=False, padded_to=8)):
        assert MaskMode.ROWS in legal_modes(layout)


def test_a_rows_plan_buckets_rows_and_lengths_and_splits_past_the_largest_row_bucket():
    d = Dispatcher(_config())
    layout = BatchLayout.from_lens([5, 20, 3, 4, 6, 2], [5, 20, 3, 9, 6, 2])
    plan = d.planner.plan(layout, MaskMode.ROWS, SPEC)
    calls = [call for call, _ in plan.calls]
    assert [(c.seq_start, c.seqs, c.rows) for c in calls] == [(0, 4, 4), (4, 2, 2)]
    assert [(c.q_bucket, c.kv_bucket, c.context) for c in calls] == [(32, 32, True), (16, 16, False)]
    keys = [str(key) for _, key in plan.calls]
    assert keys[0].startswith("rows-ctx/r4/q32/") and keys[1].startswith("rows/r2/q16/")
    assert plan.padded_tokens == 4 * 32 + 2 * 16 - layout.total_tokens
    # decodes run apart from prefills, as [rows, 1] calls: no query row padded
    step = BatchLayout.from_lens([1, 1, 1, 40, 1], [20, 9, 30, 50, 7])
    calls = [call for call, _ in d.planner.plan(step, MaskMode.ROWS, SPEC).calls]
    assert [(c.seq_start, c.seqs, c.rows, c.q_bucket, c.kv_bucket) for c in calls] == [
        (0, 3, 4, 1, 32), (3, 1, 1, 64, 64), (4, 1, 1, 1, 16)]
    with pytest.raises(ValueError, match=r"warmup.0.q_bucket: 2 is not a bucket"):
        _config(warmup=[WarmShape(kind=CallKind.ROWS, q_bucket=2, kv_bucket=32, context=True, rows=4)])
    # one key rule: every other kind keeps rows 1 and shows none
    (call,) = plan_calls(BatchLayout.from_lens([5]), MaskMode.CAUSAL)
    key = GraphKey.for_call(call, SPEC, "sdpa", None, "none")
    assert key.rows == 1 and "/r" not in str(key)


def test_a_rows_length_over_the_largest_bucket_follows_on_overflow():
    layout = BatchLayout.from_lens([70, 3])
    with pytest.raises(BucketOverflowError, match="length 70 exceeds the largest bucket 64"):
        Dispatcher(_config()).prepare(layout, SPEC)
    d = Dispatcher(_config(on_overflow="eager", max_batch_tokens=128))
    q, k, v = random_qkv(layout)
    out = d.attend(q, k, v, layout)
    assert d.stats().overflow == 1 and d.stats().cache.misses == 0
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(layout=layouts(max_seqs=6, max_len=40, max_context=24, max_pad=8), feats=features(heads=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_rows_through_the_dispatcher_equals_the_reference(impl, layout, feats, dtype, seed):
    """Lengths, cached context, decode, bidirectional, GQA (4 over 2 heads), windows, caps,
    sinks, fp16/bf16: every real row within the dtype's tolerance, every output finite,
    padding rows zero; a batch of more sequences than the largest row bucket included."""
    window, softcap, sinks = feats
    q, k, v = (t.to(dtype) for t in random_qkv(layout, seed))
    d = _dispatcher(impl)
    out = d.attend(q, k, v, layout, window=window, softcap=softcap, sinks=None if sinks is None else sinks.to(dtype))
    assert torch.isfinite(out).all()
    want = reference_for(q, k, v, layout, window=window, softcap=softcap, sinks=sinks)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


_dispatchers: dict[str, Dispatcher] = {}


def _dispatcher(impl: str) -> Dispatcher:
    if impl not in _dispatchers:
        _dispatchers[impl] = Dispatcher(_config(attn_impl=impl, partition_len=16 if impl == "flash" else None))
    return _dispatchers[impl]


@pytest.mark.parametrize("backend", ["none", "aot_eager"])
def test_a_rows_call_builds_no_host_mask(backend, monkeypatch):
    """Context, decode, bidirectional and windowed rows bound their keys in the graph: no
    dense mask is built (none materialised, none in the mask cache), where MASK builds one."""
    built = []
    materialize = masks.BlockDiagonalMask.materialize
    monkeypatch.setattr(masks.BlockDiagonalMask, "materialize",
                        lambda self, *a, **k: built.append(self.layout) or materialize(self, *a, **k))
    batches = [BatchLayout.from_lens([5, 7], [9, 7]), BatchLayout.from_lens([1, 1, 1], [9, 4, 12]),
               BatchLayout.from_lens([5, 7], causal=False, padded_to=16), BatchLayout.from_lens([6, 3])]
    rows, mask = Dispatcher(_config(backend=backend)), Dispatcher(_config(backend=backend, policy="always-mask"))
    for layout in batches:
        for window in (None, 3):
            q, k, v = random_qkv(layout)
            rows.attend(q, k, v, layout, window=window)
    assert built == [] and rows.stats().masks.misses == 0 and rows.stats().masks.masks == 0
    assert rows.stats().modes["rows"] == 2 * len(batches)
    q, k, v = random_qkv(batches[0])
    mask.attend(q, k, v, batches[0])
    assert built == [batches[0]] and mask.stats().masks.misses == 1  # the count can fail


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_rows_bad_value_poisons_only_its_own_row(impl, value):
    layout = BatchLayout.from_lens([5, 7, 4], [9, 7, 4], padded_to=20)
    q, k, v = random_qkv(layout)
    d = _dispatcher(impl)
    clean = d.attend(q, k, v, layout)
    k[1, 0, 3] = value  # a context key of sequence 0, seen by all its queries
    out = d.attend(q, k, v, layout)
    assert torch.equal(out[5:], clean[5:])  # the other rows: bit for bit
    assert out[:5].isnan().any()


def test_rows_warm_shapes_compile_their_graphs_and_are_validated():
    shape = WarmShape(kind=CallKind.ROWS, q_bucket=1, kv_bucket=32, causal=True, context=True, rows=4)
    d = Dispatcher(_config(backend="aot_eager", warmup=[shape], strict="raise"))  # no compile after warm-up
    (key,) = d.warmup(SPEC)
    assert (key.kind, key.rows, key.q_len, key.kv_len, key.context) == (CallKind.ROWS, 4, 1, 32, True)
    layout = BatchLayout.from_lens([1, 1, 1], [20, 9, 30])  # decode rows of that key
    q, k, v = random_qkv(layout)
    torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout),
                               atol=1e-5, rtol=1e-5)
    assert d.stats().cache.compiles == 1
    with pytest.raises(ValueError, match="rows 3 is not one of row_buckets"):
        _config(warmup=[shape.model_copy(update={"rows": 3})])
    with pytest.raises(ValueError, match="rows 4 is for a rows graph"):
        WarmShape(kind=CallKind.VARLEN, q_bucket=16, kv_bucket=32, context=True, rows=4)
    assert "rows" not in WarmShape(kind=CallKind.CAUSAL, q_bucket=16, kv_bucket=16).model_dump()


def test_a_rows_call_pads_up_only_to_rows_graphs_that_serve_it():
    kinds = list(CallKind)
    model = CostModel(run={f: Fit(base=1e-4) for f in kinds}, compile={f: Fit(base=1.0) for f in kinds},
                      mask_build=Fit(per_cell=1e-9), heads=4, kv_heads=2, head_dim=16)
    family = Dispatcher(_config(), cost_model=model).source.family
    fresh4 = GraphKey(CallKind.ROWS, 16, 16, True, SPEC, "sdpa", None, "aot_eager", 4)
    ctx2 = GraphKey(CallKind.ROWS, 16, 16, True, SPEC, "sdpa", None, "aot_eager", 2, True)
    ctx4 = GraphKey(CallKind.ROWS, 32, 32, True, SPEC, "sdpa", None, "aot_eager", 4, True)
    assert family.pad_up(ctx2, [fresh4]) is None  # a mask-free graph cannot bound context
    assert family.pad_up(fresh4, [ctx2]) is None  # nor may fewer rows serve
    assert family.pad_up(ctx2, [fresh4, ctx4]) == ctx4 and family.pad_up(fresh4, [ctx4]) == ctx4
    assert family.rows(ctx4) == 4 * 32
    unpriced = model.model_copy(update={"run": {f: Fit(base=1e-4) for f in kinds[:3]}})
    assert not unpriced.prices(CallKind.ROWS) and model.prices(CallKind.ROWS)
    assert Dispatcher(_config(), cost_model=unpriced).source.family.pad_up(ctx2, [ctx4]) is None


def test_a_rows_call_is_priced_as_its_rows_times_one_rows_fit():
    kinds = list(CallKind)
    model = CostModel(run={f: Fit(base=1e-4, per_cell=1e-8) for f in kinds}, compile={f: Fit(base=1.0) for f in kinds},
                      mask_build=Fit(per_cell=1e-9))
    one = GraphKey(CallKind.ROWS, 16, 64, True, SPEC, "sdpa", None, "none", 1, True)
    eight = GraphKey(CallKind.ROWS, 16, 64, True, SPEC, "sdpa", None, "none", 8, True)
    assert model.run_seconds(eight) == pytest.approx(8 * model.run_seconds(one))
    assert model.run_seconds(one) == pytest.approx(1e-4 + 1e-8 * 16 * 64)
    old = CostModel(run={f: Fit(base=1e-4) for f in kinds[:3]}, compile={f: Fit(base=1.0) for f in kinds[:3]},
                    mask_build=Fit(per_cell=1e-9))  # calibrated before the rows kind: still loads
    with pytest.raises(ConfigError, match="no rows fit .* run attnpolicy calibrate"):
        old.run_seconds(one)


def test_fallback_mode_rows_runs_an_illegal_decision_as_rows_for_every_layout():
    """``fallback_mode: rows`` is accepted (saved and loaded), legal for every layout: CAUSAL
    chosen for a packed, a context or a bidirectional batch runs as rows, counted, exact."""
    config = _config(policy="always-causal", fallback_mode="rows")
    assert AttnPolicyConfig.model_validate_json(config.model_dump_json()).fallback_mode == "rows"
    d = Dispatcher(config)
    batches = [BatchLayout.from_lens([5, 7]), BatchLayout.from_lens([3], [9]),
               BatchLayout.from_lens([5, 7], causal=False, padded_to=16)]
    for layout in batches:
        q, k, v = random_qkv(layout)
        torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout),
                                   atol=1e-5, rtol=1e-5)
    assert d.stats().modes["rows"] == d.stats().guard_fallbacks == len(batches)
    with pytest.raises(ValueError, match="fallback_mode"):
        _config(fallback_mode="causal")
