"""The isolation gate: a batch with a masked call runs its graphs on the raw K/V when
they are finite, and takes the isolating path (sanitise, run, re-poison) whenever any
K/V row holds NaN or ±inf, with the rule's output (see kernels/isolation.py)."""

from __future__ import annotations

import pytest
import torch
from reference import reference_for

import attnpolicy.graphs.execute as execute_module
import attnpolicy.kernels.flex as flex_module
from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import IMPLS
from attnpolicy.graphs.execute import attend
from attnpolicy.kernels.isolation import all_finite, sanitised

BAD = (float("nan"), float("inf"), float("-inf"))
LAYOUTS = {
    "causal, context": BatchLayout.from_lens([3, 4], [6, 4]),
    "bidirectional, padded": BatchLayout.from_lens([3, 4], causal=False, padded_to=9),
}
TOL = 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_sees_every_non_finite_value(dtype):
    k, v = torch.randn(5, 2, 4).to(dtype), torch.randn(5, 2, 4).to(dtype)
    assert all_finite(k, v)
    for bad in BAD:
        for index in ((0, 0, 0), (2, 1, 3), (4, 1, 1)):
            for target, other in (("k", "v"), ("v", "k")):
                t = {"k": k.clone(), "v": v.clone()}
                t[target][index] = bad
                assert not all_finite(t["k"], t["v"]), (bad, index, target)
                t[other][index] = 0  # inf · 0 is NaN: still seen
                assert not all_finite(t["k"], t["v"]), (bad, index, target, "other 0")


def test_all_finite_has_no_fp16_overflow_on_ordinary_values():
    k = v = torch.full((64, 8, 64), 60.0, dtype=torch.float16)  # k · v overflows fp16, the fp32 sums do not
    assert all_finite(k, v)


class _Spy:
    """Counts calls of ``sanitised`` (the isolating path) in a module."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        self.calls = 0

        def counted(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return sanitised(x, bad)
        monkeypatch.setattr(module, "sanitised", counted)


def _qkv(layout: BatchLayout) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(layout.q_tokens, 4, 8, generator=g), torch.randn(layout.kv_tokens, 2, 8, generator=g),
            torch.randn(layout.kv_tokens, 2, 8, generator=g))


def _poisoned(layout: BatchLayout, row: int) -> torch.Tensor:
    """The query rows that attend packed key row ``row`` (nothing for a padding row)."""
    rows = torch.zeros(layout.q_tokens, dtype=torch.bool)
    for qs, ql, ks, kl in zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens):
        if ks <= row < ks + kl:
            first = max(0, row - ks - (kl - ql)) if layout.causal else 0
            rows[qs + first:qs + ql] = True
    return rows


def _check_every_row(run, layout: BatchLayout, spy: _Spy) -> None:
    q, k, v = _qkv(layout)
    want = reference_for(q, k, v, layout)
    clean = run(q, k, v)
    assert spy.calls == 0  # finite K/V: the graphs run on them as they are
    torch.testing.assert_close(clean.double(), want, atol=TOL, rtol=TOL)
    for row in range(layout.kv_tokens):
        for target in ("k", "v"):
            for bad in BAD:
                kk, vv = k.clone(), v.clone()
                (kk if target == "k" else vv)[row, 1, 2] = bad
                before = spy.calls
                out = run(q, kk, vv)
                assert spy.calls > before, (row, target, bad)  # the gate took the isolating path
                poisoned = _poisoned(layout, row)
                assert out[poisoned].isnan().all(), (row, target, bad)
                torch.testing.assert_close(out[~poisoned].double(), want[~poisoned], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("mode", [MaskMode.MASK, MaskMode.VARLEN])
@pytest.mark.parametrize("impl", IMPLS)
def test_any_non_finite_kv_row_takes_the_isolating_path(monkeypatch, impl, mode, layout):
    spy = _Spy(monkeypatch, execute_module)
    _check_every_row(lambda q, k, v: attend(q, k, v, layout, mode, impl, partition_len=4), layout, spy)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_flex_takes_the_isolating_path_on_any_non_finite_kv_row(monkeypatch, layout):
    spy = _Spy(monkeypatch, flex_module)
    _check_every_row(lambda q, k, v: attend(q, k, v, layout, MaskMode.MASK, "flex"), layout, spy)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("policy", ["always-mask", "varlen"])
def test_compiled_graphs_are_gated_the_same_way(monkeypatch, backend, policy):
    """The isolating path runs the batch's own compiled graphs: no other graph compiles."""
    layout = LAYOUTS["causal, context"]  # VARLEN runs per-sequence VARLEN graphs (context)
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend=backend, max_seq_len=16))
    d.attend(*_qkv(layout), layout)
    compiles = d.stats().cache.compiles
    spy = _Spy(monkeypatch, execute_module)
    _check_every_row(lambda q, k, v: d.attend(q, k, v, layout), layout, spy)
    assert d.stats().cache.compiles == compiles


def test_a_causal_only_batch_pays_no_gate(monkeypatch):
    """CAUSAL calls hold one sequence each and take no mask: nothing to gate."""
    calls = []
    monkeypatch.setattr(execute_module, "all_finite", lambda k, v: calls.append(1) or True)
    layout = BatchLayout.from_lens([3, 4])
    q, k, v = _qkv(layout)
    attend(q, k, v, layout, MaskMode.VARLEN)
    assert not calls
    attend(q, k, v, layout, MaskMode.MASK)
    assert calls == [1]


@pytest.mark.parametrize(("mode", "impl"), [*((m, i) for m in (MaskMode.MASK, MaskMode.VARLEN) for i in IMPLS),
                                            (MaskMode.MASK, "flex")])
def test_one_unpadded_sequence_has_no_neighbour_and_pays_no_gate(monkeypatch, mode, impl):
    """No other sequence and no padding rows: nothing to isolate, no check; a bad
    value still reaches the rows that attend it (as in the sequence's CAUSAL call)."""
    calls = []
    for module in (execute_module, flex_module):
        monkeypatch.setattr(module, "all_finite", lambda k, v: calls.append(1) or True)
    single = BatchLayout.from_lens([5], [9])  # cached context: a VARLEN call, a MASK with hidden keys
    q, k, v = _qkv(single)
    torch.testing.assert_close(attend(q, k, v, single, mode, impl, partition_len=4).double(),
                               reference_for(q, k, v, single), atol=TOL, rtol=TOL)
    v[7, 1, 2] = float("nan")  # key 7 (kv head 1): attended by query rows 3 and 4 (bottom-right causal)
    out = attend(q, k, v, single, mode, impl, partition_len=4)
    assert out[3:, 2:, 2].isnan().all()  # query heads 2, 3 read kv head 1
    assert not calls
    padded = BatchLayout.from_lens([5], [9], padded_to=6)  # a padding row: checked
    attend(torch.randn(6, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8), padded, mode, impl, partition_len=4)
    assert calls == [1]
