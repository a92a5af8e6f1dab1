"""Graph sets served by the runner: a key warmed on the layout that fills it
(``keys.filling``, ``warmup_keys``), a step served as a runtime's parts (``serve``)
under strict mode, each runtime's parts of a mixed step, and whole requests through
vllm-gaudi's and vllm-rbln's sets checked against HF ``generate``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_static_model import TINY, config

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey, Part, contexts, filling
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import ModelSpec, parse_spec
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.modelling.peer_buckets import PeerGraph, PeerLimits, PeerWarmSet
from attnpolicy.modelling.runtime_sets import RuntimeGraphSet

SPEC = TINY["qwen3"]
BACKEND = "aot_eager"  # test_static_model's config
VOCAB = 64
#: small limits: blocks of 16, so a gaudi set's graphs stay few and small
LIMITS = PeerLimits(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=16)


@pytest.fixture(scope="module")
def models():
    """(runner model, reference model): two builds of one spec, so equal weights."""
    spec = parse_spec(SPEC)
    assert isinstance(spec, ModelSpec)
    return spec.build(), spec.build()


def gaudi(*graphs: PeerGraph) -> RuntimeGraphSet:
    return RuntimeGraphSet("hand-made", "gaudi", PeerWarmSet.of("hand-made", graphs), LIMITS, BACKEND)


class OneKey:
    """A graph set of one key that serves any step as one forward."""

    name = "one key"

    def __init__(self, key: ModelKey) -> None:
        self.keys = (key,)

    def parts(self, layout: BatchLayout) -> tuple[Part, ...]:
        return ((0, layout.num_seqs, self.keys[0]),)


def span():
    return st.tuples(st.integers(1, 12), st.integers(0, 20))


@st.composite
def keys(draw) -> ModelKey:
    """A step key of ROWS, MASK or VARLEN off any bucket grid (VARLEN's segments in any order)."""
    mode = draw(st.sampled_from([MaskMode.ROWS, MaskMode.MASK, MaskMode.VARLEN]))
    if mode is MaskMode.ROWS:
        segments = (draw(span()),) * draw(st.integers(1, 3))
    elif mode is MaskMode.MASK:
        segments = (draw(span()),)
    else:
        segments = tuple(draw(st.lists(span(), min_size=1, max_size=3)))
    return ModelKey(mode, sum(t for t, _ in segments), sum(c for _, c in segments), segments, BACKEND, kv=True)


@settings(max_examples=50)
@given(key=keys())
def test_filling_lays_out_every_row_and_context_column_of_a_key(key):
    layout = filling(key)
    assert layout.causal and layout.q_tokens == key.tokens and sum(contexts(layout)) == key.context
    assert list(zip(layout.q_lens, contexts(layout))) == list(key.segments)  # MASK: one of all its rows


def real_step(reference, layout: BatchLayout, seed: int) -> tuple[list[list[int]], KVCache, torch.Tensor]:
    """Random sequences of ``layout``'s lengths, a KV cache holding each one's context (the
    reference model's keys and values) and the step's token ids."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in layout.kv_lens]
    ctx = contexts(layout)
    kv = KVCache.for_model(reference, layout.num_seqs, max(layout.kv_lens), lengths=list(ctx))
    with torch.no_grad():
        for slot, (seq, c) in enumerate(zip(seqs, ctx)):
            if c:
                past = reference(input_ids=torch.tensor([seq[:c]]), use_cache=True).past_key_values
                for layer, cached in enumerate(past.layers):
                    kv.k[layer, slot, :, :c] = cached.keys[0]
                    kv.v[layer, slot, :, :c] = cached.values[0]
    return seqs, kv, torch.tensor([t for seq, c in zip(seqs, ctx) for t in seq[c:]])


def assert_rows_equal_the_reference(reference, seqs, layout: BatchLayout, out: torch.Tensor) -> None:
    with torch.no_grad():
        for i, (seq, c) in enumerate(zip(seqs, contexts(layout))):
            want = reference(input_ids=torch.tensor([seq]), use_cache=False).logits[0, c:]
            got = out[layout.q_starts[i]:layout.q_starts[i] + layout.q_lens[i]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"sequence {i} of {layout.describe()}")


#: a VARLEN key whose segments the config's buckets order the other way: (2, 8) is (16, 16) in
#: buckets, (7, 17) is (16, 32)
OFF_GRID = ModelKey(MaskMode.VARLEN, 9, 25, ((2, 8), (7, 17)), BACKEND, kv=True)


@settings(max_examples=6)
@given(key=keys(), seed=st.integers(0, 2**16))
@example(key=OFF_GRID, seed=0)
def test_a_key_warmed_on_its_filling_serves_that_step_exactly(models, key, seed):
    """``warmup_keys`` compiles the key itself (not ``model_key_for``'s key of its layout,
    which is on the config's buckets), and the filling step runs on it, every row right
    (VARLEN: each sequence in its own segment, whatever the config's buckets order)."""
    model, reference = models
    runner = StaticModelRunner(model, config(strict="raise"))
    assert runner.warmup_keys([key]) == [key]
    assert list(runner.cache.keys()) == [key] and runner.stats().cache.compiles == 1
    layout = filling(key)
    seqs, kv, ids = real_step(reference, layout, seed)
    out = runner.serve(ids, layout, OneKey(key), kv=kv, slots=range(layout.num_seqs))
    assert_rows_equal_the_reference(reference, seqs, layout, out)
    assert runner.stats().cache.compiles == 1 and runner.stats().strict_violations == 0
    assert [kv.length(s) for s in range(layout.num_seqs)] == list(layout.kv_lens)


def test_a_second_warm_up_compiles_without_a_strict_violation(models):
    """Strict mode governs what runs after a warm-up, not the warm-up's own compiles: a
    second warm-up (a set warmed in two calls) compiles its new keys without raising."""
    model, _ = models
    keys = covering().keys
    runner = StaticModelRunner(model, config(strict="raise"))
    runner.warmup_keys(keys[:1])
    assert runner.warmup_keys(keys) == list(keys)
    stats = runner.stats()
    assert stats.cache.compiles == len(keys) and stats.strict_violations == 0


def covering() -> RuntimeGraphSet:
    """vllm-gaudi's form: decodes of up to 2 sequences over up to 4 blocks of 16 in all,
    prompts of up to 16 tokens over up to 2 blocks of context."""
    return gaudi(PeerGraph("decode", 2, 1, 4), PeerGraph("prefill", 1, 16, 2))
