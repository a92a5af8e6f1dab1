"""The acceptance fuzz test: every policy × impl × backend (parametrized, so each
combination runs) against the float64 reference, with hypothesis drawing the
layouts (cached context, bidirectional, padding rows), the dtype (fp32, bf16) and
the garbage: NaN, ±inf, large finite values (up to the dtype's max) or random bit
patterns (an uninitialised buffer) in the padding rows and in rows of the *other*
sequences. The chosen sequence's output is the clean run's, bit for bit, finite,
and matches the reference.

Compiles are the slow part, so one graph cache serves every dispatcher of an
(impl, backend) pair (graph keys do not depend on the policy) and lengths stay
within two buckets: at most a few dozen compiles in all.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, GraphCache
from attnpolicy.core.names import IMPLS
from attnpolicy.graphs.compile import release_graph
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.plugins.registry import policy_registry

BACKENDS = ("none", "eager", "aot_eager")
POLICIES = ("always-causal", "always-mask", "cost-aware", "dynamic", "varlen")
BAD = (float("nan"), float("inf"), float("-inf"))
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

_caches: dict[tuple[str, str], GraphCache] = {}
_dispatchers: dict[tuple[str, str, str], Dispatcher] = {}


def _dispatcher(policy: str, impl: str, backend: str) -> Dispatcher:
    key = (policy, impl, backend)
    if key not in _dispatchers:
        config = AttnPolicyConfig(policy=policy, attn_impl=impl, backend=backend, max_seq_len=64,
                                  partition_len=16 if impl == "flash" else None, max_batch_tokens=256,
                                  buckets={"kind": "list", "sizes": [64, 256]})
        cache = _caches.setdefault((impl, backend), GraphCache.from_config(
            config, sizeof=graph_bytes, release=lambda k, graph: release_graph(graph)))
        _dispatchers[key] = Dispatcher(config, cache=cache)
    return _dispatchers[key]


def _run(d: Dispatcher, qkv, layout: BatchLayout) -> tuple[torch.Tensor, str]:
    """The output of one batch and the mode that ran it."""
    before = d.stats().modes
    out = d.attend(*qkv, layout)
    (mode,) = (m for m, n in d.stats().modes.items() if n != before[m])
    return out, mode


def _layouts():
    """2–4 sequences of at most 64 tokens (context included)."""
    return layouts(min_seqs=2, max_seqs=4, max_len=40, max_context=24, max_pad=16)


def _padding(starts, lens, tokens):
    real = torch.zeros(tokens, dtype=torch.bool)
    for s, n in zip(starts, lens):
        real[s:s + n] = True
    return ~real


def test_the_fuzz_covers_every_registered_policy(fresh_plugins):
    assert set(POLICIES) == set(policy_registry())


@st.composite
def garbage(draw, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What a row a sequence does not own may hold: NaN or ±inf, a large finite value
    (up to the dtype's max, either sign), or random bits (every pattern of the dtype)."""
    kind = draw(st.sampled_from(["non-finite", "large", "bits"]))
    if kind == "bits":
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        ints = torch.int16 if dtype.itemsize == 2 else torch.int32
        low = torch.iinfo(ints).min
        return torch.randint(low, -low, shape, dtype=ints, generator=g).view(dtype)
    if kind == "large":
        value = torch.finfo(dtype).max * 2.0 ** -draw(st.integers(0, 100)) * draw(st.sampled_from([1, -1]))
    else:
        value = draw(st.sampled_from(BAD))
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=3, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_sequence_is_exact_and_untouched_by_its_neighbours(data, policy, impl, backend, dtype):
    layout = data.draw(_layouts())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(layout.q_tokens, 4, 8, generator=g).to(dtype)  # GQA: 4 query heads, 2 kv heads
    k, v = (torch.randn(layout.kv_tokens, 2, 8, generator=g).to(dtype) for _ in range(2))
    pads = (_padding(layout.q_starts, layout.q_lens, layout.q_tokens),
            _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens),
            _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens))
    for t, pad in zip((q, k, v), pads):
        t[pad] = data.draw(garbage(t[pad].shape, dtype))  # an uninitialised buffer's garbage
    d = _dispatcher(policy, impl, backend)
    clean, clean_mode = _run(d, (q, k, v), layout)

    me = data.draw(st.integers(0, layout.num_seqs - 1))
    dirty = [t.clone() for t in (q, k, v)]
    for i in range(layout.num_seqs):
        if i == me:
            continue
        which = data.draw(st.integers(0, 2))
        starts, lens = (layout.q_starts, layout.q_lens) if which == 0 else (layout.kv_starts, layout.kv_lens)
        row = starts[i] + data.draw(st.integers(0, lens[i] - 1))
        if data.draw(st.booleans()):  # one element, or the whole row
            dirty[which][row] = data.draw(garbage(dirty[which][row].shape, dtype))
        else:
            head = data.draw(st.integers(0, dirty[which].shape[1] - 1))
            dirty[which][row, head, 0] = data.draw(garbage((), dtype))
    out, mode = _run(d, dirty, layout)

    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    tol = TOL[dtype]
    assert torch.isfinite(out[rows]).all()
    if mode == clean_mode:
        assert torch.equal(out[rows], clean[rows])
    else:  # cost-aware may decide the same layout differently the second time
        torch.testing.assert_close(out[rows], clean[rows], atol=tol, rtol=tol)
    real = [t.masked_fill(pad[:, None, None], 0) for t, pad in zip((q, k, v), pads)]  # padding is never read
    torch.testing.assert_close(out[rows].double(), reference_for(*real, layout)[rows], atol=tol, rtol=tol)


#: Features the fuzz draws from: few distinct values, so graphs are shared across examples.
WINDOWS, SOFTCAPS = (None, 5, 17), (None, 2.0)


@pytest.mark.parametrize(("impl", "backend"), [("sdpa", "none"), ("eager", "none"), ("flash", "none"),
                                               ("sdpa", "aot_eager")])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_windows_caps_and_sinks_are_exact_and_isolated(data, policy, impl, backend):
    """The same contract under a sliding window, a soft cap and sinks (fp32)."""
    layout = data.draw(_layouts())
    window, softcap = data.draw(st.sampled_from(WINDOWS)), data.draw(st.sampled_from(SOFTCAPS))
    sinks = data.draw(st.sampled_from([None, torch.tensor([0.5, -1.0, 2.0, 0.0])]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(layout.q_tokens, 4, 8, generator=g)
    k, v = (torch.randn(layout.kv_tokens, 2, 8, generator=g) for _ in range(2))
    d = _dispatcher(policy, impl, backend)
    feats = dict(window=window, softcap=softcap, sinks=sinks)
    clean = d.attend(q, k, v, layout, **feats)
    me = data.draw(st.integers(0, layout.num_seqs - 1))
    dirty = [t.clone() for t in (q, k, v)]
    for i in range(layout.num_seqs):
        if i != me:
            which = data.draw(st.integers(0, 2))
            starts, lens = (layout.q_starts, layout.q_lens) if which == 0 else (layout.kv_starts, layout.kv_lens)
            dirty[which][starts[i] + data.draw(st.integers(0, lens[i] - 1))] = data.draw(st.sampled_from(BAD))
    out = d.attend(*dirty, layout, **feats)
    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows], clean[rows], atol=1e-6, rtol=1e-6)
    want = reference_for(q, k, v, layout, **feats)
    torch.testing.assert_close(clean[rows].double(), want[rows], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _free_graphs():
    yield
    for cache in _caches.values():
        cache.clear()
    _dispatchers.clear()
    _caches.clear()
