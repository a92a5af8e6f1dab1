"""The acceptance fuzz test: every policy × impl × backend against the float64
reference, with random layouts (garbage in padding rows, cached context,
bidirectional, GQA, fp32 and bf16) and NaN / ±inf injected into the *other*
sequences: the chosen sequence's output is the clean run's, bit for bit, finite,
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


def test_the_fuzz_covers_every_registered_policy():
    assert set(POLICIES) == set(policy_registry())


@settings(max_examples=150, deadline=None)
@given(data=st.data(), policy=st.sampled_from(POLICIES), impl=st.sampled_from(IMPLS),
       backend=st.sampled_from(BACKENDS), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_sequence_is_exact_and_untouched_by_its_neighbours(data, policy, impl, backend, dtype):
    layout = data.draw(_layouts())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(layout.q_tokens, 4, 8, generator=g).to(dtype)  # GQA: 4 query heads, 2 kv heads
    k, v = (torch.randn(layout.kv_tokens, 2, 8, generator=g).to(dtype) for _ in range(2))
    for t, pad in ((q, _padding(layout.q_starts, layout.q_lens, layout.q_tokens)),
                   (k, _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens)),
                   (v, _padding(layout.kv_starts, layout.kv_lens, layout.kv_tokens))):
        t[pad] = data.draw(st.sampled_from(BAD))  # an uninitialised buffer's garbage
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
        dirty[which][row, data.draw(st.integers(0, dirty[which].shape[1] - 1)), 0] = data.draw(st.sampled_from(BAD))
    out, mode = _run(d, dirty, layout)

    rows = slice(layout.q_starts[me], layout.q_starts[me] + layout.q_lens[me])
    tol = TOL[dtype]
    assert torch.isfinite(out[rows]).all()
    if mode == clean_mode:
        assert torch.equal(out[rows], clean[rows])
    else:  # cost-aware may decide the same layout differently the second time
        torch.testing.assert_close(out[rows], clean[rows], atol=tol, rtol=tol)
    finite = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]  # padding garbage is never read
    torch.testing.assert_close(out[rows].double(), reference_for(*finite, layout)[rows], atol=tol, rtol=tol)


@pytest.fixture(scope="module", autouse=True)
def _free_graphs():
    yield
    for cache in _caches.values():
        cache.clear()
    _dispatchers.clear()
    _caches.clear()
