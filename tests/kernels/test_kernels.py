"""Every legal (mode, impl) against the independent per-sequence reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts, poisons, qkv

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import IMPLS
from attnpolicy.errors import IllegalModeError, LayoutError
from attnpolicy.graphs.execute import attend
from attnpolicy.kernels.attention import attention
from attnpolicy.plugins.kernels import KERNEL_KINDS, get_kernel, impls_for, why_unfit

# fp32 kernels against a float64 reference: rounding only.
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (eps 2**-8); inputs are identical bf16 values, so the
# error is the rounding of the output (and, in SDPA's bf16 path, of the softmax
# probabilities) to bf16: a few ulps of values of magnitude ≤ ~3. Four ulps at 1.0:
BF16_TOL = 2**-6


def _check(q, k, v, layout, mode, impl, partition_len):
    out = attend(q, k, v, layout, mode, impl, partition_len=partition_len)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference_for(q, k, v, layout)
    tol = FP32_TOL if q.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(MaskMode))
@settings(max_examples=300)
@given(data=st.data())
def test_every_legal_mode_and_impl_matches_reference(mode, impl, data):
    layout = data.draw(layouts(single=mode is MaskMode.CAUSAL))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    q, k, v = data.draw(qkv(layout, dtype))
    # At most ~16 partitions per call keeps the suite fast; sizes need not divide.
    partition_len = None
    if impl == "flash":
        partition_len = max(data.draw(st.integers(1, 128)), -(-layout.kv_tokens // 16))
    _check(q, k, v, layout, mode, impl, partition_len)


@settings(max_examples=100)
@given(layout=layouts(), data=st.data())
@example(layout=BatchLayout.from_lens([5], padded_to=8), data=None)  # one padded sequence: rarely drawn
@example(layout=BatchLayout.from_lens([3], [6]), data=None)  # one sequence with cached context
@example(layout=BatchLayout.from_lens([5], causal=False), data=None)
@example(layout=BatchLayout.from_lens([5]), data=None)  # the legal case
def test_causal_is_refused_unless_single_unpadded_causal(layout, data):
    q, k, v = data.draw(qkv(layout)) if data is not None else _tensors(layout.q_tokens, layout.kv_tokens)
    legal = layout.num_seqs == 1 and layout.causal and not layout.is_padded and not layout.has_context
    if legal:
        _check(q, k, v, layout, MaskMode.CAUSAL, "sdpa", None)
    else:
        with pytest.raises(IllegalModeError, match="mode=causal is illegal"):
            attend(q, k, v, layout, MaskMode.CAUSAL)


def test_padding_rows_are_zero():
    layout = BatchLayout.from_lens([3, 4], padded_to=10)
    q = torch.randn(10, 2, 8)
    for mode in (MaskMode.MASK, MaskMode.VARLEN):
        out = attend(q, q.clone(), q.clone(), layout, mode)
        assert out[7:].abs().max() == 0


def _tensors(q_tokens=6, kv_tokens=6, heads=4, kv_heads=2, d=8, dtype=torch.float32):
    return (torch.randn(q_tokens, heads, d, dtype=dtype), torch.randn(kv_tokens, kv_heads, d, dtype=dtype),
            torch.randn(kv_tokens, kv_heads, d, dtype=dtype))


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q[:5], k, v), "q has 5 tokens but layout.q_tokens=6"),
    (lambda q, k, v: (q, k[:5], v[:5]), "k has 5 tokens but layout.kv_tokens=6"),
    (lambda q, k, v: (q, k, v[:, :1]), "k and v must have the same shape"),
    (lambda q, k, v: (q[:, :3], k, v), r"kv heads \(2\) must divide q heads \(3\)"),
    (lambda q, k, v: (q[..., :4], k, v), "head_dim differs: q has 4, k has 8"),
    (lambda q, k, v: (q.double(), k, v), "dtype differs"),
    (lambda q, k, v: (q[0], k, v), r"q must be a 3-D tensor"),
])
def test_bad_tensors_name_the_field(change, message):
    layout = BatchLayout.from_lens([2, 4])
    with pytest.raises(LayoutError, match=message):
        attend(*change(*_tensors()), layout, MaskMode.MASK)


def test_bad_impl_and_partition_len():
    layout = BatchLayout.from_lens([6])
    with pytest.raises(ValueError, match="partition_len must be >= 1, got 0"):
        attend(*_tensors(), layout, "mask", "flash", partition_len=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        attend(*_tensors(), layout, "mask", "xformers")
    with pytest.raises(ValueError, match="'bogus' is not a valid MaskMode"):
        attend(*_tensors(), layout, "bogus")


def test_flash_partitions_do_not_change_the_result():
    q, k, v = (torch.randn(4, 50, 16) for _ in range(3))
    full = attention(q, k, v, impl="flash", causal=True, partition_len=50)
    for p in (1, 7, 16, 49):
        torch.testing.assert_close(attention(q, k, v, impl="flash", causal=True, partition_len=p), full)


@pytest.mark.parametrize("mode", [MaskMode.MASK, MaskMode.VARLEN])
def test_garbage_in_padding_rows_never_reaches_real_rows(mode):
    layout = BatchLayout.from_padding_mask(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]))
    q, k, v = _tensors(8, 8)
    pad = torch.tensor([0, 6, 7])  # rows owned by no sequence
    for t in (q, k, v):
        t[pad] = float("nan")
    out = attend(q, k, v, layout, mode)
    assert not out.isnan().any()
    assert out[pad].abs().max() == 0
    torch.testing.assert_close(out.double(), reference_for(q.nan_to_num(), k.nan_to_num(), v.nan_to_num(),
                                                           layout), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", [MaskMode.MASK, MaskMode.VARLEN])
def test_gqa_matches_reference(mode, impl, kv_heads):
    layout = BatchLayout.from_lens([3, 17, 5], [9, 17, 30], padded_to=33)
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(33, 8, 16, generator=g)
    k, v = (torch.randn(layout.kv_tokens, kv_heads, 16, generator=g) for _ in range(2))
    _check(q, k, v, layout, mode, impl, 7 if impl == "flash" else None)


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_never_repeats_k_or_v(impl):
    """No op copies K/V once per query head: no repeat/index_select, and no copy
    the size of K broadcast to every query head."""
    hq, hkv, lq, lk, d = 8, 2, 3, 40, 16
    q, k, v = torch.randn(hq, lq, d), torch.randn(hkv, lk, d), torch.randn(hkv, lk, d)
    with torch.profiler.profile(record_shapes=True) as prof:
        attention(q, k, v, impl=impl, causal=True, partition_len=lk)
    for event in prof.events():
        assert "repeat" not in event.name and "index_select" not in event.name, event.name
        if event.name in ("aten::clone", "aten::copy_", "aten::contiguous", "aten::_unsafe_view"):
            for shape in event.input_shapes:
                numel = 1
                for n in shape:
                    numel *= n
                assert not shape or numel != hq * lk * d, (event.name, event.input_shapes)


# Built-ins of every kind run in the suite above; these are the other registered ones.
EXTRA_KERNELS = [(f, info.name) for f in KERNEL_KINDS for info in impls_for(f) if info.name not in IMPLS]


def _fits(kind, impl, layout, q, k):
    return why_unfit(get_kernel(kind, impl), causal=layout.causal, context=layout.has_context,
                     dtype=str(q.dtype).removeprefix("torch."), gqa=q.shape[1] != k.shape[1],
                     device="cpu", compiled=False) is None


@pytest.mark.parametrize("kind, impl", EXTRA_KERNELS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_registered_kernel_matches_reference(kind, impl, data):
    layout = data.draw(layouts(single=kind == "causal", max_seqs=3))
    q, k, v = data.draw(qkv(layout, data.draw(st.sampled_from([torch.float32, torch.bfloat16]))))
    assume(_fits(kind, impl, layout, q, k))
    _check(q, k, v, layout, MaskMode(kind), impl, None)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_flex_isolates_sequences_from_non_finite_kv(data):
    """NaN/inf in one sequence's K or V never reaches another sequence's output (even
    when they share a 128-row block); the poisoned sequence's rows that see it are NaN
    (a batch of one unpadded sequence has no neighbour and is not gated)."""
    layout = data.draw(layouts(max_seqs=4))
    q, k, v = data.draw(qkv(layout))
    seq, which, row, value = data.draw(poisons(layout))
    clean = attend(q, k, v, layout, MaskMode.MASK, "flex")
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if which == "k" else bad_v)[row] = value
    out = attend(q, bad_k, bad_v, layout, MaskMode.MASK, "flex")
    for i, (qs, ql, ks, kl) in enumerate(zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens)):
        if i != seq:
            torch.testing.assert_close(out[qs:qs + ql], clean[qs:qs + ql])
            continue
        pos = row - ks  # query j sees key positions 0 .. kl - ql + j (all when bidirectional)
        first = max(0, pos - (kl - ql)) if layout.causal else 0
        if layout.is_single:  # no neighbour, no gate: its rows are the kernel's own answer
            continue
        assert out[qs + first:qs + ql].isnan().all()
        torch.testing.assert_close(out[qs:qs + first], clean[qs:qs + first])
    padding = torch.ones(layout.q_tokens, dtype=torch.bool)
    for qs, ql in zip(layout.q_starts, layout.q_lens):
        padding[qs:qs + ql] = False
    assert (out[padding] == 0).all()


@pytest.mark.parametrize("impl", ["flex", "sdpa", "eager", "flash"])
@settings(max_examples=15, deadline=None)
@given(data=st.data(), window=st.integers(1, 12))
def test_under_a_window_a_bad_key_poisons_only_the_rows_that_see_it(impl, data, window):
    """A NaN/inf key row of a sequence sets exactly the rows whose window reaches it
    to NaN (positions p with 0 <= p - t < window, causal); every other row of every
    sequence keeps its clean output."""
    layout = data.draw(layouts(min_seqs=2, max_seqs=4, max_len=30, max_context=10, max_pad=4).filter(
        lambda lay: lay.causal))
    q, k, v = data.draw(qkv(layout))
    seq, which, row, value = data.draw(poisons(layout))
    mode = MaskMode.MASK if impl == "flex" else data.draw(st.sampled_from([MaskMode.MASK, MaskMode.VARLEN]))
    clean = attend(q, k, v, layout, mode, impl, window=window)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if which == "k" else bad_v)[row] = value
    out = attend(q, bad_k, bad_v, layout, mode, impl, window=window)
    qs, ql, ks, kl = layout.q_starts[seq], layout.q_lens[seq], layout.kv_starts[seq], layout.kv_lens[seq]
    pos = torch.arange(kl - ql, kl)
    sees = (pos >= row - ks) & (pos - (row - ks) < window)
    hit = torch.zeros(layout.q_tokens, dtype=torch.bool)
    hit[qs:qs + ql] = sees
    assert out[hit].isnan().all()
    real = torch.zeros(layout.q_tokens, dtype=torch.bool)
    for s, n in zip(layout.q_starts, layout.q_lens):
        real[s:s + n] = True
    torch.testing.assert_close(out[real & ~hit], clean[real & ~hit])


@pytest.mark.inductor
def test_inductor_compiled_flex_matches_reference_and_isolates():
    from attnpolicy import AttnPolicyConfig, Dispatcher

    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="inductor", kernels={"mask": "flex"},
                                    max_seq_len=256))
    layout = BatchLayout.from_lens([30, 50, 20], [40, 50, 60], padded_to=110)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(110, 4, 16, generator=g)
    k, v = (torch.randn(layout.kv_tokens, 2, 16, generator=g) for _ in range(2))
    out = d.attend(q, k, v, layout)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=FP32_TOL, rtol=FP32_TOL)
    v[layout.kv_starts[1] + 49] = float("inf")  # the last key of sequence 1: only its last query sees it
    poisoned = d.attend(q, k, v, layout)
    assert poisoned[layout.q_starts[1] + 49].isnan().all()
    others = torch.ones(110, dtype=torch.bool)
    others[layout.q_starts[1] + 49] = False
    torch.testing.assert_close(poisoned[others], out[others])


def test_a_kernel_named_auto_is_rejected_at_registration(fresh_plugins):
    """``auto`` is the config's "fastest fit": a kernel of that name could never be chosen."""
    from attnpolicy.plugins.hookspecs import hookimpl
    from attnpolicy.plugins.kernels import KernelInfo, kernel_registry
    from attnpolicy.plugins.registry import get_plugin_manager
    from attnpolicy.policies.resolve import failed_plugins

    class Auto:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            register(KernelInfo("auto", "mask", attention))

    get_plugin_manager().register(Auto(), name="auto-kernel")
    assert ("mask", "auto") not in kernel_registry()
    assert "kernel name 'auto' is reserved" in failed_plugins()["auto-kernel"]


def test_small_mask_tensors_are_bounded_in_bytes():
    from attnpolicy.kernels.mask_cache import MaskCache

    cache = MaskCache(max_bytes=10_000, max_small_bytes=4_000)
    for n in range(1, 40):
        block = cache.small(("zeros", n), lambda n=n: torch.zeros(n, 25))  # 100·n bytes
        assert block.shape == (n, 25)
        stats = cache.stats()
        assert stats.small_bytes <= 4_000 and stats.max_small_bytes == 4_000
        assert stats.small_bytes == sum(t.nbytes for t in cache._small.entries.values())
    assert cache.stats().small_bytes > 3_000  # the most recent ones stay
    huge = cache.small("huge", lambda: torch.zeros(2_000))  # 8000 bytes: built, not kept
    assert huge.shape == (2_000,) and "huge" not in cache._small
    assert MaskCache(max_bytes=1_000).stats().max_small_bytes == 1_000  # never above max_bytes


_MASK_REQUESTS = st.lists(st.tuples(layouts(max_seqs=2, max_len=6, max_context=3, max_pad=2), st.integers(0, 2),
                                    st.integers(0, 2), st.one_of(st.none(), st.integers(1, 3))),
                          min_size=1, max_size=6)
_A, _B, _C = (BatchLayout.from_lens([n]) for n in (4, 5, 6))  # 16, 25 and 36 bytes


@settings(max_examples=100)
@given(distinct=_MASK_REQUESTS, picks=st.lists(st.integers(0, 5), min_size=1, max_size=24),
       bound=st.sampled_from([None, 40, 64, 100, 300]))
@example(distinct=[(_A, 0, 0, None), (_B, 0, 0, None), (_C, 0, 0, None)], picks=[0, 1, 0, 2, 0], bound=64)
@example(distinct=[(_A, 0, 0, None), (BatchLayout.from_lens([4], causal=False), 0, 0, None), (_A, 0, 0, 2)],
         picks=[0, 1, 2, 0], bound=None)
def test_the_mask_cache_keeps_each_layouts_own_mask_least_recently_used_first_out(distinct, picks, bound):
    """Against a least-recently-used list of the masks it returned, by their tensors' own
    bytes: a hit returns the kept mask (equal to a fresh one), a miss builds, the oldest
    go first until the new one fits, one larger than the bound is not kept."""
    from collections import OrderedDict

    from attnpolicy.kernels.mask_cache import MaskCache, mask_entry
    from attnpolicy.kernels.masks import layout_mask, mask_for

    cache = MaskCache(max_bytes=bound)
    kept: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # the reference, least recently used first
    hits = misses = evictions = uncached = peak = 0
    for pick in picks:
        layout, more_rows, more_cols, window = request = distinct[pick % len(distinct)]
        rows, cols = layout.q_tokens + more_rows, layout.kv_tokens + more_cols
        got = layout_mask(cache, layout, rows, cols, "cpu", window)
        assert torch.equal(got, mask_for(layout, window).materialize(rows, cols))
        if request in kept:
            assert got is kept[request]
            kept.move_to_end(request)
            hits += 1
        else:
            misses += 1
            if bound is not None and got.nbytes > bound:
                uncached += 1
            else:
                while bound is not None and sum(t.nbytes for t in kept.values()) + got.nbytes > bound:
                    kept.popitem(last=False)
                    evictions += 1
                kept[request] = got
                peak = max(peak, sum(t.nbytes for t in kept.values()))
        for seen in distinct:
            lay, r, c, w = seen
            assert (mask_entry(lay, lay.q_tokens + r, lay.kv_tokens + c, "cpu", w)[0] in cache) == (seen in kept)
        stats = cache.stats()
        assert (stats.masks, stats.bytes, stats.peak_bytes) == (len(kept), sum(t.nbytes for t in kept.values()), peak)
        assert (stats.hits, stats.misses, stats.evictions, stats.uncached) == (hits, misses, evictions, uncached)


def test_block_masks_are_bounded_in_bytes():
    from attnpolicy.kernels.flex import BlockMaskCache, block_mask_bytes, build_block_mask

    one = block_mask_bytes(build_block_mask(BatchLayout.from_lens([3, 5]), 128, 128))
    cache = BlockMaskCache(max_entries=64, max_bytes=3 * one)
    for n in range(1, 10):
        cache.get(BatchLayout.from_lens([n, 8]), 128, 128)
        assert cache.nbytes <= 3 * one
    assert len(cache) == 3 and cache.builds == 9
    small = BlockMaskCache(max_bytes=one - 1)  # a mask above the bound runs, uncached
    assert small.get(BatchLayout.from_lens([3, 5]), 128, 128) is not None
    assert len(small) == 0 and small.nbytes == 0


def _rss() -> int:
    """Resident bytes, after handing freed heap memory back (glibc's malloc_trim)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


RSS_SLACK = 32 * 2**20


def test_a_long_varied_mask_run_stays_within_the_mask_budgets():
    """200 varied MASK decode batches (8 heads of 128): what the masks hold stays
    within ``max_mask_bytes`` (dense) plus the small-tensor bound (at most
    ``max_mask_bytes``), and RSS grows by no more than those plus a fixed slack of
    32 MiB (plans, Python objects, allocator)."""
    import random

    from attnpolicy import AttnPolicyConfig, Dispatcher

    budget = 2**18
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=256, max_batch_tokens=1024,
                                    max_mask_bytes=budget, max_bytes=100_000_000))
    rnd = random.Random(0)

    def batch() -> None:
        kv = [rnd.randint(1, 200) for _ in range(rnd.randint(1, 4))]
        k = torch.randn(sum(kv), 8, 128)
        d.attend(torch.randn(len(kv), 8, 128), k, k, BatchLayout.from_lens([1] * len(kv), kv))

    for _ in range(5):
        batch()
    before = _rss()
    for _ in range(200):
        batch()
    grown = _rss() - before
    assert grown <= 2 * budget + RSS_SLACK, f"RSS grew by {grown / 2**20:.0f} MiB"
    masks = d.stats().masks
    assert masks.bytes <= budget and masks.small_bytes <= masks.max_small_bytes <= budget


def _register_kernel(name, fn, kind="varlen", **caps):
    from attnpolicy.plugins.hookspecs import hookimpl
    from attnpolicy.plugins.kernels import KernelInfo
    from attnpolicy.plugins.registry import get_plugin_manager

    class Plugin:
        @hookimpl
        def attnpolicy_register_kernels(self, register):
            register(KernelInfo(name, kind, fn, **caps))
    get_plugin_manager().register(Plugin(), name=f"{name}-plugin")


_SHAPE_BROKEN = ("one-head", "one-column", "float64", "int32", "extra-rows")


@pytest.mark.parametrize("backend", ["none", "eager"])
@pytest.mark.parametrize("broken", _SHAPE_BROKEN)
def test_a_plugin_kernels_wrong_output_is_an_error_naming_plugin_and_kernel(fresh_plugins, broken, backend):
    """Also when a batch runs several calls into one packed output: a wrong shape is
    never broadcast by the copy into a right-shaped wrong answer."""
    from plugin_kernels import BROKEN

    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import GraphCompileError, KernelError

    for kind in KERNEL_KINDS:
        _register_kernel(f"{broken}-{kind}", BROKEN[broken], kind)
    layout = BatchLayout.from_lens([3, 5, 4], [6, 5, 4])  # three VARLEN calls (context)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(12, 4, 8, generator=g), torch.randn(15, 4, 8, generator=g), torch.randn(15, 4, 8, generator=g)
    for kind in KERNEL_KINDS:
        d = Dispatcher(AttnPolicyConfig(policy="varlen", backend=backend, max_seq_len=16,
                                        kernels={f: f"{broken}-{f}" for f in KERNEL_KINDS}))
        with pytest.raises((KernelError, GraphCompileError)) as raised:
            d.attend(q, k, v, layout)
        assert f"kernel '{broken}-" in str(raised.value) and f"plugin '{broken}-" in str(raised.value)


@pytest.mark.parametrize(("backend", "on_error", "max_len", "raised", "violations"), [
    ("none", "raise", 16, "KernelError", 1),  # over the largest bucket: the uncompiled call is checked
    ("none", "raise", 64, "GraphCompileError", 1),  # checked on the example inputs: the compile fails
    ("eager", "raise", 64, "GraphCompileError", 1),  # checked while tracing: the compile fails
    ("eager", "eager", 64, "KernelError", 2),  # the compile fails (counted), then the uncompiled call
])
def test_kernel_violations_are_counted_in_the_stats(fresh_plugins, backend, on_error, max_len, raised,
                                                    violations):
    """A kernel that passes its (small) probe, then returns one head on longer calls."""
    from plugin_kernels import sdpa_kernel

    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import GraphCompileError, KernelError

    def long_broken(q, k, v, causal, mask, scale, partition_len):
        out = sdpa_kernel(q, k, v, causal, mask, scale, partition_len)
        return out[:1] if q.shape[1] > 16 else out

    _register_kernel("one-head", long_broken, "causal")
    layout = BatchLayout.from_lens([30])
    q, k, v = (torch.randn(30, 4, 8) for _ in range(3))
    d = Dispatcher(AttnPolicyConfig(policy="always-causal", backend=backend, max_seq_len=max_len,
                                    on_compile_error=on_error, on_overflow="eager", kernels={"causal": "one-head"}))
    for _ in range(2):
        with pytest.raises((KernelError, GraphCompileError)) as exc:
            d.attend(q, k, v, layout)
        assert type(exc.value).__name__ == raised and "'one-head' of plugin 'one-head-plugin'" in str(exc.value)
    stats = d.stats()
    assert stats.kernel_violations == 2 * violations
    assert stats.compile_error_fallbacks == (2 if on_error == "eager" else 0)


def test_a_failed_probe_is_a_counted_kernel_violation(fresh_plugins):
    from plugin_kernels import BROKEN

    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import KernelError

    _register_kernel("no-mask", BROKEN["no-mask"], "varlen")
    layout = BatchLayout.from_lens([3, 5], [6, 5])
    q, k, v = torch.randn(8, 4, 8), torch.randn(11, 4, 8), torch.randn(11, 4, 8)
    d = Dispatcher(AttnPolicyConfig(policy="varlen", max_seq_len=16, kernels={"varlen": "no-mask"}))
    with pytest.raises(KernelError, match="does not compute attention"):
        d.attend(q, k, v, layout)
    assert d.stats().kernel_violations == 1 and d.stats().batches == 0


@pytest.mark.parametrize(("broken", "caps", "case"), [
    ("kv-head-0", {}, "GQA 4:2"),
    ("no-mask", {}, "varlen family"),
])
def test_a_plugin_kernel_failing_a_declared_capability_is_rejected_with_the_case(fresh_plugins, broken, caps, case):
    from plugin_kernels import BROKEN

    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import KernelError

    _register_kernel(broken, BROKEN[broken], "varlen", **caps)
    layout = BatchLayout.from_lens([3, 5], [6, 5])  # cached context: VARLEN calls
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 4, 8, generator=g), torch.randn(11, 2, 8, generator=g), torch.randn(11, 2, 8, generator=g)
    d = Dispatcher(AttnPolicyConfig(policy="varlen", max_seq_len=16, kernels={"varlen": broken}))
    with pytest.raises(KernelError, match=f"kernel '{broken}' of plugin '{broken}-plugin' does not compute "
                                          f"attention for .*{case}"):
        d.attend(q, k, v, layout)


def test_check_kernel_passes_a_correct_plugin_kernel_and_names_a_broken_ones_case(fresh_plugins):
    from plugin_kernels import BROKEN, sdpa_kernel

    from attnpolicy.errors import KernelError, PluginError
    from attnpolicy.plugins.kernels import check_kernel

    _register_kernel("good", sdpa_kernel, "mask")
    cases = check_kernel("good")
    assert any("GQA" in c for c in cases) and any("with cached context" in c for c in cases)
    _register_kernel("maskless", BROKEN["no-mask"], "mask")
    with pytest.raises(KernelError, match="'maskless' of plugin 'maskless-plugin' does not compute attention for "
                                          "mask family"):
        check_kernel("maskless")
    with pytest.raises(PluginError, match="no kernel named 'nope'"):
        check_kernel("nope")


def _rows_kernel(q, k, v, causal, mask, scale, partition_len):
    """A correct plugin kernel of the rows kind: ``[R, H, L, D]``, a per-row mask ``[R, Lq, Lk]``."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else mask[:, None], is_causal=causal and mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])


def test_a_rows_plugin_kernel_declares_the_rows_kind_and_is_checked_per_row(fresh_plugins):
    """A rows kernel is verified on two right-padded rows of different lengths: one that
    applies the first row's bounds to every row is rejected, naming the rows case."""
    from attnpolicy import AttnPolicyConfig, Dispatcher
    from attnpolicy.errors import KernelError
    from attnpolicy.plugins.kernels import check_kernel

    _register_kernel("good-rows", _rows_kernel, "rows")
    cases = check_kernel("good-rows")
    assert all(c.startswith("rows family") for c in cases) and any("with cached context" in c for c in cases)
    layout = BatchLayout.from_lens([3, 5], [6, 5])
    q, k, v = torch.randn(8, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    d = Dispatcher(AttnPolicyConfig(policy="always-rows", backend="none", max_seq_len=16, kernels={"rows": "good-rows"}))
    torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
    _register_kernel("row-0-bounds", lambda q, k, v, c, m, s, p: _rows_kernel(
        q, k, v, c, None if m is None else m[:1].expand_as(m), s, p), "rows")
    with pytest.raises(KernelError, match="'row-0-bounds' of plugin 'row-0-bounds-plugin' does not compute "
                                          "attention for rows family"):
        check_kernel("row-0-bounds")


@pytest.mark.parametrize("name", ["sdpa", "eager", "flash", "flex"])
def test_every_builtin_kernel_passes_the_public_check(name):
    """Conformance: what plugin authors run on their kernels holds for the built-ins."""
    from attnpolicy.plugins.kernels import check_kernel

    cases = check_kernel(name)
    assert len(cases) >= 8  # every dtype × causality × context × GQA it declares


def test_the_kernels_check_command(capsys):
    from attnpolicy.cli import main

    assert main(["kernels", "check", "flash"]) == 0
    out = capsys.readouterr().out
    assert "ok  mask family, causal, with cached context, GQA 4:2, float32, cpu" in out
    assert main(["kernels", "check", "nope"]) == 2
    assert "no kernel named 'nope'" in capsys.readouterr().err
