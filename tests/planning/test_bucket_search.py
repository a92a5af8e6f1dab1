"""Bucket planning: the program is exact on square shapes, a bound otherwise, and the
local search only ever improves the exact modelled time."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.planning.bucket_search import (
    CallShapes,
    _boundaries,
    _improve,
    _program,
    _Tally,
    candidates,
    evaluate,
    on_grid,
    plan_sizes,
)

#: The call kinds the planner prices.
PLANNED_KINDS = list(CallKind)


def model(backend: str = "aot_eager", rows: bool = True) -> CostModel:
    """A synthetic cost model: run grows with cells and tokens, compiles cost a lot; without
    ``rows``, one calibrated before the rows kind."""
    kinds = [k.value for k in CallKind if rows or k is not CallKind.ROWS]
    run = {k: Fit(base=1e-4, per_cell=1e-8 * (1 + i), per_token=1e-6) for i, k in enumerate(kinds)}
    comp = {k: Fit(base=0.05, per_cell=1e-9, per_token=1e-6 * (1 + i)) for i, k in enumerate(kinds)}
    return CostModel(run=run, compile=comp, mask_build=Fit(), backend=backend, call_overhead_seconds=1e-6)


def _with_rows(t):
    """A drawn ``(kind, q, kv, rows)`` as a shape: rows for a ROWS call alone."""
    kind, q, kv, rows = t
    return (kind, q, kv, rows if kind is CallKind.ROWS else 1)


def brute_force(shapes: CallShapes, cand, k: int, m: CostModel) -> float:
    top = int(cand[-1])
    best = float("inf")
    for rest in itertools.combinations([int(c) for c in cand[:-1]], k - 1):
        best = min(best, evaluate(shapes, (*rest, top), m).total_seconds)
    return best


square_shapes = st.dictionaries(
    st.tuples(st.sampled_from([CallKind.CAUSAL, CallKind.MASK]), st.integers(1, 200)).map(lambda t: (t[0], t[1], t[1])),
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


def lengths(top: int) -> st.SearchStrategy[int]:
    """Query lengths up to ``top``, often 1 (decodes: a ROWS call of them keeps it under every list)."""
    return st.one_of(st.just(1), st.integers(1, top))


rect_shapes = st.dictionaries(
    st.tuples(st.sampled_from(PLANNED_KINDS), lengths(100), st.integers(0, 150)).map(
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
        assert plan.cost.sizes[-1] == -(-shapes.max_len // 16) * 16  # the longest length, aligned
        assert len(plan.cost.sizes) == plan.buckets


def test_evaluate_counts_padding_graphs_and_seconds():
    m = model()
    shapes = CallShapes.of(Counter({(CallKind.CAUSAL, 10, 10): 3, (CallKind.VARLEN, 1, 40): 2}))
    cost = evaluate(shapes, (16, 64), m)
    run_c = m.run["causal"](16, 16) * 3
    run_v = m.run["varlen"](16, 64) * 2
    assert cost.run_seconds == pytest.approx(run_c + run_v + 5 * m.call_overhead_seconds)
    assert cost.compile_seconds == pytest.approx(m.compile["causal"](16, 16) + m.compile["varlen"](16, 64))
    assert cost.graphs == 2
    assert cost.padded_tokens == 3 * 6 + 2 * 15


def _square_cells(base, per_cell, per_token, rows, cols):
    """A fit formula other than the built-in one."""
    return base + per_cell * (rows * cols) ** 2 + per_token * rows


@pytest.mark.parametrize("formula", [Fit.formula, _square_cells])
def test_evaluate_prices_calls_by_the_fit_of_the_cost_model(monkeypatch, formula):
    """The planner's prices are the cost model's, whatever formula its fits follow."""
    monkeypatch.setattr(Fit, "formula", staticmethod(formula))
    m = model()
    shapes = CallShapes.of(Counter({(CallKind.CAUSAL, 10, 10): 3, (CallKind.VARLEN, 1, 40): 2,
                                    (CallKind.MASK, 30, 50): 1}))
    cost = evaluate(shapes, (16, 64), m)
    calls = [(CallKind.CAUSAL, 16, 16, 3), (CallKind.VARLEN, 16, 64, 2), (CallKind.MASK, 64, 64, 1)]
    assert cost.run_seconds == pytest.approx(sum(n * m.call_seconds(kind, q, kv) for kind, q, kv, n in calls)
                                             + 6 * m.call_overhead_seconds)
    assert cost.compile_seconds == pytest.approx(sum(m.compile[kind](q, kv) for kind, q, kv, _ in calls))


def test_shapes_from_layouts_follow_the_plan():
    """The call table's shapes are the planned calls' (a ROWS step: one per row range of
    at most the largest row bucket, its longest row's lengths at its row bucket)."""
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.planning.call_table import CallTable

    packed = BatchLayout.from_lens([5, 7])
    decode = BatchLayout.from_lens([1, 1], [9, 30])
    rows = BatchLayout.from_lens([1, 1, 6, 3, 2, 4, 8], [9, 30, 6, 3, 2, 4, 8])
    config = AttnPolicyConfig(row_buckets=(1, 2, 4))
    decided = [(packed, MaskMode.VARLEN), (packed, MaskMode.MASK), (decode, MaskMode.VARLEN), (rows, MaskMode.ROWS)]
    shapes = CallShapes.from_layouts(decided, config)
    got = Counter({(int(f), int(q), int(kv), int(r)): int(n)
                   for f, q, kv, n, r in zip(shapes.kind, shapes.q, shapes.kv, shapes.count, shapes.rows, strict=True)})
    assert got == Counter({(0, 5, 5, 1): 1, (0, 7, 7, 1): 1, (1, 12, 12, 1): 1, (2, 1, 9, 1): 1, (2, 1, 30, 1): 1,
                           (3, 1, 30, 2): 1, (3, 6, 6, 4): 1, (3, 8, 8, 1): 1})
    tabled = CallTable([rows, packed], "always-rows", config, CostModel.default()).shapes()
    planned = CallShapes.from_layouts([(rows, MaskMode.ROWS), (packed, MaskMode.ROWS)], config)
    assert all(np.array_equal(getattr(tabled, f.name), getattr(planned, f.name)) for f in dataclasses.fields(CallShapes))


def test_the_search_prices_a_rows_workload_as_the_call_table_records_it():
    """Decodes' ``[rows, 1]`` calls beside prefills and chunks (no chunk with context
    sharing a prefill's buckets: the search keys a shape without its context): the
    search's modelled run and compile seconds and graph count are those of the table's
    keys under the same list."""
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.planning.call_table import CallTable

    m = CostModel.default()
    config = AttnPolicyConfig(policy="always-rows", buckets={"kind": "list", "sizes": [32, 96, 128]},
                              max_seq_len=128, max_batch_tokens=128, row_buckets=(1, 2, 4))
    steps = [BatchLayout.from_lens([20, 44]), BatchLayout.from_lens([1, 1, 9, 53], [21, 45, 9, 53]),
             BatchLayout.from_lens([1, 20], [50, 40]), BatchLayout.from_lens([1], [92]),
             BatchLayout.from_lens([1, 1], [1, 1])]
    table = CallTable(steps, "always-rows", config, m)
    bucketed = table.bucketed(config)
    cost = evaluate(table.shapes(), config.buckets.sizes, m)
    assert any(k.q_len == 1 < k.kv_len for k in bucketed.keys) and any(k.q_len == k.kv_len == 1 for k in bucketed.keys)
    assert cost.graphs == len(bucketed.keys)
    assert cost.run_seconds == pytest.approx(bucketed.recording.attention_seconds, rel=1e-12)
    assert cost.compile_seconds == pytest.approx(sum(m.compile_seconds(k) for k in bucketed.keys), rel=1e-12)


def test_rows_shapes_are_priced_at_their_rows_with_a_graph_per_row_count():
    m = model()
    shapes = CallShapes.of(Counter({(CallKind.ROWS, 10, 10, 4): 2, (CallKind.ROWS, 12, 12, 2): 1,
                                    (CallKind.CAUSAL, 12, 12): 1}))
    cost = evaluate(shapes, (16,), m)
    run = 2 * m.call_seconds(CallKind.ROWS, 16, 16, 4) + m.call_seconds(CallKind.ROWS, 16, 16, 2)
    assert m.call_seconds(CallKind.ROWS, 16, 16, 4) == pytest.approx(4 * m.run[CallKind.ROWS](16, 16))
    assert cost.run_seconds == pytest.approx(run + m.call_seconds(CallKind.CAUSAL, 16, 16) + 4 * 1e-6)
    assert cost.graphs == 3  # r4, r2 and the causal graph
    assert cost.compile_seconds == pytest.approx(2 * m.compile[CallKind.ROWS](16, 16) + m.compile["causal"](16, 16))
    with pytest.raises(ConfigError, match="a causal call shape has rows 1.*got 4"):
        CallShapes.of(Counter({(CallKind.CAUSAL, 16, 16, 4): 1}))


def test_a_rows_shape_of_one_token_rows_keeps_length_one_under_every_list():
    """A ROWS call whose rows hold one query (decodes' ``[rows, 1]``) runs at query length
    1, not the smallest bucket: priced, keyed and padded so, as the dispatcher plans it;
    a VARLEN decode still rounds up."""
    m = model()
    shapes = CallShapes.of(Counter({(CallKind.ROWS, 1, 40, 2): 3, (CallKind.ROWS, 10, 40, 2): 1,
                                    (CallKind.ROWS, 1, 1, 4): 2, (CallKind.VARLEN, 1, 40): 1}))
    cost = evaluate(shapes, (16, 64), m)
    calls = [(CallKind.ROWS, 1, 64, 2, 3), (CallKind.ROWS, 16, 64, 2, 1), (CallKind.ROWS, 1, 1, 4, 2),
             (CallKind.VARLEN, 16, 64, 1, 1)]
    assert cost.run_seconds == pytest.approx(sum(n * m.call_seconds(kind, q, kv, r) for kind, q, kv, r, n in calls)
                                             + 7 * m.call_overhead_seconds)
    assert cost.graphs == 4 and cost.padded_tokens == 6 + 15
    assert cost.compile_seconds == pytest.approx(sum(m.compile[kind](q, kv) for kind, q, kv, _, _ in calls))


def test_a_model_without_rows_fits_plans_other_shapes_and_names_the_fix_for_rows():
    old = model(rows=False)  # a model calibrated before the rows kind
    assert CallKind.ROWS not in old.run
    shapes = CallShapes.of(Counter({(CallKind.CAUSAL, 20, 20): 3, (CallKind.VARLEN, 5, 90): 2}))
    sizes = plan_sizes(shapes, old, 2)
    assert sizes and all(math.isfinite(p.cost.total_seconds) and math.isfinite(p.lower_bound) for p in sizes)
    with pytest.raises(ConfigError, match="no rows fit .*run attnpolicy calibrate"):
        plan_sizes(CallShapes.of(Counter({(CallKind.ROWS, 20, 20, 2): 3})), old, 2)


def test_errors_name_the_value():
    with pytest.raises(ConfigError, match="empty workload"):
        CallShapes.of(Counter())
    shapes = CallShapes.of(Counter({(CallKind.CAUSAL, 100, 100): 1}))
    with pytest.raises(ConfigError, match="longest length 100"):
        evaluate(shapes, (64,), model())
    with pytest.raises(ConfigError, match="max_buckets must be >= 1, got 0"):
        plan_sizes(shapes, model(), 0)


# -- the fast paths against the plain algorithms they replace ----------------------------

def reference_program(shapes: CallShapes, cand: np.ndarray, m: CostModel, max_buckets: int):
    """The program with every term added for every kind at its row count, candidate by candidate
    (a ROWS shape's length 1 is its own bucket)."""
    classes = sorted({(int(k), int(r)) for k, r in zip(shapes.kind, shapes.rows)})
    nf = len(classes)
    cls = np.array([classes.index((int(k), int(r))) for k, r in zip(shapes.kind, shapes.rows)], dtype=np.int64)
    slot_q, slot_kv = np.searchsorted(cand, shapes.q) + 1, np.searchsorted(cand, shapes.kv) + 1
    single = (shapes.kind == list(CallKind).index(CallKind.ROWS)) & (shapes.q == 1)
    fixed = single & (shapes.kv == 1)
    square, rect, single = (shapes.q == shapes.kv) & ~fixed, (shapes.q != shapes.kv) & ~single, single & ~fixed
    count = shapes.count.astype(float)

    def prefix(sel, slot, weights):
        out = np.zeros((nf, cand.size + 1))
        np.add.at(out, (cls[sel], slot[sel]), weights[sel])
        return out.cumsum(-1)

    sq, rq_n, one_n = prefix(square, slot_kv, count), prefix(rect, slot_q, count), prefix(single, slot_kv, count)
    rq_kv, rkv_n = prefix(rect, slot_q, count * shapes.kv), prefix(rect, slot_kv, count)
    kinds = list(CallKind)
    run = [(r * m.run[kinds[k]].base, r * m.run[kinds[k]].per_cell, r * m.run[kinds[k]].per_token) for k, r in classes]
    comp = [(m.compile[kinds[k]].base, m.compile[kinds[k]].per_cell, m.compile[kinds[k]].per_token)
            for k, _ in classes]
    best = np.full((max_buckets + 1, cand.size + 1), np.inf)
    arg = np.zeros((max_buckets + 1, cand.size + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for code in np.unique(cls[fixed]):  # lengths 1 and 1: the same under every list
        (i,) = np.flatnonzero(fixed & (cls == code))
        (base, cell, token), (cb, cc, ct) = run[code], comp[code]
        best[0, 0] += count[i] * (base + cell + 2 * token) + ((cb + cc + 2 * ct) if m.backend != "none" else 0.0)
    for j in range(1, cand.size + 1):
        b, i = float(cand[j - 1]), np.arange(j)
        seg = np.zeros(j)
        for code in range(nf):
            base, cell, token = run[code]
            n_sq, n_kv = sq[code, j] - sq[code, i], rkv_n[code, j] - rkv_n[code, i]
            seg += n_sq * (base + cell * b * b + 2 * token * b)
            seg += (rq_n[code, j] - rq_n[code, i]) * token * b + (rq_kv[code, j] - rq_kv[code, i]) * cell * b
            seg += n_kv * (base + token * b)
            n_one = one_n[code, j] - one_n[code, i]
            seg += n_one * (base + cell * b + token * (1 + b))
            if m.backend != "none":
                cb, cc, ct = comp[code]
                seg += (n_sq > 0) * (cb + cc * b * b + 2 * ct * b)
                seg += ((n_kv > 0) & (n_sq == 0)) * (cb + cc * b + ct * (1 + b))
                seg += (n_one > 0) * (cb + cc * b + ct * (1 + b))
        total = best[:max_buckets, :j] + seg
        at = np.argmin(total, axis=1)
        best[1:, j], arg[1:, j] = total[np.arange(max_buckets), at], at
    return best, arg


def reference_improve(shapes: CallShapes, sizes, cand, m: CostModel, window: int = 4):
    """The local search pricing every move on the whole workload with :func:`evaluate`."""
    if bool((shapes.q == shapes.kv).all()):
        return sizes
    current = evaluate(shapes, sizes, m).total_seconds
    improved = True
    while improved:
        improved = False
        for pos in range(len(sizes) - 1):
            lo, at = sizes[pos - 1] if pos else 0, int(np.searchsorted(cand, sizes[pos]))
            for c in cand[max(at - window, 0):at + window + 1]:
                if not lo < c < sizes[pos + 1] or c == sizes[pos]:
                    continue
                trial = (*sizes[:pos], int(c), *sizes[pos + 1:])
                total = evaluate(shapes, trial, m).total_seconds
                if total < current - 1e-12:
                    sizes, current, improved = trial, total, True
    return sizes


many_shapes = st.dictionaries(
    st.tuples(st.sampled_from(PLANNED_KINDS), lengths(300), st.integers(0, 400), st.sampled_from([1, 2, 8])).map(
        lambda t: _with_rows((t[0], t[1], t[1] + t[2] * (t[0] is not CallKind.MASK or t[2] % 2), t[3]))),
    st.integers(1, 30), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(many_shapes, st.integers(1, 6), st.sampled_from(["aot_eager", "none"]), st.sampled_from([1, 64]),
       st.randoms(use_true_random=False))
def test_the_fast_program_and_search_take_the_plain_ones_decisions(raw, k, backend, weight, rnd):
    m = model(backend)
    m = m.model_copy(update={"compile": {f: Fit(base=fit.base * weight, per_cell=fit.per_cell * weight,
                                                 per_token=fit.per_token * weight) for f, fit in m.compile.items()}})
    shapes = CallShapes.of(Counter(raw))
    cand = candidates(shapes, 16)
    k = min(k, cand.size)
    best, arg = _program(shapes, cand, m, k)
    ref_best, ref_arg = reference_program(shapes, cand, m, k)
    assert np.array_equal(best, ref_best) and np.array_equal(arg, ref_arg)  # bit for bit
    tally = _Tally.of(on_grid(shapes, cand), m)
    starts = [_boundaries(arg, cand, j) for j in range(1, k + 1)]
    starts.append(tuple(sorted({*rnd.sample([int(c) for c in cand[:-1]], min(k, cand.size - 1)), int(cand[-1])})))
    for start in starts:
        assert _improve(shapes, tally, start, cand, m) == reference_improve(shapes, start, cand, m)


@pytest.mark.parametrize("backend", ["aot_eager", "none"])
def test_the_program_over_many_blocks_of_boundaries_is_the_plain_one(backend):
    """Some 250 candidate boundaries: the program prices them in several blocks."""
    rng = np.random.default_rng(7)
    q = rng.integers(1, 4000, 300)
    kinds = [CallKind(k) for k in rng.choice(list(CallKind), 300)]
    kv = np.where(rng.random(300) < 0.5, q, q + rng.integers(0, 600, 300))
    rows = rng.choice([1, 4], 300)
    shapes = CallShapes.of(Counter({_with_rows((f, int(a), int(b) if f is not CallKind.MASK else int(a), int(r))): int(n)
                                    for f, a, b, r, n in zip(kinds, q, kv, rows, rng.integers(1, 20, 300),
                                                             strict=True)}))
    cand = candidates(shapes, 16)
    assert cand.size > 200
    best, arg = _program(shapes, cand, model(backend), 6)
    ref_best, ref_arg = reference_program(shapes, cand, model(backend), 6)
    assert np.array_equal(best, ref_best) and np.array_equal(arg, ref_arg)  # bit for bit


@settings(max_examples=40, deadline=None)
@given(many_shapes, st.sampled_from(["aot_eager", "none"]), st.randoms(use_true_random=False))
def test_shapes_on_the_candidate_grid_cost_what_the_exact_shapes_cost(raw, backend, rnd):
    m = model(backend)
    shapes = CallShapes.of(Counter(raw))
    cand = candidates(shapes, 16)
    grid = on_grid(shapes, cand)
    assert grid.calls == shapes.calls and grid.q.size <= shapes.q.size
    sizes = tuple(sorted({*rnd.sample([int(c) for c in cand[:-1]], min(3, cand.size - 1)), int(cand[-1])}))
    exact = evaluate(shapes, sizes, m)
    assert evaluate(grid, sizes, m).total_seconds == pytest.approx(exact.total_seconds, rel=1e-12)
    assert evaluate(grid, sizes, m).graphs == exact.graphs
    if len(sizes) < 2:
        return
    pos = rnd.randrange(len(sizes) - 1)
    lo = sizes[pos - 1] if pos else 0
    bounds = [int(c) for c in cand if lo < c < sizes[pos + 1]]
    trials = np.tile(np.array(sizes), (len(bounds), 1))
    trials[:, pos] = bounds
    overhead = m.call_overhead_seconds * shapes.calls
    for c, price in zip(bounds, _Tally.of(grid, m).prices(trials), strict=True):
        moved = evaluate(shapes, (*sizes[:pos], c, *sizes[pos + 1:]), m).total_seconds
        assert price + overhead == pytest.approx(moved, rel=1e-12)
