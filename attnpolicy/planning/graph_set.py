"""Plan the graph set of a workload: buckets, policy, eviction and warm set, at
either level.

One pipeline (:func:`plan_graphs`) plans each policy, keeps the one with the lowest
simulated total and writes the config that applies it; one result (:class:`GraphPlan`)
holds it. What differs between the levels is how a policy's buckets are searched and
whether a warm set is planned, a :class:`PlanLevel`: :class:`AttentionPlanLevel`
(below) and :class:`WholeModelPlanLevel` (the last paragraph).

At the attention level, for each policy whose decisions depend only on the layout and
the config (``stateless``), the workload's exact call shapes give candidate bucket lists,
one per number of buckets (:func:`~attnpolicy.planning.bucket_search.plan_sizes`: exact
or near-optimal for the modelled time with every graph compiled once). A ROWS call's
shape holds its row count, from the config's ``row_buckets`` (never searched); a
policy that decides from plans gives the shapes of the base config's decisions, and
each candidate is simulated with its own. Each candidate is then simulated at
the given capacity (``max_graphs``, ``max_bytes``; :func:`simulate_layouts`) and the
best bucket list and eviction strategy are kept:

1. candidates in order of their capacity-free modelled time, which no eviction can
   beat (compiles only add up): a candidate whose modelled time is already above the
   best simulated total is skipped;
2. each remaining candidate is simulated with LRU; the best :data:`FINALISTS` are
   simulated with every live eviction strategy. When every graph fits, eviction
   never runs and LRU is kept.

The policy with the lowest simulated total wins. Its warm set is the graphs the
planned traffic uses most, within the capacity and the warm-up budget (modelled
compile seconds): a knapsack solved greedily by uses per compile second, whose
value is the calls served without a compile stall. With a graph store
(``store_dir``) that starts warm (``store_warm``: it holds what a previous run of the
planned config left on it), a graph on the store costs its load seconds instead:
more of them fit the budget. The plan is compared with the base config's buckets
under LRU and under Belady's offline optimum at the same capacity.

Everything is a pure function of the steps, the base config and the cost model.

Whole-model graphs (:class:`WholeModelPlanLevel`) cost seconds each to compile, so the
number of distinct graphs (buckets × modes, VARLEN: combinations of buckets) weighs
on their plan far more than padding. For each stateless policy the planner decides
every batch's mode once, then grows a bucket list greedily: it starts from the
buckets the largest batch needs and adds, one at a time, the candidate size (every
needed length rounded up to a multiple of ``align``, or to its limit) that most
lowers the simulated total at the given capacity (best of the live evictions tried),
until no size lowers it or ``max_buckets`` is reached. Every candidate is costed by a
replay of its key stream (:func:`~attnpolicy.modelling.simulation.replay_keys`); the
plan is compared with the base config's buckets (pow2) under LRU and under Belady.
No warm set is planned.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from operator import attrgetter
from typing import Any, Protocol

from attnpolicy.cache.key_stream import BELADY
from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CALL_KINDS, CallKind, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.bucket_schemes import base_scheme
from attnpolicy.modelling.simulation import (
    SimRow,
    decided_modes,
    key_stream,
    replay_keys,
    simulate_layouts,
    spec_of,
)
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.bucket_search import ALIGN, BucketListCost, CallShapes, evaluate, plan_sizes
from attnpolicy.planning.call_table import CallTable, tabled
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.workloads.batching import ScheduledBatch, Workload

#: A policy plan's simulated row (a level's).
#: The policies planned by default (each where its modes are legal; the guard falls back otherwise).
PLAN_POLICIES = ("varlen", "dynamic", "always-mask", "always-causal")
#: The live eviction strategies a plan tries by default.
PLAN_EVICTIONS = ("lru", "lfu", "fifo", "cost")
#: Candidates simulated with every eviction strategy (after LRU ranked them).
FINALISTS = 3
#: Compile-cost weights of the planner's candidate lists (see :func:`candidate_lists`).
COMPILE_WEIGHTS = (1, 8, 64)
#: After warm-up a compile is a strict-mode *warning*: traffic the trace did not hold
#: (or a warm set smaller than the plan) compiles and is counted, never refused.
PLAN_STRICT = "warn"


@dataclass(frozen=True)
class Candidate:
    """One bucket list tried: its capacity-free modelled seconds (every graph compiled
    once: no eviction does better), its graph count, and the simulated total per
    eviction strategy tried (none: skipped by the bound)."""

    buckets: tuple[int, ...]
    graphs: int
    bound_seconds: float
    totals: dict[str, float]


@dataclass(frozen=True)
class WarmShapeCost:
    """A graph of the warm set: its shape, the planned calls it serves, and its
    modelled compile seconds and bytes; ``load_seconds`` when a warm store holds it
    (warm-up loads it), else ``None``."""

    shape: WarmShape
    uses: int
    compile_seconds: float
    bytes: int
    load_seconds: float | None = None

    @property
    def seconds(self) -> float:
        """What warming it up costs: its load seconds from the store, else its compile seconds."""
        return self.compile_seconds if self.load_seconds is None else self.load_seconds


@dataclass(frozen=True)
class PolicyPlan:
    """The best bucket list and eviction found for one policy, the simulated row of
    that plan, the baselines (the base buckets with LRU and with Belady at the same
    capacity) and every candidate tried (none at the model level). ``fits``: the plan
    never evicts. ``buckets`` holds ``cover``, the sizes :func:`completed` added that no
    planned call uses. ``json_keys``: the (JSON key, attribute) pairs of :meth:`to_json`,
    its level's."""

    policy: str
    buckets: tuple[int, ...]
    cover: tuple[int, ...]
    eviction: str
    fits: bool
    row: SimRow
    baselines: tuple[SimRow, ...]
    candidates: tuple[Candidate, ...]
    json_keys: tuple[tuple[str, str], ...] = field(repr=False, compare=False)

    def baseline(self, eviction: str) -> SimRow:
        return next(r for r in self.baselines if r.eviction == eviction)

    @property
    def base_lru(self) -> SimRow:
        return self.baseline("lru")

    @property
    def base_belady(self) -> SimRow:
        return self.baseline(BELADY)

    @property
    def vs_lru(self) -> float:
        """The base buckets' total with LRU over the plan's (above 1: the plan is faster)."""
        return float(self.base_lru.total_seconds / self.row.total_seconds)

    @property
    def vs_belady(self) -> float:
        return float(self.base_belady.total_seconds / self.row.total_seconds)

    def to_json(self) -> dict[str, Any]:
        return _keyed(self, self.json_keys)


@dataclass(frozen=True)
class GraphPlan:
    """What ``attnpolicy plan`` chose at one level: per policy its :class:`PolicyPlan`,
    the chosen policy, its warm set (none at the model level) and the config that
    applies it. ``json_keys``: as :attr:`PolicyPlan.json_keys`."""

    policy: str
    max_graphs: int | None
    max_bytes: int | None
    warmup_seconds: float | None
    base_buckets: str
    policies: tuple[PolicyPlan, ...]
    warm: tuple[WarmShapeCost, ...]
    config: AttnPolicyConfig
    json_keys: tuple[tuple[str, str], ...] = field(repr=False, compare=False)

    @property
    def chosen(self) -> PolicyPlan:
        return next(p for p in self.policies if p.policy == self.policy)

    @property
    def warm_compile_seconds(self) -> float:
        return sum(w.compile_seconds for w in self.warm if w.load_seconds is None)

    @property
    def warm_load_seconds(self) -> float:
        return sum(w.load_seconds for w in self.warm if w.load_seconds is not None)

    @property
    def warm_json(self) -> list[dict[str, Any]]:
        """The warm set as JSON: a graph has ``from_disk`` and ``load_seconds`` only
        when a store was planned with."""
        store = self.config.store_dir is not None
        return [{**{k: v for k, v in asdict(w).items() if store or k != "load_seconds"},
                 "shape": w.shape.model_dump(mode="json"),
                 **({"from_disk": w.load_seconds is not None} if store else {})} for w in self.warm]

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON (the config as saved)."""
        return _keyed(self, self.json_keys)


def _keyed(obj: object, keys: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """``obj`` as JSON under ``keys`` ((JSON key, dotted attribute) pairs): a row or
    plan by its ``to_json``, a config as saved, a tuple as a list."""

    def value(v: Any) -> Any:
        if isinstance(v, tuple):
            return [value(x) for x in v]
        if isinstance(v, AttnPolicyConfig):
            return v.model_dump(mode="json")
        if hasattr(v, "to_json"):
            return v.to_json()
        return asdict(v) if is_dataclass(v) and not isinstance(v, type) else v

    return {key: value(attrgetter(name)(obj)) for key, name in keys}


def layouts_of(steps: Sequence[ScheduledBatch | BatchLayout]) -> list[BatchLayout]:
    return [s.layout if isinstance(s, ScheduledBatch) else s for s in steps]


def plannable(policy: str, base: AttnPolicyConfig) -> Guard:
    """The guarded ``policy`` as ``base`` configures it; :class:`ConfigError` unless its
    decisions depend on the layout alone (``stateless``): only then is its graph set a
    function of the trace."""
    options = base.policy_options if policy == base.policy else {}
    guard = Guard.for_policy(policy, options, on_illegal=base.on_illegal, fallback=MaskMode(base.fallback_mode))
    if not guard.stateless:
        raise ConfigError(f"policy {policy!r} decides from the cache state: its graph set cannot be planned "
                          f"from the trace; plan a stateless policy ({', '.join(PLAN_POLICIES)})")
    return guard


def decided_shapes(layouts: Sequence[BatchLayout], policy: str, base: AttnPolicyConfig,
                   model: CostModel) -> CallShapes:
    """The exact call shapes of ``layouts`` in the modes ``policy`` (guarded like a
    dispatcher under ``base``) decides."""
    guard = plannable(policy, base)
    ctx = PolicyContext(config=base, spec=model.spec, cost_model=model)
    return CallShapes.from_layouts(((layout, guard.decide(layout, ctx).mode) for layout in layouts), base)


def completed(sizes: Sequence[int], config: AttnPolicyConfig, modes: frozenset[MaskMode],
              longest_seq: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bucket list of the planned ``sizes`` under ``config``, and its *cover*: the
    sizes added that no call of the trace uses (its longest sequence: ``longest_seq``).

    A sequence is bucketed within ``max_seq_len``: when the planned sizes within it
    stop below ``longest_seq`` (the search gave the longest sequences a bucket above
    it, which only packed MASK rows may use), ``max_seq_len`` serves them. Under
    ``on_overflow="raise"`` a call longer than the trace's must still have a bucket
    (it compiles on demand, a strict-mode warning) rather than fail, which the cover
    holds: ``max_seq_len`` for a sequence, and ``max_batch_tokens`` for the packed rows
    of a MASK call when a batch can run in MASK mode (``modes``, see
    :attr:`~attnpolicy.policies.guard.Guard.modes`). Under ``"eager"`` such a call runs
    uncompiled and counted, and only a list with no size within ``max_seq_len`` gets
    it in its cover (a config needs one)."""
    seq = max((s for s in sizes if s <= config.max_seq_len), default=0)
    used, cover = set(sizes), set()
    if longest_seq > seq:
        used.add(config.max_seq_len)
    elif seq == 0 or (config.on_overflow == "raise" and seq < config.max_seq_len):
        cover.add(config.max_seq_len)
    if config.on_overflow == "raise" and MaskMode.MASK in modes and max(used) < config.max_batch_tokens:
        cover.add(config.max_batch_tokens)
    cover -= used
    return tuple(sorted(used | cover)), tuple(sorted(cover))


def longest_sequence(shapes: CallShapes) -> int:
    """The longest key length of ``shapes``' sequence calls (CAUSAL, VARLEN; 0: none)."""
    seq = shapes.kind != CALL_KINDS.index(CallKind.MASK)
    return int(shapes.kv[seq].max()) if seq.any() else 0


def limits(config: AttnPolicyConfig) -> dict[CallKind, int]:
    """The longest bucket each call kind's lengths may round up to under ``config``."""
    return {CallKind.CAUSAL: config.max_seq_len, CallKind.VARLEN: config.max_seq_len,
            CallKind.MASK: config.max_batch_tokens, CallKind.ROWS: config.max_seq_len}


def with_fields(base: AttnPolicyConfig, **fields: Any) -> AttnPolicyConfig:
    return AttnPolicyConfig.model_validate({**base.model_dump(mode="json"), **fields})


def candidate_lists(shapes: CallShapes, base: AttnPolicyConfig, model: CostModel,
                    max_buckets: int, align: int = ALIGN) -> list[BucketListCost]:
    """The bucket lists to simulate, each with its capacity-free modelled time: for
    every number of buckets up to ``max_buckets``, the planner's best list of sizes
    aligned to ``align`` (see :func:`~attnpolicy.planning.bucket_search.candidates`)
    under the model, and under the model with compiles :data:`COMPILE_WEIGHTS` times
    dearer (a bounded cache compiles a graph more than once: fewer, wider buckets);
    and the base config's own buckets, so that the plan is never worse than them
    under the same evictions."""
    lists: dict[tuple[int, ...], None] = {}
    for weight in COMPILE_WEIGHTS:
        weighted = model if weight == 1 else model.model_copy(update={"compile": {
            f: Fit(base=fit.base * weight, per_cell=fit.per_cell * weight, per_token=fit.per_token * weight)
            for f, fit in model.compile.items()}})
        lists.update((p.cost.sizes, None)
                     for p in plan_sizes(shapes, weighted, max_buckets, align=align, limits=limits(base)))
    if base.buckets.kind != "exact":
        own = base.buckets.sizes_up_to(base.max_batch_tokens)
        lists[own[:bisect_left(own, shapes.max_len) + 1]] = None
    return sorted((evaluate(shapes, sizes, model) for sizes in lists), key=lambda c: (len(c.sizes), c.sizes))


def plan_policy(steps: Sequence[ScheduledBatch | BatchLayout], policy: str, base: AttnPolicyConfig, model: CostModel,
                evictions: Sequence[str], max_buckets: int = 16, spec: TensorSpec | None = None,
                progress: Callable[[str], None] | None = None, rejected: int = 0,
                table: CallTable | None = None, align: int = ALIGN) -> PolicyPlan:
    """The best bucket list (sizes aligned to ``align``) and eviction for ``policy`` at
    ``base``'s capacity (``max_graphs``, ``max_bytes``), searched as the module
    docstring says, :func:`completed`; ``progress(label)`` is called after each
    simulation. ``table``: the policy's :class:`CallTable` of ``steps`` (built here
    when not given)."""
    capacity = base.max_graphs
    modes = plannable(policy, base).modes
    table = table or CallTable(layouts_of(steps), policy, base, model, spec)
    shapes = table.shapes()
    shapes_key = ("candidates", shapes.kind.tobytes(), shapes.q.tobytes(), shapes.kv.tobytes(),
                  shapes.count.tobytes(), shapes.rows.tobytes(), max_buckets, align)
    plans = table.by_content.get(shapes_key)
    if plans is None:
        plans = table.by_content[shapes_key] = candidate_lists(shapes, base, model, max_buckets, align)
    assert isinstance(plans, list)
    longest = longest_sequence(shapes)
    options = base.policy_options if policy == base.policy else {}

    def rows_of(cfg: AttnPolicyConfig, names: Sequence[str]) -> list[SimRow]:
        if not tabled(cfg):  # background compiles: pad-up depends on the cache, the dispatcher decides
            return simulate_layouts(steps, [policy], [capacity], names, cfg, model, spec, rejected=rejected)
        cfg = with_fields(cfg, policy=policy, policy_options=options, max_graphs=capacity)
        return table.rows(cfg, names, base_scheme(cfg).name, rejected)

    def simulate(sizes: tuple[int, ...], names: Sequence[str]) -> list[SimRow]:
        full = completed(sizes, base, modes, longest)[0]
        rows = rows_of(with_fields(base, buckets={"kind": "list", "sizes": list(full)}), names)
        if progress:
            progress(f"{policy} {len(sizes)} buckets {','.join(names)}")
        return rows

    rows: dict[tuple[int, ...], dict[str, SimRow]] = {}
    best = math.inf
    for p in sorted(plans, key=lambda p: p.total_seconds):
        if p.total_seconds >= best:
            continue
        row = simulate(p.sizes, ["lru"])[0]
        rows[p.sizes] = {"lru": row}
        best = min(best, row.total_seconds)
    others = [e for e in evictions if e != "lru"]
    ranked = sorted(rows, key=lambda s: rows[s]["lru"].total_seconds)[:FINALISTS]
    for sizes in ranked:
        if rows[sizes]["lru"].evictions and others:
            rows[sizes].update((r.eviction, r) for r in simulate(sizes, others))
    sizes, eviction = min(((s, e) for s in rows for e in rows[s]),
                          key=lambda se: (rows[se[0]][se[1]].total_seconds, se[1] != "lru"))
    row = rows[sizes][eviction]
    baselines = tuple(rows_of(base, ["lru", BELADY]))
    candidates = tuple(Candidate(p.sizes, p.graphs, p.total_seconds,
                                 {e: r.total_seconds for e, r in rows.get(p.sizes, {}).items()})
                       for p in plans)
    return PolicyPlan(policy, *completed(sizes, base, modes, longest), eviction, row.evictions == 0, row, baselines,
                      candidates, AttentionPlanLevel.policy_keys)


def graph_uses(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, model: CostModel,
               spec: TensorSpec | None = None, table: CallTable | None = None,
               store_warm: bool = False) -> list[WarmShapeCost]:
    """Every graph ``config``'s dispatcher requests for ``steps``, with its shape and the
    calls it serves, most used first (ties: cheaper to compile first). ``table``: the
    :class:`CallTable` of ``config``'s policy for ``steps`` (built when not given).
    ``store_warm``: ``config``'s store holds what one run of ``steps`` left on it, and
    a graph there gets its load seconds."""
    table = table or CallTable(layouts_of(steps), config.policy, config, model, spec)
    b, stream = table.cached(config)
    on_disk = stream.stored_after(config, config.eviction) if store_warm else set()
    graphs = []
    for i, (key, n) in enumerate(zip(b.keys, b.uses.tolist())):
        shape = WarmShape(kind=key.kind, q_bucket=int(b.q_bucket[i]), kv_bucket=int(b.kv_bucket[i]),
                          causal=bool(b.causal[i]), context=bool(b.context[i]), rows=key.rows)
        graphs.append(WarmShapeCost(shape, n, model.compile_seconds(key), model.graph_bytes(key),
                                model.load_seconds(key) if i in on_disk else None))
    return sorted(graphs, key=lambda g: (-g.uses, g.compile_seconds))


def evaluated(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, model: CostModel,
              spec: TensorSpec | None = None, rejected: int = 0) -> SimRow:
    """The simulated row of ``config`` (its policy, buckets, capacity and eviction) on
    ``steps``: a plan's row, on steps other than those it was planned on."""
    config = with_fields(config, warmup=[])
    if not tabled(config):
        return simulate_layouts(steps, [config.policy], [config.max_graphs], [config.eviction], config, model, spec,
                                rejected=rejected)[0]
    table = CallTable(layouts_of(steps), config.policy, config, model, spec)
    return table.rows(config, [config.eviction], base_scheme(config).name, rejected)[0]


def warm_set(graphs: Sequence[WarmShapeCost], max_graphs: int | None, max_bytes: int | None,
             budget_seconds: float | None) -> tuple[WarmShapeCost, ...]:
    """The graphs to compile (or load, from a warm store) at start: most uses per warm-up
    second first, skipping one that does not fit what is left of the budget, the
    capacity or the byte bound."""
    chosen: list[WarmShapeCost] = []
    seconds = 0.0
    nbytes = 0
    for g in sorted(graphs, key=lambda g: (-g.uses / max(g.seconds, 1e-12), -g.uses)):
        if max_graphs is not None and len(chosen) >= max_graphs:
            break
        if budget_seconds is not None and seconds + g.seconds > budget_seconds:
            continue
        if max_bytes is not None and nbytes + g.bytes > max_bytes:
            continue
        chosen.append(g)
        seconds += g.seconds
        nbytes += g.bytes
    return tuple(chosen)


class PlanSearch(Protocol):
    """One workload's search at one level (see :class:`PlanLevel`): ``plan(policy, ...)``
    its :class:`PolicyPlan`; ``warm_graphs(config, store_warm)``: every graph a planned
    config uses, most used first, for :func:`warm_set`."""

    def plan(self, policy: str, evictions: Sequence[str], max_buckets: int,
             progress: Callable[[str], None] | None, align: int) -> PolicyPlan: ...
    def warm_graphs(self, config: AttnPolicyConfig, store_warm: bool) -> list[WarmShapeCost]: ...


class PlanLevel(Protocol):
    """What differs between the levels in a plan: how a workload's policies are searched
    (``search``), the strict mode a plan's config runs in after warm-up (``strict``;
    ``None``: the base config's), and the JSON keys of a plan and of a policy's plan
    (:attr:`GraphPlan.json_keys`, :attr:`PolicyPlan.json_keys`)."""

    plan_keys: tuple[tuple[str, str], ...]
    policy_keys: tuple[tuple[str, str], ...]
    strict: str | None

    def search(self, steps: Sequence[ScheduledBatch | BatchLayout], base: AttnPolicyConfig,
                policies: Sequence[str]) -> PlanSearch: ...


def _same(*names: str) -> tuple[tuple[str, str], ...]:
    """(JSON key, attribute) pairs of attributes written under their own names."""
    return tuple((name, name) for name in names)


class AttentionPlanLevel:
    """Attention calls: candidate bucket lists simulated on each policy's
    :class:`CallTable` (the tables share their work), priced by ``model`` for ``spec``
    (default: the model's); ``rejected`` (requests the caller left out) is reported in
    every row. After warm-up a plan's config is :data:`PLAN_STRICT`."""

    plan_keys = (*_same("policy", "max_graphs", "max_bytes", "warmup_seconds", "base_buckets", "policies"),
                 ("warm", "warm_json"), ("config", "config"))
    policy_keys = _same("policy", "buckets", "cover", "eviction", "fits", "row", "baselines", "candidates")
    strict: str | None = PLAN_STRICT

    def __init__(self, model: CostModel, spec: TensorSpec | None = None, rejected: int = 0) -> None:
        self.model, self.spec, self.rejected = model, spec, rejected

    def search(self, steps: Sequence[ScheduledBatch | BatchLayout], base: AttnPolicyConfig,
                policies: Sequence[str]) -> _Tabled:
        return _Tabled(self, steps, base, policies)


class _Tabled:
    """:func:`plan_policy` and :func:`graph_uses` on one workload's shared call tables."""

    def __init__(self, level: AttentionPlanLevel, steps: Sequence[ScheduledBatch | BatchLayout],
                 base: AttnPolicyConfig, policies: Sequence[str]) -> None:
        self._level, self._steps, self._base = level, steps, base
        self._tables: dict[str, CallTable] = {}
        for p in policies:
            table = self._tables[p] = CallTable(layouts_of(steps), p, base, level.model, level.spec)
            for other in self._tables.values():
                table.share(other)

    def plan(self, policy: str, evictions: Sequence[str], max_buckets: int,
             progress: Callable[[str], None] | None, align: int) -> PolicyPlan:
        level = self._level
        return plan_policy(self._steps, policy, self._base, level.model, evictions, max_buckets, level.spec, progress,
                           level.rejected, self._tables[policy], align)

    def warm_graphs(self, config: AttnPolicyConfig, store_warm: bool) -> list[WarmShapeCost]:
        return graph_uses(self._steps, config, self._level.model, self._level.spec, self._tables[config.policy],
                          store_warm)


def plan_graphs(steps: Sequence[ScheduledBatch | BatchLayout], base: AttnPolicyConfig, level: PlanLevel,
                policies: Sequence[str] = PLAN_POLICIES, evictions: Sequence[str] = PLAN_EVICTIONS,
                warmup_seconds: float | None = None, max_buckets: int = 16,
                progress: Callable[[str], None] | None = None, store_warm: bool = False,
                align: int = ALIGN) -> GraphPlan:
    """Plan ``steps`` at ``base``'s capacity, as ``level`` searches: per policy its
    buckets and eviction, the best policy, its warm set within ``warmup_seconds``
    (modelled compile seconds; ``None``: as many as the capacity holds), and the config
    applying it. With ``base.store_dir`` the rows model its store (empty at start) and,
    with ``store_warm``, the warm set loads what it holds (see :func:`graph_uses`).
    Planned sizes are multiples of ``align`` (or a kind's limit)."""
    if not steps:
        raise ConfigError("a plan needs at least one step, got none (empty workload)")
    if warmup_seconds is not None and warmup_seconds < 0:
        raise ConfigError(f"warmup_seconds must be >= 0, got {warmup_seconds}")
    base = with_fields(base, warmup=[])  # a previous plan's warm set may not fit the new buckets
    search = level.search(steps, base, policies)
    per_policy = tuple(search.plan(p, evictions, max_buckets, progress, align) for p in policies)
    chosen = min(per_policy, key=lambda p: p.row.total_seconds)
    config = with_fields(base, policy=chosen.policy,
                         policy_options=base.policy_options if chosen.policy == base.policy else {},
                         buckets={"kind": "list", "sizes": list(chosen.buckets)}, eviction=chosen.eviction,
                         **({} if level.strict is None else {"strict": level.strict}))
    warm = warm_set(search.warm_graphs(config, store_warm), base.max_graphs, base.max_bytes, warmup_seconds)
    config = with_fields(config, warmup=[w.shape.model_dump(mode="json") for w in warm])
    return GraphPlan(chosen.policy, base.max_graphs, base.max_bytes, warmup_seconds, base.buckets.describe(),
                     per_policy, warm, config, level.plan_keys)


def _seconds(x: float) -> str:
    return f"{x:.4g}"


def describe_buckets(plan: PolicyPlan) -> str:
    """``plan``'s buckets, the cover (:func:`completed`) apart: ``[16, 880] + cover [8192]``."""
    planned = [b for b in plan.buckets if b not in plan.cover]
    return f"{planned}" + (f" + cover {list(plan.cover)}" if plan.cover else "")


def plan_markdown(plan: GraphPlan, source: str, workload: Workload | None = None) -> str:
    """The plan report (``plan.md``): the workload planned (when given: its requests,
    rejections and batches), what was chosen and the predicted totals against the base
    buckets with LRU and with Belady at the same capacity."""
    cap = "∞" if plan.max_graphs is None else str(plan.max_graphs)
    nbytes = "∞" if plan.max_bytes is None else str(plan.max_bytes)
    chosen = plan.chosen
    fits = " (every graph fits: nothing is evicted)" if chosen.fits else ""
    base = plan.base_buckets
    budget = "none (the capacity)" if plan.warmup_seconds is None else f"{_seconds(plan.warmup_seconds)} s"
    served = sum(w.uses for w in plan.warm)
    lines = [f"# Graph plan: {source}", ""]
    if workload is not None:
        lines += [f"Workload: {workload.describe()}."
                  + (f" **{workload.why_rejected}**: left out of the plan." if workload.why_rejected else ""), ""]
    lines += [
        (f"Capacity: max_graphs {cap}, max_bytes {nbytes}. Chosen policy **{plan.policy}**, buckets "
        f"{describe_buckets(chosen)} ({len(chosen.buckets)} buckets), eviction **{chosen.eviction}**{fits}."), "",
        "## Predicted totals (modelled seconds, compile + run)", "",
        (f"| policy | planned buckets | eviction | distinct graphs | peak graphs held | plan total | {base} + lru "
         f"| {base} + belady | vs lru | vs belady |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plan.policies:
        lines.append(f"| {p.policy} | {describe_buckets(p)} | {p.eviction} | {p.row.distinct_keys} "
                     f"| {p.row.peak_graphs} | {_seconds(p.row.total_seconds)} | {_seconds(p.base_lru.total_seconds)} "
                     f"| {_seconds(p.base_belady.total_seconds)} | {p.vs_lru:.2f}× | {p.vs_belady:.2f}× |")
    lines += [
        "",
        ("planned buckets: multiples of the alignment that serve every call of the trace, the last one its "
         "longest length rounded up; cover: sizes added so that, under on_overflow=\"raise\", a longer call "
         "than the trace's still has a bucket (max_seq_len for a sequence, max_batch_tokens for the packed rows "
         "of a policy that makes MASK calls); no planned call uses them. "
         "distinct graphs: the graphs the plan's calls ask for over the whole run, each compiled at least once "
         "(more than the capacity holds: some are evicted and compiled again); peak graphs held: the most the "
         "cache held at once, within the capacity. vs lru, vs belady: the baseline's total over the plan's "
         "(above 1: the plan is faster). Belady is the offline optimum of eviction for the baseline buckets."),
        "",
        f"## Warm-up set: {len(plan.warm)} graphs, {_seconds(plan.warm_compile_seconds)} modelled compile seconds"
        + (f", {_seconds(plan.warm_load_seconds)} load seconds ({sum(w.load_seconds is not None for w in plan.warm)}"
           " from the store)" if plan.config.store_dir is not None else ""),
        "",
        (f"Budget: {budget}. Calls served: {served} of {chosen.row.calls}. After warm-up, strict mode is "
        f"`{plan.config.strict}`: a compile the plan did not foresee is counted and warned about, never refused."),
        "",
        "| family | rows | q bucket | kv bucket | causal | context | uses | compile s |"
        + (" from disk (load s) |" if plan.config.store_dir is not None else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if plan.config.store_dir is not None else ""),
    ]
    lines += [f"| {w.shape.kind.value} | {w.shape.rows} | {w.shape.q_bucket} | {w.shape.kv_bucket} | {w.shape.causal} "
              f"| {w.shape.context} | {w.uses} | {_seconds(w.compile_seconds)} |"
              + ((f" {_seconds(w.load_seconds)} |" if w.load_seconds is not None else " no |")
                 if plan.config.store_dir is not None else "") for w in plan.warm]
    lines += ["", f"## Candidates of {plan.policy}", "",
              "| buckets | graphs (all kept) | modelled s (all kept) | simulated s per eviction |", "|---|---|---|---|"]
    lines += [f"| {list(c.buckets)} | {c.graphs} | {_seconds(c.bound_seconds)} | "
              f"{', '.join(f'{e} {_seconds(s)}' for e, s in c.totals.items()) or 'skipped (bound)'} |"
              for c in chosen.candidates]
    return "\n".join(lines) + "\n"


# -- whole-model graphs ------------------------------------------------------------------


class WholeModelPlanLevel:
    """Whole-model graphs: per policy a bucket list grown greedily (see the module
    docstring), each candidate priced by a replay of its key stream on ``model``; no
    warm set. A policy's plan has no cover and no candidates."""

    plan_keys = (("policy", "policy"), ("buckets", "chosen.buckets"), ("eviction", "chosen.eviction"),
                 *_same("max_graphs", "policies"))
    policy_keys = (*_same("policy", "buckets", "row", "base_lru", "base_belady"), ("speedup_vs_base_lru", "vs_lru"))
    strict: str | None = None

    def __init__(self, model: ModelCostModel) -> None:
        self.model = model

    def search(self, steps: Sequence[ScheduledBatch | BatchLayout], base: AttnPolicyConfig,
                policies: Sequence[str]) -> _Greedy:
        return _Greedy(self.model, layouts_of(steps), base)


def _needs(layouts: Sequence[BatchLayout], modes: Sequence[MaskMode]) -> tuple[list[int], list[int]]:
    """The lengths bucketed by ``max_seq_len`` (CAUSAL totals, VARLEN sequences, ROWS's
    longest row) and by ``max_batch_tokens`` (MASK totals)."""
    seq: list[int] = []
    batch: list[int] = []
    for layout, mode in zip(layouts, modes):
        if mode is MaskMode.VARLEN:
            seq += layout.q_lens
        elif mode is MaskMode.ROWS:
            seq.append(max(layout.q_lens))
        elif mode is MaskMode.CAUSAL:
            seq.append(sum(layout.q_lens))
        else:
            batch.append(sum(layout.q_lens))
    return seq, batch


def greedy_plan(layouts: Sequence[BatchLayout], policy: str, base: AttnPolicyConfig, model: ModelCostModel,
                evictions: Sequence[str], max_buckets: int, align: int = ALIGN) -> PolicyPlan:
    """The greedy bucket list of ``policy`` (see the module docstring)."""
    if align < 1:
        raise ConfigError(f"align must be >= 1, got {align}")

    def _up(n: int, limit: int) -> int:
        return min(-(-n // align) * align, limit)

    with_policy = base.model_copy(update={"policy": policy})
    modes = decided_modes(layouts, with_policy, spec_of(model))
    seq, batch = _needs(layouts, modes)
    limit_seq, limit_batch = base.max_seq_len, base.max_batch_tokens
    required = {_up(max(seq), limit_seq)} if seq else set()
    if batch:
        required.add(_up(max(batch), limit_batch))
    if min(required) > limit_seq:  # a list needs a size within max_seq_len
        required.add(limit_seq)
    candidates = sorted({_up(n, limit_seq) for n in seq} | {_up(n, limit_batch) for n in batch})

    def cost(sizes: set[int]) -> SimRow:
        config = AttnPolicyConfig(**{**with_policy.model_dump(),
                                     "buckets": Buckets(kind="list", sizes=tuple(sorted(sizes)))})
        keys = key_stream(layouts, modes, config)
        return min((replay_keys(keys, model, config, e, batches=len(layouts)) for e in evictions),
                   key=lambda r: r.total_seconds)

    chosen, best = set(required), cost(required)
    while len(chosen) < max_buckets:
        trials = [(cost(chosen | {c}), c) for c in candidates if c not in chosen]
        if not trials:
            break
        row, c = min(trials, key=lambda t: t[0].total_seconds)
        if row.total_seconds >= best.total_seconds:
            break
        chosen.add(c)
        best = row
    base_keys = key_stream(layouts, decided_modes(layouts, with_policy, spec_of(model)), with_policy)
    return PolicyPlan(policy, tuple(sorted(chosen)), (), best.eviction, best.evictions == 0, best,
                      tuple(replay_keys(base_keys, model, with_policy, e, batches=len(layouts))
                            for e in ("lru", BELADY)), (),
                      WholeModelPlanLevel.policy_keys)


class _Greedy:
    """:func:`greedy_plan` on one workload's layouts."""

    def __init__(self, model: ModelCostModel, layouts: Sequence[BatchLayout], base: AttnPolicyConfig) -> None:
        self._model, self._layouts, self._base = model, layouts, base

    def plan(self, policy: str, evictions: Sequence[str], max_buckets: int,
             progress: Callable[[str], None] | None, align: int) -> PolicyPlan:
        """``policy``'s :func:`greedy_plan`; ``progress(policy)`` when done."""
        plan = greedy_plan(self._layouts, policy, self._base, self._model, evictions, max_buckets, align)
        if progress:
            progress(policy)
        return plan

    def warm_graphs(self, config: AttnPolicyConfig, store_warm: bool) -> list[WarmShapeCost]:
        return []  # no warm-up is modelled at this level
