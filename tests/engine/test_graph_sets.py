"""Graph sets served by the runner: a key warmed on the layout that fills it
(``keys.filling``, ``warmup_keys``), a step served as a runtime's parts (``serve``)
under strict mode, each runtime's parts of a mixed step, and whole requests through
vllm-gaudi's and vllm-rbln's sets checked against HF ``generate``."""

from __future__ import annotations

import warnings
from itertools import islice

import pytest
import torch
from cost_models import of_model, with_rows, with_steps
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_static_model import TINY, config
from test_step_graphs import serve, whole

from attnpolicy.bench.replay import MODEL_TOLERANCE, RequestReplay, replay
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey, Part, contexts, filling
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import ModelSpec, parse_spec
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.errors import ConfigError, LayoutError, StrictModeError
from attnpolicy.modelling.peer_buckets import PeerGraph, PeerLimits, PeerWarmSet
from attnpolicy.modelling.runtime_sets import RuntimeGraphSet, scheme_set
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

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


def rbln() -> RuntimeGraphSet:
    peer, warm = scheme_set("rbln", LIMITS)
    return RuntimeGraphSet("rbln", peer, warm, LIMITS, BACKEND)


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
    for i, (seq, c) in enumerate(zip(seqs, contexts(layout))):
        got = out[layout.q_starts[i]:layout.q_starts[i] + layout.q_lens[i]]
        torch.testing.assert_close(got, whole(reference, seq)[c:], rtol=0, atol=1e-5,
                                   msg=f"sequence {i} of {layout.describe()}")


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


@pytest.mark.parametrize("strict", ["raise", "warn"])
def test_a_warmed_set_serves_its_steps_with_no_compile_and_a_step_it_cannot_is_a_violation(models, strict):
    model, reference = models
    graphs = covering()
    runner = StaticModelRunner(model, config(strict=strict))
    assert runner.warmup_keys(graphs.keys) == list(graphs.keys)
    assert set(runner.cache.keys()) == set(graphs.keys) and runner.stats().cache.compiles == len(graphs.keys) == 2
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 14, 20)]
    # two prompts alone on the prefill graph, their decodes together on the decode graph (one padded up),
    # then a prompt of 20 tokens: longer than every prefill graph's 16
    steps = serve(runner, seqs, [[9, 12, 0], [1, 1, 0], [1, 0, 0], [0, 0, 20]], graphs=graphs)

    def check(rows) -> None:
        for i, (at, got) in rows.items():
            torch.testing.assert_close(got, whole(reference, seqs[i])[at:at + got.shape[0]], rtol=0, atol=1e-5)
    for rows in islice(steps, 3):
        check(rows)
    stats = runner.stats()
    assert (stats.cache.compiles, stats.strict_violations) == (2, 0)
    assert stats.modes == {"rows": 2, "mask": 2} and (stats.forward_hits, stats.forward_misses) == (4, 0)
    if strict == "raise":
        with pytest.raises(StrictModeError, match="step/rows/r1t20c0/aot_eager compiled after warm-up"):
            next(steps)
        assert runner.stats().cache.compiles == 2
    else:
        with pytest.warns(RuntimeWarning, match="step/rows/r1t20c0/aot_eager compiled after warm-up"):
            check(next(steps))
        stats = runner.stats()
        assert (stats.cache.compiles, stats.strict_violations, stats.forward_misses) == (3, 1, 1)
        assert ModelKey(MaskMode.ROWS, 20, 0, ((20, 0),), BACKEND, kv=True) in runner.cache.keys()


def test_a_step_one_of_whose_graphs_strict_mode_refuses_changes_no_slot(models):
    """Every part's graph is fetched before any part runs: a decode the set serves beside a
    prompt it does not raises under strict "raise" with neither slot extended."""
    model, _ = models
    graphs = covering()
    runner = StaticModelRunner(model, config(strict="raise"))
    runner.warmup_keys(graphs.keys)
    kv = KVCache.for_model(model, 2, 64, lengths=[5, 0])
    layout = BatchLayout.from_lens([1, 20], [6, 20], causal=True)  # a decode over 5, a prompt of 20
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(3))
    with pytest.raises(StrictModeError, match="step/rows/r1t20c0"):
        runner.serve(ids, layout, graphs, kv=kv, slots=[0, 1])
    assert [kv.length(0), kv.length(1)] == [5, 0]
    assert runner.stats().cache.compiles == len(graphs.keys)


class Parts:
    """A graph set that gives fixed parts, right or wrong."""

    name = "fixed parts"

    def __init__(self, *parts: Part) -> None:
        self.keys = tuple(key for *_, key in parts)
        self._parts = parts

    def parts(self, layout: BatchLayout) -> tuple[Part, ...]:
        return self._parts


ROWS2 = ModelKey(MaskMode.ROWS, 2 * 16, 2 * 16, ((16, 16),) * 2, BACKEND, kv=True)


@pytest.mark.parametrize(("graphs", "error"), [
    (OneKey(ModelKey(MaskMode.ROWS, 16, 16, ((16, 16),), BACKEND, kv=True)),
     "cannot hold .*2 rows of at most 12 tokens over 4 context, the graph 1 of 16 over 16"),
    (OneKey(ModelKey(MaskMode.ROWS, 2 * 8, 2 * 16, ((8, 16),) * 2, BACKEND, kv=True)), "the graph 2 of 8 over 16"),
    (OneKey(ModelKey(MaskMode.ROWS, 2 * 16, 2 * 2, ((16, 2),) * 2, BACKEND, kv=True)), "the graph 2 of 16 over 2"),
    (OneKey(ModelKey(MaskMode.MASK, 16, 32, ((16, 32),), BACKEND, kv=True)), "17 rows over 7 context, the graph 16"),
    (OneKey(ModelKey(MaskMode.MASK, 32, 4, ((32, 4),), BACKEND, kv=True)), "17 rows over 7 context, the graph 32 over 4"),
    (Parts((0, 1, ROWS2)), r"gave parts \[\(0, 1\)\], not the 2 sequences"),
    (Parts((0, 1, ROWS2), (0, 2, ROWS2)), r"gave parts \[\(0, 1\), \(0, 2\)\]"),
])
def test_a_part_no_graph_can_hold_is_refused_before_any_work(models, graphs, error):
    """A graph set's key that cannot hold its part (a row, a length, a context too small),
    or parts that do not cover the step's sequences once in order, raise LayoutError before
    anything compiles or any slot changes."""
    model, _ = models
    runner = StaticModelRunner(model, config())
    kv = KVCache.for_model(model, 2, 64, lengths=[3, 4])
    layout = BatchLayout.from_lens([5, 12], [8, 16], causal=True)
    with pytest.raises(LayoutError, match=error):
        runner.serve(torch.zeros(17, dtype=torch.long), layout, graphs, kv=kv, slots=[0, 1])
    assert runner.stats().cache.compiles == 0 and [kv.length(0), kv.length(1)] == [3, 4]
    assert runner.stats().batches == 0


def test_a_ragged_set_does_not_run_here_even_empty():
    """The ragged form is refused by its runtime, not only by its graphs: a plan's ragged
    form the budget left empty is still ragged."""
    for warm in (PeerWarmSet.of("plan", []), PeerWarmSet.of("tpu", [PeerGraph("mixed", 2, 32)])):
        with pytest.raises(ConfigError, match="does not run here: its graphs are ragged"):
            RuntimeGraphSet("plan (ragged form)", "tpu", warm, LIMITS, BACKEND)


# -- a step's parts in each runtime's form ----------------------------------------------------

#: two decodes (contexts 19 and 8: 2 + 1 blocks of their 20 and 9 keys), then a prompt of 12
#: and a chunk of 20 over 16 cached (1 block)
MIXED = BatchLayout.from_lens([1, 1, 12, 20], [20, 9, 12, 36], causal=True)


def test_gaudi_runs_each_prompt_alone_on_a_rows_graph_and_the_decodes_together_on_a_mask_graph():
    """Each forward on the first graph in order that holds it: the decodes (2 sequences,
    3 blocks) on (2, 4 blocks) as MASK rows 2 over 64 columns, not the earlier (2, 2
    blocks) nor the later (4, 8 blocks); each prompt on a rows graph of one row, its
    query padded to the graph's, its context to the graph's blocks."""
    graphs = gaudi(PeerGraph("decode", 2, 1, 2), PeerGraph("decode", 2, 1, 4), PeerGraph("decode", 4, 1, 8),
                   PeerGraph("prefill", 1, 16, 0), PeerGraph("prefill", 1, 16, 2), PeerGraph("prefill", 1, 32, 1))
    parts = graphs.parts(MIXED)
    assert [p[:2] for p in parts] == [(0, 2), (2, 3), (3, 4)]
    assert [key for _, _, key in parts] == [
        ModelKey(MaskMode.MASK, 2, 64, ((2, 64),), BACKEND, kv=True),
        ModelKey(MaskMode.ROWS, 16, 0, ((16, 0),), BACKEND, kv=True),
        ModelKey(MaskMode.ROWS, 32, 16, ((32, 16),), BACKEND, kv=True)]
    assert all(key in graphs.keys for _, _, key in parts)
    # without a prompt graph of 32 the chunk of 20 runs on a graph of its own shape
    own = gaudi(*(g for g in graphs.warm.graphs if g.query_tokens != 32)).parts(MIXED)
    assert own[:2] == parts[:2] and own[2] == (3, 4, ModelKey(MaskMode.ROWS, 20, 16, ((20, 16),), BACKEND, kv=True))
    assert own[2][2] not in graphs.keys


def test_rbln_runs_each_prompt_alone_and_the_decodes_together_on_rows_graphs_over_the_whole_length():
    graphs = rbln()
    parts = graphs.parts(MIXED)
    assert [p[:2] for p in parts] == [(0, 2), (2, 3), (3, 4)]
    whole = LIMITS.max_model_len
    prompt = ModelKey(MaskMode.ROWS, 32, whole, ((32, whole),), BACKEND, kv=True)
    assert [key for _, _, key in parts] == [
        ModelKey(MaskMode.ROWS, 2, 2 * whole, ((1, whole),) * 2, BACKEND, kv=True), prompt, prompt]
    assert set(graphs.keys) == {key for _, _, key in parts}
    # a set whose decode graph takes one sequence: the two decodes run on a graph of their own batch
    one = RuntimeGraphSet("one decode", "rbln", PeerWarmSet.of("one decode", (
        PeerGraph("decode", 1, 1), PeerGraph("prefill", 1, 32))), LIMITS, BACKEND)
    assert one.parts(MIXED) == parts and parts[0][2] not in one.keys


# -- whole requests through a set --------------------------------------------------------------

REQUESTS = [Request(0.0, 40, 5), Request(0.0, 9, 6), Request(0.0, 30, 4)]
#: a chunk of 8 over 32 cached (2 blocks), decodes over up to 4 blocks, a step of a decode and a prompt
STEPS = list(BatchFormer(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64).steps(REQUESTS))
GAUDI = (PeerGraph("decode", 2, 1, 8), PeerGraph("prefill", 1, 16, 3), PeerGraph("prefill", 1, 32, 3))


@pytest.mark.parametrize(("graphs", "strict", "late"), [
    (gaudi(*GAUDI), "raise", 0), (rbln(), "raise", 0),
    # no prompt graph of 32: the prompts of 32 and 30 tokens each compile their own at run time
    (gaudi(*GAUDI[:2]), "warn", 2)], ids=["gaudi", "rbln", "gaudi-without-its-largest-prompt-graph"])
def test_whole_requests_through_a_set_equal_generate_and_its_model(graphs, strict, late):
    assert any(len(s.layout.q_lens) > 1 and s.layout.q_lens[0] == 1 < s.layout.q_lens[1] for s in STEPS)
    cost = of_model(with_rows(with_steps()), SPEC)
    level = RequestReplay(SPEC, REQUESTS, STEPS, config(strict=strict), check=True, cost=cost, graphs=graphs)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = replay(level)
    assert len([w for w in warned if "compiled after warm-up" in str(w.message)]) == late
    assert result.token_mismatches == 0 and result.non_finite == 0 and result.passed
    assert result.max_abs_err is not None and result.max_abs_err <= MODEL_TOLERANCE
    figure = result.figures["graph_set"]
    measured, modelled = figure["measured"], figure["modelled"]
    assert (figure["name"], figure["peer"]) == (graphs.name, graphs.peer)
    assert measured["graphs"] == modelled["graphs"] == len(graphs.keys)
    assert measured["runtime_compiles"] == modelled["runtime_compiles"] == measured["strict_violations"] == late
    assert result.figures["compiles"] == len(graphs.keys) + late  # the warm-up compiled the set, nothing else
    assert measured["padding"] == modelled["padding"] > 0
    assert result.batches == len(STEPS) and result.figures["requests"] == len(REQUESTS)
