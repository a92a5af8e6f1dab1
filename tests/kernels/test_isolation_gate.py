"""The isolation gate: a batch with a masked call runs its graphs on the raw K/V when
they are finite and no q·k can overflow, and takes the isolating path (sanitise, run,
re-run a sequence with huge values alone, re-poison) whenever any K/V row holds NaN or
±inf or a value large enough to overflow a score, with the rule's output (see
kernels/isolation.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from reference import reference_for
from strategies import random_qkv

import attnpolicy.graphs.execute as execute_module
import attnpolicy.kernels.flex as flex_module
from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import IMPLS
from attnpolicy.graphs.execute import attend
from attnpolicy.kernels.isolation import all_finite, isolated, leak_free, sanitised

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
    """Counts calls of the isolating path in a module (``isolated`` of the dispatcher's
    execution, ``sanitised`` of flex)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object) -> None:
        self.calls = 0
        name, original = ("sanitised", sanitised) if module is flex_module else ("isolated", isolated)

        def counted(*args):
            self.calls += 1
            return original(*args)
        monkeypatch.setattr(module, name, counted)


_qkv = partial(random_qkv, head_dim=8)  # 4 heads over 2 kv heads of 8


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
    monkeypatch.setattr(execute_module, "leak_free", lambda q, k, v: calls.append(1) or True)
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
    monkeypatch.setattr(execute_module, "leak_free", lambda q, k, v: calls.append(1) or True)
    monkeypatch.setattr(flex_module, "all_finite", lambda k, v: calls.append(1) or True)
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


def _mask_dispatcher(impl: str, backend: str) -> Dispatcher:
    kernels = {"mask": "flex"} if impl == "flex" else {}
    return Dispatcher(AttnPolicyConfig(policy="always-mask", backend=backend, max_seq_len=32,
                                       attn_impl="sdpa" if impl == "flex" else impl,
                                       partition_len=8 if impl == "flash" else None, kernels=kernels))


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """An uninitialised buffer: every bit pattern of ``dtype`` (NaN, ±inf, huge, tiny)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g) if dtype.itemsize == 2 else \
        torch.randint(-2**31, 2**31, shape, dtype=torch.int32, generator=g)
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["none", "aot_eager"])
@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_large_finite_keys_of_a_neighbour_never_reach_a_sequence(impl, backend, dtype):
    """The issue's example: q·k of a neighbour's 3e38 keys overflows to +inf, and an
    additive -inf mask makes it NaN; it must not reach sequence 0, and a neighbour
    whose keys are merely large (×1e15: no score of its own overflows) keeps its
    own exact answer, as in a batch of its own."""
    layout = BatchLayout.from_lens([10, 20])
    torch.manual_seed(0)
    q, k, v = (torch.randn(30, 4, 16).to(dtype) for _ in range(3))
    d = _mask_dispatcher(impl, backend)
    clean = d.attend(q, k, v, layout)
    tol = 1e-5 if dtype is torch.float32 else 2**-6
    for big in (None, 1e15):
        kk = k.clone()
        kk[10:] = 3e38 if big is None else kk[10:] * big
        out = d.attend(q, kk, v, layout)
        assert torch.equal(out[:10], clean[:10]), big
        if big is not None:
            want = reference_for(q[10:], kk[10:], v[10:], BatchLayout.from_lens([20]))
            torch.testing.assert_close(out[10:].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_random_bits_in_padding_rows_never_reach_a_sequence(impl, dtype):
    """Runtimes pad with uninitialised buffers: any bit pattern in a padding row of
    q, k or v leaves every real row as it is with zero padding."""
    layout = BatchLayout.from_lens([5, 7, 3], causal=False, padded_to=24)
    torch.manual_seed(1)
    q, k, v = (torch.randn(24, 8, 16).to(dtype) for _ in range(3))
    pad = torch.zeros(24, dtype=torch.bool)
    pad[15:] = True
    clean = [t.masked_fill(pad[:, None, None], 0) for t in (q, k, v)]
    d = _mask_dispatcher(impl, "none")
    want = d.attend(*clean, layout)
    assert want[:15].isfinite().all()
    for seed in range(20):
        dirty = [t.clone() for t in clean]
        for i, t in enumerate(dirty):
            t[15:] = _random_bits((9, 8, 16), dtype, 3 * seed + i)
        assert torch.equal(d.attend(*dirty, layout)[:15], want[:15]), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_leak_free_passes_ordinary_batches_and_fails_any_that_could_overflow(dtype):
    q, k, v = (torch.randn(12, 4, 16).to(dtype) * 10 for _ in range(3))
    assert leak_free(q, k, v)
    for target in range(3):
        for bad in (*BAD, torch.finfo(dtype).max, -torch.finfo(dtype).max / 2):
            t = [q.clone(), k.clone(), v.clone()]
            t[target][3, 1, 2] = bad
            if dtype is torch.float16 and target < 2 and abs(bad) < float("inf"):
                continue  # fp16's max times another fp16 cannot come near fp32's range: no overflow
            if target == 2 and abs(bad) < float("inf"):
                assert leak_free(*t) or dtype in (torch.float32, torch.float64)  # v·k may overflow: conservative
                continue
            assert not leak_free(*t), (target, bad)
