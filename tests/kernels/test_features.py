"""Sliding windows, soft caps and sinks: every mode × kernel against the float64
reference (hypothesis drawing layouts and features), isolation under them, the
capabilities kernels declare, and the graph keys that tell them apart."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import features, layouts, random_qkv

from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, legal_modes
from attnpolicy.errors import ConfigError, KernelError, LayoutError
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.kernel_choice import KernelChoice
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels.attention import _IMPL_FNS, _eager, bind
from attnpolicy.kernels.conformance import ProbeCase, probe
from attnpolicy.kernels.isolation import poisoned_rows
from attnpolicy.kernels.masks import mask_for
from attnpolicy.plugins.kernels import KernelInfo, why_unfit

IMPLS = ("sdpa", "eager", "flash", "flex")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _real(layout: BatchLayout) -> torch.Tensor:
    real = torch.zeros(layout.q_tokens, dtype=torch.bool)
    for s, n in zip(layout.q_starts, layout.q_lens):
        real[s:s + n] = True
    return real


_qkv = partial(random_qkv, head_dim=8)  # 4 heads over 2 kv heads of 8


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(layout=layouts(max_seqs=4, max_len=60, max_context=30, max_pad=8), feats=features(heads=4),
       seed=st.integers(0, 2**31 - 1))
def test_every_mode_matches_the_reference_under_every_feature(impl, layout, feats, seed):
    window, softcap, sinks = feats
    q, k, v = _qkv(layout, seed)
    want = reference_for(q, k, v, layout, window=window, softcap=softcap, sinks=sinks)
    real = _real(layout)
    for mode in legal_modes(layout):
        if impl == "flex" and mode.value != "mask":
            continue
        got = attend(q, k, v, layout, mode, impl, window=window, softcap=softcap, sinks=sinks,
                     partition_len=16 if impl == "flash" else None)
        assert not got[~real].any(), "padding rows are zero"
        torch.testing.assert_close(got[real].double(), want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ("sdpa", "eager", "flex"))
@settings(max_examples=15, deadline=None)
@given(layout=layouts(min_seqs=2, max_seqs=4, max_len=40, max_context=20, max_pad=8), feats=features(heads=4),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_a_neighbours_bad_rows_never_reach_a_sequence(impl, layout, feats, seed, data):
    window, softcap, sinks = feats
    q, k, v = _qkv(layout, seed)
    me = data.draw(st.integers(0, layout.num_seqs - 1))
    mode = "mask" if impl == "flex" else data.draw(st.sampled_from(["mask", "varlen", "rows"]))
    clean = attend(q, k, v, layout, mode, impl, window=window, softcap=softcap, sinks=sinks)
    for i in range(layout.num_seqs):
        if i != me:
            row = layout.kv_starts[i] + data.draw(st.integers(0, layout.kv_lens[i] - 1))
            (k if data.draw(st.booleans()) else v)[row] = data.draw(st.sampled_from(
                [math.nan, math.inf, -math.inf, 3e38]))
    dirty = attend(q, k, v, layout, mode, impl, window=window, softcap=softcap, sinks=sinks)
    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    assert torch.isfinite(dirty[rows]).all()
    torch.testing.assert_close(dirty[rows], clean[rows], atol=1e-6, rtol=1e-6)


def test_under_a_window_only_the_rows_that_see_a_bad_key_are_poisoned():
    layout = BatchLayout.from_lens([6], [9])  # 3 cached keys: queries sit at positions 3..8
    bad = torch.zeros(9, dtype=torch.bool)
    bad[4] = True
    # window 2: position p sees keys p-1, p; key 4 is seen by positions 4 and 5 (queries 1, 2)
    assert poisoned_rows(layout, bad, 2).tolist() == [False, True, True, False, False, False]
    assert poisoned_rows(layout, bad).tolist() == [False, True, True, True, True, True]
    bidir = BatchLayout.from_lens([5], causal=False)
    bad = torch.zeros(5, dtype=torch.bool)
    bad[2] = True
    assert poisoned_rows(bidir, bad, 2).tolist() == [False, True, True, True, False]


def test_a_window_band_matches_its_definition():
    layout = BatchLayout.from_lens([3], [6])
    got = mask_for(layout, 2).materialize()
    pos = torch.arange(3, 6)[:, None]
    key = torch.arange(6)[None, :]
    assert torch.equal(got, (key <= pos) & (pos - key < 2))


def test_features_are_validated_with_their_field_named():
    with pytest.raises(LayoutError, match="window"):
        Features(window=0)
    with pytest.raises(LayoutError, match="softcap"):
        Features(softcap=-1.0)
    with pytest.raises(LayoutError, match="softcap"):
        Features(softcap=math.inf)
    assert Features(window=8, softcap=50, sinks=True).describe() == "sliding window 8, soft cap 50, sinks"
    assert not PLAIN.any


def test_graph_keys_tell_features_apart():
    call = Call(CallKind.MASK, 0, 10, 0, 10, 16, 16, True)
    keys = {GraphKey.for_call(call, TensorSpec("float32", 4, 2, 8, features=f), "sdpa", None, "none")
            for f in (PLAIN, Features(window=8), Features(window=16), Features(softcap=30.0), Features(sinks=True))}
    assert len(keys) == 5
    assert str(GraphKey.for_call(call, TensorSpec("float32", 4, 2, 8, features=Features(8, 50.0, True)),
                                 "sdpa", None, "none")).endswith("/w8/cap50/sinks/none")


def test_sinks_must_match_the_graphs():
    layout = BatchLayout.from_lens([4, 3])
    q, k, v = _qkv(layout, 0)
    with pytest.raises(LayoutError, match="sinks"):
        attend(q, k, v, layout, "mask", sinks=torch.zeros(3))


@pytest.mark.parametrize("sinks", [[0.5, -1.0, 0.0, 2.0], (0.5,) * 4, 1.5])
def test_sinks_that_are_no_tensor_are_refused_before_any_work(sinks):
    from attnpolicy import AttnPolicyConfig, Dispatcher

    layout = BatchLayout.from_lens([4, 3])
    q, k, v = _qkv(layout, 0)
    d = Dispatcher(AttnPolicyConfig(backend="aot_eager", max_seq_len=64))
    with pytest.raises(LayoutError, match=rf"sinks must be a tensor \[Hq=4\] of sink logits, got "
                                          rf"{type(sinks).__name__}"):
        d.attend(q, k, v, layout, sinks=sinks)
    assert d.stats().batches == 0 and d.stats().cache.misses == 0


def _uncapped(q, k, v, causal, mask, scale, partition_len, softcap=None, sinks=None):
    return _eager(q, k, v, causal, mask, scale, partition_len, None, sinks)  # ignores the cap


def test_the_probe_catches_a_kernel_that_declares_a_cap_it_does_not_apply(monkeypatch):
    info = KernelInfo("uncapped", "mask", _uncapped, softcap=True)
    case = ProbeCase("mask", True, False, False, features=ProbeCase.probing(Features(softcap=30.0)))
    monkeypatch.setitem(_IMPL_FNS, "uncapped", _uncapped)
    with pytest.raises(KernelError, match="soft cap 0.5"):
        probe(case, bind("uncapped", softcap=case.features.softcap), info.name, "test")
    assert why_unfit(KernelInfo("plain", "mask", _uncapped), causal=True, context=False, dtype="float32",
                     gqa=False, device="cpu", compiled=False,
                     features=Features(window=8)) == "a sliding window (8)"


def test_auto_never_picks_a_kernel_without_the_feature(monkeypatch):
    import attnpolicy.graphs.kernel_choice as kc

    plain = KernelInfo("plainonly", "mask", _uncapped)
    monkeypatch.setitem(_IMPL_FNS, "plainonly", _uncapped)
    sdpa = kc.get_kernel("mask", "sdpa")
    monkeypatch.setattr(kc, "impls_for", lambda kind: [plain, sdpa])
    monkeypatch.setattr(kc, "check_kernel_names", lambda kernels: None)
    choice = KernelChoice({"mask": "auto"}, "sdpa", compiled=False, measured={"mask": {"plainonly": 0.0}})
    layout = BatchLayout.from_lens([4, 3])
    call = Call(CallKind.MASK, 0, 7, 0, 7, 7, 7, True)
    assert choice.impl(call, layout, TensorSpec("float32", 4, 2, 8)) == "plainonly"
    capped = TensorSpec("float32", 4, 2, 8, features=Features(softcap=5.0))
    assert choice.impl(call, layout, capped) == "sdpa"
    monkeypatch.setattr(kc, "impls_for", lambda kind: [plain])
    with pytest.raises(ConfigError, match="soft cap 5"):
        KernelChoice({"mask": "auto"}, "sdpa", compiled=False).impl(call, layout, capped)
