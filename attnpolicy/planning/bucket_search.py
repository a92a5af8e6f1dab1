"""Bucket planning: the compiled sizes that minimise a workload's modelled time.

A workload under one policy is a multiset of exact call shapes
(:class:`CallShapes`: call kind, query rows, key rows, and a ROWS call's row count).
A bucket list ``S`` rounds every length up to the next size in ``S``; the modelled
time of the workload is then

    Σ_calls count · run_f(S(q), S(kv))  +  Σ_distinct keys compile_f(S(q), S(kv))

(every graph compiled once: the cache holds the whole plan). ``f`` is a shape's
*class*, its call kind at its row count: a ROWS call of ``r`` rows runs ``r`` × the
rows fit (:meth:`~attnpolicy.graphs.costmodel.CostModel.run_fit`) and its graph is
one per row count; the row counts come from the config's ``row_buckets`` and are
not searched. A ROWS call whose rows each hold one token keeps that length under every
list (:func:`~attnpolicy.graphs.plan_rules.rows_length`: decodes' ``[rows, 1]`` calls):
for a ROWS shape a length of 1 is its own bucket. :func:`plan_sizes`
finds, for every number of buckets ``k`` up to a limit, the best list whose sizes
are multiples of ``align`` (:data:`ALIGN` by default; a length's round-up is held to
its kind's limit, ``max_seq_len`` or ``max_batch_tokens``, when that is not a
multiple), the largest one included:

- *square* shapes (``q == kv``: prefills without context, packed MASK rows) are
  padded on both sides by the same bucket, so a bucket's cost depends only on its
  own boundary and the shapes it serves. Dynamic programming over the sorted
  candidate boundaries is then exact: ``best[k][j] = min_i best[k-1][i] +
  cost(i, j]``, O(k · m²) for m candidates;
- *rectangular* shapes (``q < kv``: decodes, chunked prefills) also pad ``q`` by
  the bucket list, which couples buckets. The program prices them with ``q``
  unpadded (a lower bound on their run cost), and a local search on the exact
  objective then moves each boundary while that lowers the true modelled time.
  For workloads of square shapes alone the result is the optimum; otherwise the
  program's value is a lower bound and the reported gap says how near the
  result is. A ROWS shape of query length 1 pays its cost in its key bucket alone
  (exact), and one of lengths 1 and 1 the same under every list.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CALL_KINDS, CallKind, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.costmodel import CostModel, Fit

#: The default alignment of planned buckets: a multiple of vLLM's capture-size
#: strides (8 below 256 tokens, 16 from 256) and the planner's historical grid.
ALIGN = 16
#: Boundaries the program prices at once (a block of rows of its segment costs).
_BLOCK = 64
#: Call kinds in the order of :attr:`CallShapes.kind` codes.
_CODE = {kind: code for code, kind in enumerate(CALL_KINDS)}
_ROWS = _CODE[CallKind.ROWS]


#: Call shapes counted: ``(kind, q, kv)``, or ``(kind, q, kv, rows)`` with a ROWS call's rows.
Counted = Mapping[tuple[CallKind, int, int], int] | Mapping[tuple[CallKind, int, int, int], int]


@dataclass(frozen=True)
class CallShapes:
    """Exact (unbucketed) call shapes with their counts, one entry per distinct shape; a
    ROWS shape's ``q`` and ``kv`` are its longest row's and ``rows`` its row count (1 for
    every other kind)."""

    kind: np.ndarray  # int codes into CALL_KINDS
    q: np.ndarray
    kv: np.ndarray
    count: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, shapes: Counted) -> CallShapes:
        """The shapes of these calls (a row count for ROWS calls alone)."""
        if not shapes:
            raise ConfigError("a plan needs at least one call shape, got none (empty workload)")
        entries = []
        for shape, n in shapes.items():
            kind, q, kv, rows = (*shape, 1) if len(shape) == 3 else shape
            if rows < 1 or (rows != 1 and kind is not CallKind.ROWS):
                raise ConfigError(f"a {kind.value} call shape has rows 1 (a rows call at least 1), got {rows}")
            entries.append((_CODE[kind], q, kv, n, rows))
        return cls(*(np.array(col, dtype=np.int64) for col in zip(*sorted(entries), strict=True)))

    @classmethod
    def from_layouts(cls, decided: Iterable[tuple[BatchLayout, MaskMode]], config: AttnPolicyConfig) -> CallShapes:
        """The shapes of each ``(layout, mode)``'s planned calls (exact lengths; a ROWS
        call's rows and calls by ``config``'s ``row_buckets``)."""
        shapes: Counter[tuple[CallKind, int, int, int]] = Counter()
        for layout, mode in decided:
            for call in plan_calls(layout, mode, rows_bucket=config.rows_bucket, max_rows=config.row_buckets[-1]):
                shapes[call.kind, call.q_bucket, call.kv_bucket, call.rows] += 1
        return cls.of(shapes)

    @property
    def classes(self) -> tuple[np.ndarray, list[tuple[CallKind, int]]]:
        """Each shape's class, a code into the list of classes present: a call kind at a
        row count, ascending (computed once)."""
        found = self.__dict__.get("_classes")
        if found is None:
            u, code = np.unique(self.kind * (int(self.rows.max()) + 1) + self.rows, return_inverse=True)
            kinds, rows = np.divmod(u, int(self.rows.max()) + 1)
            found = code.reshape(-1), [(CALL_KINDS[k], int(r)) for k, r in zip(kinds.tolist(), rows.tolist())]
            object.__setattr__(self, "_classes", found)
        return found

    @property
    def max_len(self) -> int:
        return int(self.kv.max())

    def by_class(self) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """``(class code, q, kv, count)`` of each class (:attr:`classes`), in code order
        (computed once)."""
        parts = self.__dict__.get("_parts")
        if parts is None:
            code, classes = self.classes
            parts = [(c, self.q[sel], self.kv[sel], self.count[sel])
                     for c in range(len(classes)) if (sel := code == c).any()]
            object.__setattr__(self, "_parts", parts)
        return parts

    @property
    def calls(self) -> int:
        return int(self.count.sum())


@dataclass(frozen=True)
class BucketListCost:
    """The modelled time of a workload under one bucket list (every graph compiled once)."""

    sizes: tuple[int, ...]
    run_seconds: float
    compile_seconds: float
    graphs: int
    padded_tokens: int

    @property
    def total_seconds(self) -> float:
        return self.run_seconds + self.compile_seconds


def _fits(model: CostModel, which: str, shapes: CallShapes) -> list[Fit]:
    """The run or compile fits (``which``) of ``shapes``' classes, in code order: a
    class's :meth:`~attnpolicy.graphs.costmodel.CostModel.run_fit` at its rows, its
    kind's compile fit (a model without a kind's fits prices no shape of it)."""
    if which == "run":
        return [model.run_fit(kind, rows) for kind, rows in shapes.classes[1]]
    return [model.compile_fit(kind) for kind, _ in shapes.classes[1]]


def _coefficients(model: CostModel, which: str, shapes: CallShapes) -> np.ndarray:
    """:func:`_fits` as coefficients (class code, (base, per cell, per token)), for
    :meth:`Fit.formula`."""
    return np.array([(f.base, f.per_cell, f.per_token) for f in _fits(model, which, shapes)])


def evaluate(shapes: CallShapes, sizes: Sequence[int], model: CostModel) -> BucketListCost:
    """The exact modelled time of ``shapes`` bucketed by ``sizes`` (ascending, the last
    at least the longest length)."""
    s = np.asarray(sorted(sizes), dtype=np.int64)
    if s.size == 0 or s[-1] < shapes.max_len:
        raise ConfigError(f"sizes must cover the longest length {shapes.max_len}, got {list(sizes)}")
    run = _fits(model, "run", shapes)
    comp = _fits(model, "compile", shapes)
    run_total = 0.0
    compile_total = 0.0
    graphs = 0
    padded = 0
    classes = shapes.classes[1]
    for code, q_exact, kv_exact, n in shapes.by_class():
        rows = classes[code][0] is CallKind.ROWS
        bq, bkv = _rounded(s, q_exact, rows), _rounded(s, kv_exact, rows)
        run_total += float((n * run[code](bq.astype(float), bkv.astype(float))).sum())
        kq, kk = np.divmod(np.unique(bq * (int(s[-1]) + 1) + bkv), int(s[-1]) + 1)
        compile_total += float(comp[code](kq.astype(float), kk.astype(float)).sum()) if model.backend != "none" else 0.0
        graphs += kq.size
        padded += int((n * (bq - q_exact)).sum())
    run_total += model.call_overhead_seconds * shapes.calls
    return BucketListCost(tuple(int(x) for x in s), run_total, compile_total, graphs, padded)


def _rounded(sizes: np.ndarray, lengths: np.ndarray, rows: bool | np.ndarray) -> np.ndarray:
    """The buckets of ``lengths`` in the ascending ``sizes`` (the last at least each
    length): a ROWS shape's (``rows``, per length or for all) by
    :func:`~attnpolicy.graphs.plan_rules.rows_length`, as its call is planned."""
    b = sizes[np.searchsorted(sizes, lengths)]
    return np.where(rows, plan_rules.rows_length(lengths, b), b)


def candidates(shapes: CallShapes, align: int, limits: Mapping[CallKind, int] | None = None) -> np.ndarray:
    """Candidate boundaries: every length rounded up to a multiple of ``align``, or to
    its kind's limit in ``limits`` when the multiple is above it (a kind not
    named there is not held)."""
    if align < 1:
        raise ConfigError(f"align must be >= 1, got {align}")
    cap = np.full(shapes.kind.size, np.iinfo(np.int64).max, dtype=np.int64)
    for kind, limit in (limits or {}).items():
        if limit < 1:
            raise ConfigError(f"the limit of call kind {kind.value} must be >= 1, got {limit}")
        cap[shapes.kind == _CODE[kind]] = limit
    up = [np.minimum(-(-x // align) * align, cap) for x in (shapes.q, shapes.kv)]
    over = np.flatnonzero(up[1] < shapes.kv)
    if over.size:
        i = int(over[0])
        raise ConfigError(f"a {CALL_KINDS[int(shapes.kind[i])].value} call of length {int(shapes.kv[i])} is above "
                          f"its call kind's limit {int(cap[i])}")
    return np.unique(np.concatenate(up))


def _program(shapes: CallShapes, cand: np.ndarray, model: CostModel, max_buckets: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """``best[k, j]``: a lower bound of the modelled time of serving every length
    <= cand[j-1] with k buckets, the largest at cand[j-1] (exact for square shapes);
    ``arg[k, j]``: the previous boundary index of the plan attaining it.

    Costs are split into parts that each depend on one bucket. A square shape
    ``(n, n)`` costs ``run(b, b)`` in the bucket ``b`` of ``n``. A rectangular shape
    ``(q, kv)`` costs ``per_cell·b_q·kv + per_token·b_q`` in the bucket ``b_q`` of
    ``q`` and ``run(0, b_kv) = base + per_token·b_kv`` in the bucket ``b_kv`` of ``kv``: its cell
    term counts ``kv`` unpadded, so the sum never exceeds the true cost. Compiles:
    one key per class and bucket of square shapes, and one rectangular key
    (``q`` bucket at least 1) per class and kv bucket with no square key. A ROWS
    shape of query length 1 (:func:`_rounded`: its own bucket) costs ``run(1, b_kv)``
    and its key ``(1, b_kv)`` in the bucket of ``kv``, exactly; one of lengths 1 and 1
    costs the same under every list (``best[0, 0]``)."""
    class_of, classes = shapes.classes
    m, nf = cand.size, len(classes)
    slot_q = np.searchsorted(cand, shapes.q) + 1
    slot_kv = np.searchsorted(cand, shapes.kv) + 1
    ones = (shapes.kind == _ROWS) & (shapes.q == 1)
    fixed = ones & (shapes.kv == 1)
    ones &= ~fixed
    square = (shapes.q == shapes.kv) & ~fixed
    rect = (shapes.q != shapes.kv) & ~ones
    count = shapes.count.astype(float)

    def prefix(sel: np.ndarray, slot: np.ndarray, weights: np.ndarray) -> np.ndarray:
        out = np.zeros((nf, m + 1))
        np.add.at(out, (class_of[sel], slot[sel]), weights[sel])
        return out.cumsum(-1)

    sq = prefix(square, slot_kv, count)
    rq_n = prefix(rect, slot_q, count)  # rectangular shapes by their q bucket
    rq_kv = prefix(rect, slot_q, count * shapes.kv)
    rkv_n = prefix(rect, slot_kv, count)  # ... and by their kv bucket
    one_n = prefix(ones, slot_kv, count)  # ROWS shapes of query length 1 by their kv bucket
    run, comp = _fits(model, "run", shapes), _fits(model, "compile", shapes)
    compiles = model.backend != "none"
    lengths = cand.astype(float)
    best = np.full((max_buckets + 1, m + 1), np.inf)
    arg = np.zeros((max_buckets + 1, m + 1), dtype=np.int64)
    best[0, 0] = sum(float(count[fixed & (class_of == c)].sum()) * run[c](1, 1)
                     + (comp[c](1, 1) if compiles else 0.0) for c in np.unique(class_of[fixed]).tolist())
    # a class without square (rectangular, query length 1) shapes adds exact zeros for them: skipped
    present = [(c, sq[c, -1] > 0, rq_n[c, -1] > 0, one_n[c, -1] > 0) for c in range(nf)]
    present = [p for p in present if any(p[1:])]
    for j0 in range(1, m + 1, _BLOCK):  # a block of boundaries j (rows), every start i < j (columns)
        j = np.arange(j0, min(j0 + _BLOCK, m + 1))[:, None]
        i = np.arange(int(j[-1, 0]))
        b = lengths[j - 1]
        seg = np.zeros((j.size, i.size))  # cost of one bucket at cand[j-1] serving candidates i..j-1
        for code, squares, rects, singles in present:
            fit = run[code]
            n_sq = sq[code, j] - sq[code, i]
            if squares:
                seg += n_sq * fit(b, b)
            if rects:
                n_kv = rkv_n[code, j] - rkv_n[code, i]
                seg += ((rq_n[code, j] - rq_n[code, i]) * fit.per_token * b
                        + (rq_kv[code, j] - rq_kv[code, i]) * fit.per_cell * b)
                seg += n_kv * fit(0, b)
            if singles:
                n_one = one_n[code, j] - one_n[code, i]
                seg += n_one * fit(1, b)
            if compiles:
                if squares:
                    seg += (n_sq > 0) * comp[code](b, b)
                if rects:
                    seg += ((n_kv > 0) & (n_sq == 0)) * comp[code](1, b)
                if singles:
                    seg += (n_one > 0) * comp[code](1, b)
        seg[i >= j] = np.inf  # a start at or after its boundary is no bucket
        rows = np.arange(j.size)
        for k in range(1, max_buckets + 1):  # a plan of k buckets ending at cand[j-1]: k-1 ending at cand[i-1]
            total = best[k - 1, :i.size] + seg
            at = np.argmin(total, axis=1)
            best[k, j[:, 0]], arg[k, j[:, 0]] = total[rows, at], at
    return best, arg


def _boundaries(arg: np.ndarray, cand: np.ndarray, k: int) -> tuple[int, ...]:
    out = []
    j = cand.size
    while k > 0 and j > 0:
        out.append(int(cand[j - 1]))
        j = int(arg[k, j])
        k -= 1
    return tuple(sorted(out))


#: Fits' coefficients (base, per cell, per token), arrays for :meth:`Fit.formula`.
_Coefficients = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _Tally:
    """Shapes counted by bucket pair, to price many bucket lists at once: the distinct q
    and kv lengths, per class (:attr:`CallShapes.classes`) the calls with q and kv at most
    each of them (a cumulative count in two dimensions), and the classes' run and compile
    coefficients (``None``: nothing compiles). The calls of one (q bucket, kv bucket) pair
    are a difference of four counts, so a list of ``k`` buckets is priced in ``k²`` terms
    per class whatever the number of shapes: the run and compile seconds :func:`evaluate`
    gives, call overheads left out. ``rows``: which classes are ROWS, when one of their
    lengths is 1 (its own bucket: a list is priced with 1 before its buckets, every
    other class's calls of that bucket counted in the next), else ``None``."""

    q: np.ndarray
    kv: np.ndarray
    table: np.ndarray  # (class, q lengths at most, kv lengths at most)
    run: _Coefficients  # each (class, 1, 1, 1)
    comp: _Coefficients | None
    lengths: np.ndarray  # every q and kv length, sorted
    rows: np.ndarray | None

    @classmethod
    def of(cls, shapes: CallShapes, model: CostModel) -> _Tally:
        class_of, classes = shapes.classes
        uq, iq = np.unique(shapes.q, return_inverse=True)
        ukv, ikv = np.unique(shapes.kv, return_inverse=True)
        table = np.zeros((len(classes), uq.size + 1, ukv.size + 1))
        np.add.at(table, (class_of, iq + 1, ikv + 1), shapes.count)
        rb, rc, rt = _coefficients(model, "run", shapes).T[:, :, None, None, None]
        cb, cc, ct = _coefficients(model, "compile", shapes).T[:, :, None, None, None]
        rows = np.array([kind is CallKind.ROWS for kind, _ in classes])
        ones = bool(((shapes.kind == _ROWS) & (shapes.q == 1)).any())
        return cls(uq, ukv, table.cumsum(1).cumsum(2), (rb, rc, rt), (cb, cc, ct) if model.backend != "none" else None,
                   np.sort(np.concatenate((shapes.q, shapes.kv))), rows if ones else None)

    def near(self, lo: int, hi: int) -> bool:
        """Whether some call has a length in ``(lo, hi]``."""
        return bool(np.searchsorted(self.lengths, hi, "right") > np.searchsorted(self.lengths, lo, "right"))

    def prices(self, lists: np.ndarray) -> np.ndarray:
        """The run and compile seconds under each row of ``lists`` (bucket lists of one
        length, ascending, the last at least the longest length)."""
        if self.rows is not None:
            lists = np.concatenate((np.ones((lists.shape[0], 1), dtype=lists.dtype), lists), axis=1)
        value = lists.astype(float)
        bq, bkv = value[:, :, None], value[:, None, :]
        ends = np.concatenate((np.full((lists.shape[0], 1), -1, dtype=np.int64), lists), axis=1)  # -1: none below
        cum = self.table[:, np.searchsorted(self.q, ends, "right")[:, :, None],
                         np.searchsorted(self.kv, ends, "right")[:, None, :]]
        calls = cum[..., 1:, 1:] - cum[..., :-1, 1:] - cum[..., 1:, :-1] + cum[..., :-1, :-1]  # per class, bucket pair
        if self.rows is not None:  # a length of 1 is a bucket of ROWS classes alone
            other = ~self.rows
            calls[other, :, 1] += calls[other, :, 0]
            calls[other, :, :, 1] += calls[other, :, :, 0]
            calls[other, :, 0] = calls[other, :, :, 0] = 0
        total: np.ndarray = (calls * Fit.formula(*self.run, bq, bkv)).sum(axis=(0, 2, 3))
        if self.comp is not None:
            total += np.where(calls > 0, Fit.formula(*self.comp, bq, bkv), 0.0).sum(axis=(0, 2, 3))
        return total


def on_grid(shapes: CallShapes, cand: np.ndarray) -> CallShapes:
    """``shapes`` with each length rounded up to the next of the sorted boundaries
    ``cand``, equal shapes merged: any bucket list drawn from ``cand`` gives them the
    same buckets, hence the same modelled seconds (not the same padding)."""
    rows = shapes.kind == _ROWS
    q, kv = _rounded(cand, shapes.q, rows), _rounded(cand, shapes.kv, rows)
    class_of, classes = shapes.classes
    code = (class_of * (cand[-1] + 1) + q) * (cand[-1] + 1) + kv
    u, inverse = np.unique(code, return_inverse=True)
    count = np.bincount(inverse, weights=shapes.count).astype(np.int64)
    rest, ukv = np.divmod(u, cand[-1] + 1)
    cls, uq = np.divmod(rest, cand[-1] + 1)
    kinds = np.array([_CODE[kind] for kind, _ in classes])
    rows = np.array([r for _, r in classes])
    return CallShapes(kinds[cls], uq, ukv, count, rows[cls])


def _improve(shapes: CallShapes, tally: _Tally, sizes: tuple[int, ...], cand: np.ndarray, model: CostModel,
             window: int = 4) -> tuple[int, ...]:
    """Move each boundary (but the largest) to a nearby candidate (``window`` steps either
    way) while that lowers the exact modelled time. Only rectangular shapes need it:
    on square shapes the program is already exact.

    A boundary's moves are priced together by ``tally`` (``shapes``, or the same shapes
    :func:`on_grid` of ``cand``: fewer, the same seconds, counted per bucket pair); a
    boundary with no length in ``(lo, hi]`` between its neighbours changes nothing and
    is not moved. A move whose price is within rounding of the threshold (``1e-9`` of
    the total) is priced on the whole workload (:func:`evaluate`) and taken when it
    lowers that by more than ``1e-12``; one clearly cheaper is taken and one clearly
    dearer is not, as whole-workload pricing would decide, so the moves taken are
    those whole-workload pricing takes."""
    if bool((shapes.q == shapes.kv).all()):
        return sizes
    current = evaluate(shapes, sizes, model).total_seconds  # the total, exact or up to rounding
    # the moves' prices of a boundary, by (sizes, pos, bounds): the last pass asks again
    # what the pass before asked after its last move
    priced_moves: dict[tuple[tuple[int, ...], int, tuple[int, ...]], dict[int, float]] = {}
    exact: float | None = current  # None: not priced on the whole workload since the last move
    improved = True
    while improved:
        improved = False
        for pos in range(len(sizes) - 1):
            lo = sizes[pos - 1] if pos else 0
            hi = sizes[pos + 1]
            at = int(np.searchsorted(cand, sizes[pos]))
            moves = [int(c) for c in cand[max(at - window, 0):at + window + 1] if lo < c < hi and c != sizes[pos]]
            if not moves or not tally.near(lo, hi):
                continue
            bounds = tuple(sorted({sizes[pos], *moves}))
            prices = priced_moves.get((sizes, pos, bounds))
            if prices is None:
                trials = np.tile(np.asarray(sizes, dtype=np.int64), (len(bounds), 1))
                trials[:, pos] = bounds
                prices = priced_moves[sizes, pos, bounds] = dict(
                    zip(bounds, tally.prices(trials).tolist(), strict=True))
            part_now = prices[sizes[pos]]
            for c in moves:
                trial = (*sizes[:pos], c, *sizes[pos + 1:])
                part_trial = prices[c]
                delta = part_trial - part_now
                margin = 1e-9 * max(current, 1.0)
                if delta > margin:
                    continue  # clearly no better
                if delta >= -margin:  # within rounding: the whole workload decides
                    if exact is None:
                        exact = evaluate(shapes, sizes, model).total_seconds
                    total = evaluate(shapes, trial, model).total_seconds
                    if not total < exact - 1e-12:
                        continue
                    exact = current = total
                else:
                    exact, current = None, current + delta
                sizes, part_now, improved = trial, part_trial, True
    return sizes


@dataclass(frozen=True)
class SizePlan:
    """The best bucket list found for one number of buckets, and the program's lower bound."""

    buckets: int
    cost: BucketListCost
    lower_bound: float

    @property
    def gap(self) -> float:
        """How far the result may be from the optimum, as a fraction of the bound."""
        return self.cost.total_seconds / self.lower_bound - 1 if self.lower_bound > 0 else 0.0


def plan_sizes(shapes: CallShapes, model: CostModel, max_buckets: int, *, align: int = ALIGN,
               limits: Mapping[CallKind, int] | None = None) -> list[SizePlan]:
    """The best list of ``k`` bucket sizes found for each ``k`` in ``1..max_buckets``
    (fewer when there are fewer candidate boundaries), with the program's lower bound:
    the program's plan, improved locally on the exact objective when the workload
    has rectangular shapes (on square shapes alone it is already optimal). Every size
    is a :func:`candidates` boundary of ``align`` and ``limits``."""
    if max_buckets < 1:
        raise ConfigError(f"max_buckets must be >= 1, got {max_buckets}")
    cand = candidates(shapes, align, limits)
    kmax = min(max_buckets, cand.size)
    overhead = model.call_overhead_seconds * shapes.calls  # the same for every plan
    bound, arg = _program(shapes, cand, model, kmax)
    tally = _Tally.of(on_grid(shapes, cand), model)
    plans = []
    for k in range(1, kmax + 1):
        sizes = _improve(shapes, tally, _boundaries(arg, cand, k), cand, model)
        plans.append(SizePlan(k, evaluate(shapes, sizes, model), float(bound[k, cand.size]) + overhead))
    return plans

