"""Bucket planning: the program is exact on square shapes, a bound otherwise, and the
local search only ever improves the exact modelled time."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import GraphFamily, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.planning.bucket_search import CallShapes, candidates, evaluate, plan_sizes


def model(backend: str = "aot_eager") -> CostModel:
    """A synthetic cost model: run grows with cells and tokens, compiles cost a lot."""
    run = {k: Fit(base=1e-4, per_cell=1e-8 * (1 + i), per_token=1e-6) for i, k in enumerate(("causal", "mask", "varlen"))}
    comp = {k: Fit(base=0.05, per_cell=1e-9, per_token=1e-6) for k in ("causal", "mask", "varlen")}
    return CostModel(run=run, compile=comp, mask_build=Fit(), backend=backend, call_overhead_seconds=1e-6)


def brute_force(shapes: CallShapes, cand, k: int, m: CostModel) -> float:
    top = int(cand[-1])
    best = float("inf")
    for rest in itertools.combinations([int(c) for c in cand[:-1]], k - 1):
        best = min(best, evaluate(shapes, (*rest, top), m).total_seconds)
    return best


square_shapes = st.dictionaries(
    st.tuples(st.sampled_from([GraphFamily.CAUSAL, GraphFamily.MASK]), st.integers(1, 200)).map(lambda t: (t[0], t[1], t[1])),
    st.integers(1, 50), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(square_shapes, st.integers(1, 4), st.sampled_from(["aot_eager", "none"]))
def test_program_is_exact_on_square_shapes(raw, k, backend):
    m = model(backend)
    shapes = CallShapes.of(Counter(raw))
    cand = candidates(shapes, 16)
    plans = {p.buckets: p for p in plan_sizes(shapes, m, k)}
    if k not in plans:
        assert k > len(cand)
        return
    plan = plans[k]
    optimum = brute_force(shapes, cand, k, m)
    assert plan.cost.total_seconds == pytest.approx(optimum, rel=1e-9)
    assert plan.lower_bound == pytest.approx(optimum, rel=1e-9)


rect_shapes = st.dictionaries(
    st.tuples(st.sampled_from(list(GraphFamily)), st.integers(1, 100), st.integers(0, 150)).map(
        lambda t: (t[0], t[1], t[1] + t[2])),
    st.integers(1, 20), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(rect_shapes, st.integers(1, 3))
def test_bound_and_result_bracket_the_optimum(raw, k):
    m = model()
    shapes = CallShapes.of(Counter(raw))
    cand = candidates(shapes, 16)
    for plan in plan_sizes(shapes, m, k):
        optimum = brute_force(shapes, cand, plan.buckets, m)
        assert plan.lower_bound <= optimum * (1 + 1e-9)
        assert plan.cost.total_seconds >= optimum * (1 - 1e-9)
        assert plan.cost.sizes[-1] == shapes.max_len
        assert len(plan.cost.sizes) == plan.buckets


def test_evaluate_counts_padding_graphs_and_seconds():
    m = model()
    shapes = CallShapes.of(Counter({(GraphFamily.CAUSAL, 10, 10): 3, (GraphFamily.VARLEN, 1, 40): 2}))
    cost = evaluate(shapes, (16, 64), m)
    run_c = m.run["causal"](16, 16) * 3
    run_v = m.run["varlen"](16, 64) * 2
    assert cost.run_seconds == pytest.approx(run_c + run_v + 5 * m.call_overhead_seconds)
    assert cost.compile_seconds == pytest.approx(m.compile["causal"](16, 16) + m.compile["varlen"](16, 64))
    assert cost.graphs == 2
    assert cost.padded_tokens == 3 * 6 + 2 * 15


def test_shapes_from_layouts_follow_the_plan():
    packed = BatchLayout.from_lens([5, 7])
    decode = BatchLayout.from_lens([1, 1], [9, 30])
    shapes = CallShapes.from_layouts([(packed, MaskMode.VARLEN), (packed, MaskMode.MASK), (decode, MaskMode.VARLEN)])
    got = Counter({(int(f), int(q), int(kv)): int(n) for f, q, kv, n in zip(shapes.family, shapes.q, shapes.kv, shapes.count, strict=True)})
    assert got == Counter({(0, 5, 5): 1, (0, 7, 7): 1, (1, 12, 12): 1, (2, 1, 9): 1, (2, 1, 30): 1})


def test_errors_name_the_value():
    with pytest.raises(ConfigError, match="empty workload"):
        CallShapes.of(Counter())
    shapes = CallShapes.of(Counter({(GraphFamily.CAUSAL, 100, 100): 1}))
    with pytest.raises(ConfigError, match="longest length 100"):
        evaluate(shapes, (64,), model())
    with pytest.raises(ConfigError, match="max_buckets must be >= 1, got 0"):
        plan_sizes(shapes, model(), 0)
