"""The report's answer: the configuration to run, from ``attnpolicy plan``.

The sweep's online rows (live evictions, not Belady) give the frontier the user
chooses on: the *fastest* row, and the *leanest* row (least peak graph memory)
whose total is within :data:`LEANEST_TOLERANCE` of it. The plan runs at the bound
(capacity, byte budget) of the leanest such row among the policies a plan can run
(stateless ones), with that bound's fastest sweep row's bucket scheme as its base:
:func:`~attnpolicy.planning.graph_set.plan_graphs` tries those buckets beside its
own lists (at most ``max_buckets`` sizes), so the plan is not slower than the
sweep at that bound unless no list can express the scheme (``exact``). It chooses
the policy, buckets, eviction and warm set, and its config is saved where the
report writes (``DIR/config``). The plan's total is set against the defaults
(``varlen``, pow2 buckets, unbounded, LRU), against its base scheme + LRU at the
same bound, and against the fastest and the leanest rows; :func:`explain` says in
one sentence why it is not the fastest or the leanest row. The simulator's error
on this machine comes from the validation (predicted vs measured on the same
batches).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from attnpolicy.cache.key_stream import BELADY
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.bucket_schemes import BucketScheme
from attnpolicy.modelling.simulation import SimRow, simulate_layouts
from attnpolicy.planning.graph_set import (
    FINALISTS,
    PLAN_POLICIES,
    AttentionPlanLevel,
    GraphPlan,
    plan_graphs,
    plan_markdown,
    plannable,
    with_fields,
)
from attnpolicy.report.units import bound_text, human_bytes
from attnpolicy.workloads.batching import ScheduledBatch, Workload

#: A row is "as good" as the sweep's fastest when its total is within this fraction.
LEANEST_TOLERANCE = 0.10
#: Totals closer than this fraction are "as fast" in :func:`explain` (no "0 % slower").
SAME = 0.005
#: Above this relative error (compile or total seconds) the report warns that its
#: predicted seconds are rough.
TRUST_LIMIT = 0.20
#: The config directory under the report's output directory.
CONFIG_DIR = "config"
#: The names of the first screen's rows, in their order.
RECOMMENDED, FASTEST, LEANEST = "recommended", "fastest", f"leanest within {LEANEST_TOLERANCE:.0%}"


class Checked(Protocol):
    """A validation row: predicted and measured seconds of one replay."""

    @property
    def predicted_compile_seconds(self) -> float: ...
    @property
    def measured_compile_seconds(self) -> float: ...
    @property
    def predicted_total_seconds(self) -> float: ...
    @property
    def measured_total_seconds(self) -> float: ...


@dataclass(frozen=True)
class SimulatorError:
    """Predicted / measured - 1 over the validated policies, summed (``None``: nothing
    measured); ``trusted``: both within :data:`TRUST_LIMIT`."""

    compile: float | None
    total: float | None
    trusted: bool


@dataclass(frozen=True)
class Recommendation:
    """What the report recommends and what it is predicted to save. ``base_buckets``:
    the bucket scheme the plan started from (that of the fastest sweep row at its
    bound), whose LRU row at the same bound it is set against; ``peak_graphs``: the
    most graphs held at once; ``distinct_graphs``: the distinct graphs compiled."""

    policy: str
    buckets: tuple[int, ...]
    max_graphs: int | None
    max_bytes: int | None
    eviction: str
    warm_graphs: int
    warm_compile_seconds: float
    warm_calls: int
    calls: int
    total_seconds: float
    peak_bytes: int
    peak_graphs: int
    distinct_graphs: int
    hit_rate: float
    default_total_seconds: float
    default_peak_bytes: int
    base_buckets: str
    base_lru_total_seconds: float
    base_lru_peak_bytes: int
    config_dir: str
    apply: tuple[str, ...]
    plan_seconds: float
    simulator_error: SimulatorError

    @property
    def saving_vs_defaults(self) -> float:
        """1 - plan total / defaults' total (above 0: the plan is faster)."""
        return 1 - self.total_seconds / self.default_total_seconds

    @property
    def saving_vs_base_lru(self) -> float:
        return 1 - self.total_seconds / self.base_lru_total_seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "saving_vs_defaults": self.saving_vs_defaults,
                "saving_vs_base_lru": self.saving_vs_base_lru}


@dataclass(frozen=True)
class NamedRow:
    """A row of the first screen: ``name`` (:data:`RECOMMENDED`, :data:`FASTEST`,
    :data:`LEANEST`), its configuration (``buckets``: a sweep row's scheme, or how the
    plan's list came about), its total, its total over the fastest row's, its peak
    graph bytes, the most graphs it held at once, the distinct graphs it compiled and
    its hit rate."""

    name: str
    policy: str
    buckets: str
    capacity: int | None
    max_bytes: int | None
    eviction: str
    total_seconds: float
    vs_fastest: float
    peak_bytes: int
    peak_graphs: int
    distinct_graphs: int
    hit_rate: float

    @classmethod
    def of_row(cls, name: str, row: SimRow, fastest: SimRow) -> NamedRow:
        return cls(name, row.policy, row.buckets, row.capacity, row.max_bytes, row.eviction, row.total_seconds,
                   row.total_seconds / fastest.total_seconds, row.peak_bytes, row.peak_graphs, row.distinct_keys,
                   row.hit_rate)


@dataclass(frozen=True)
class Frontier:
    """The first screen's rows (recommended, fastest, leanest within :data:`LEANEST_TOLERANCE`)
    and :func:`explain`'s sentence (``None``: the recommendation is as fast as the
    fastest row and holds as much graph memory as the leanest)."""

    rows: tuple[NamedRow, NamedRow, NamedRow]
    why: str | None

    def to_json(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "why": self.why}


def plannable_policies(policies: Sequence[str], base: AttnPolicyConfig) -> tuple[str, ...]:
    """The swept policies a plan can choose (stateless ones); the planner's defaults
    when none is."""
    def ok(name: str) -> bool:
        try:
            plannable(name, base)
        except (ConfigError, PolicyError):
            return False
        return True

    return tuple(p for p in policies if ok(p)) or PLAN_POLICIES


def online(rows: Sequence[SimRow], policies: Sequence[str] | None = None) -> list[SimRow]:
    """The rows a runtime can run (live evictions, not Belady), of ``policies`` (all: ``None``)."""
    return [r for r in rows if r.eviction != BELADY and (policies is None or r.policy in policies)]


def fastest_row(rows: Sequence[SimRow]) -> SimRow:
    """The row of least total seconds (the first of equals); ``rows``: online rows."""
    if not rows:
        raise ConfigError("the sweep has no online row (every eviction is belady): nothing to recommend")
    return min(rows, key=lambda r: r.total_seconds)


def leanest_row(rows: Sequence[SimRow]) -> SimRow:
    """The row of least peak graph bytes (then least total, then first) among those
    within :data:`LEANEST_TOLERANCE` of the fastest; ``rows``: online rows."""
    limit = (1 + LEANEST_TOLERANCE) * fastest_row(rows).total_seconds
    return min((r for r in rows if r.total_seconds <= limit), key=lambda r: (r.peak_bytes, r.total_seconds))


def plan_bound(rows: Sequence[SimRow], policies: Sequence[str]) -> tuple[int | None, int | None]:
    """The (capacity, max_bytes) of the :func:`leanest_row` of the online rows of
    ``policies``; unbounded when the sweep has none."""
    candidates = online(rows, policies)
    if not candidates:
        return None, None
    pick = leanest_row(candidates)
    return pick.capacity, pick.max_bytes


def seed_row(rows: Sequence[SimRow], policies: Sequence[str], bound: tuple[int | None, int | None]) -> SimRow | None:
    """The fastest online row of ``policies`` at ``bound``: its bucket scheme is the
    plan's base (``None``: no such row)."""
    at = [r for r in online(rows, policies) if (r.capacity, r.max_bytes) == bound]
    return fastest_row(at) if at else None


def plan_buckets(buckets: Sequence[int], base: Buckets, base_name: str, max_len: int, extra: Sequence[int]) -> str:
    """How the plan's ``buckets`` came about: ``base_name`` when, but for the ``extra``
    sizes every plan covers, they are its base scheme's first sizes; else ``planned``
    with their count."""
    if base.kind != "exact":
        kept = tuple(b for b in buckets if b not in extra)
        own = tuple(b for b in base.sizes_up_to(max_len) if b not in extra)
        if kept and kept == own[:len(kept)]:
            return f"{base_name} (kept by the plan)"
    return f"planned, {len(buckets)} sizes"


def _percent(x: float) -> str:
    return f"{abs(x):.0%}"


def explain(rec: NamedRow, fastest: SimRow, leanest: SimRow, seed: SimRow | None, policies: Sequence[str],
            max_buckets: int, seed_lru: float | None = None) -> str | None:
    """One sentence: how much slower (or faster) than the fastest row the recommendation
    is and why, and how its peak graph memory compares with the leanest row's and why;
    ``None`` when it is as fast as the one and holds as much as the other. ``seed``:
    the sweep row whose buckets the plan started from, ``seed_lru``: the plan's total
    for those buckets with LRU at its bound; ``policies``: those a plan can run."""
    ratio = rec.vs_fastest
    if abs(ratio - 1) <= SAME and rec.peak_bytes == leanest.peak_bytes:
        return None
    bound = bound_text(rec.capacity, rec.max_bytes)
    if ratio > 1 + SAME:
        speed = f"{_percent(ratio - 1)} slower than the fastest row ({fastest.total_seconds:.4g} s)"
    elif ratio < 1 - SAME:
        speed = f"{_percent(1 - ratio)} faster than the fastest row ({fastest.total_seconds:.4g} s)"
    else:
        speed = "as fast as the fastest row"
    reasons = []
    if ratio < 1 - SAME:
        reasons.append("its planned buckets beat every swept scheme")
    if ratio > 1 + SAME:
        if fastest.policy not in policies:
            reasons.append(f"the fastest row's `{fastest.policy}` decides from the cache state, so no plan "
                           "can fix its graphs")
        if (rec.capacity, rec.max_bytes) != (fastest.capacity, fastest.max_bytes):
            reasons.append(f"the plan runs at {bound}, the leanest bound within {LEANEST_TOLERANCE:.0%} of the "
                           "fastest row a plan can run, where the fastest row holds "
                           f"{bound_text(fastest.capacity, fastest.max_bytes)}")
        if seed is not None and rec.total_seconds > (1 + SAME) * seed.total_seconds:
            lru = "" if seed_lru is None else f"{seed.buckets} + LRU takes {seed_lru:.4g} s there and "
            cause = ("exact buckets, one graph per length, are no list a plan can hold"
                     if seed.buckets == "exact" else
                     f"{lru}the plan tries evictions other than LRU on its {FINALISTS} best lists only")
            reasons.append(f"its buckets (lists of at most {max_buckets} planned sizes, or {seed.buckets}'s) "
                           f"are {_percent(rec.total_seconds / seed.total_seconds - 1)} slower than the sweep's "
                           f"{seed.buckets} row at that bound ({seed.total_seconds:.4g} s), as {cause}")
    sentence = f"The recommendation is {speed}" + (": " + "; ".join(reasons) if reasons else "")
    memory = (f"{human_bytes(rec.peak_bytes)} of graphs at peak ({rec.peak_graphs} held, {rec.distinct_graphs} "
              f"compiled) against the leanest row's {human_bytes(leanest.peak_bytes)} ({leanest.peak_graphs} held, "
              f"{leanest.distinct_keys} compiled)")
    joint = "; it" if reasons else ", and it"
    if rec.peak_bytes > leanest.peak_bytes:
        why = (f"the leanest row's `{leanest.policy}` decides from the cache state, so no plan can fix its graphs"
               if leanest.policy not in policies else "the plan minimises time at its bound, not memory")
        sentence += f"{joint} holds {memory}: {why}"
    elif rec.peak_bytes < leanest.peak_bytes:
        sentence += f"{joint} holds less: {memory}"
    return sentence + "."


def _relative(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1 if measured > 0 else None


def simulator_error(validation: Sequence[Checked]) -> SimulatorError:
    """Summed predicted over summed measured seconds, minus 1, of the validation rows."""
    compile_err = _relative(sum(v.predicted_compile_seconds for v in validation),
                            sum(v.measured_compile_seconds for v in validation))
    total_err = _relative(sum(v.predicted_total_seconds for v in validation),
                          sum(v.measured_total_seconds for v in validation))
    trusted = all(e is not None and abs(e) <= TRUST_LIMIT for e in (compile_err, total_err))
    return SimulatorError(compile_err, total_err, trusted)


def apply_commands(config_dir: Path) -> tuple[str, ...]:
    """The commands that use the saved config: a replay that checks it, and a runtime."""
    return (f"attnpolicy run --config {config_dir} --check --limit 20",
            f"ATTNPOLICY_CONFIG={config_dir} vllm serve MODEL")


def recommend(steps: Sequence[ScheduledBatch], rows: Sequence[SimRow], base: AttnPolicyConfig, model: CostModel,
              policies: Sequence[str], evictions: Sequence[str], validation: Sequence[Checked], out: Path,
              max_buckets: int, source: str, schemes: Sequence[BucketScheme],
              workload: Workload | None = None) -> tuple[Recommendation, GraphPlan, Frontier]:
    """Plan ``steps`` at the sweep's :func:`plan_bound`, from the buckets of its
    :func:`seed_row` (``schemes``: the sweep's bucket schemes, by name), save the
    config (and the plan's ``plan.md``, ``plan.json``) under ``out / CONFIG_DIR``,
    compare it with the defaults and with its base buckets + LRU at the same bound,
    and name it beside the sweep's fastest and leanest rows (:class:`Frontier`).
    ``workload``: what the batch former made of the trace (its rejected requests are
    counted in every row)."""
    rejected = workload.rejected if workload else 0
    start = time.perf_counter()
    candidates = plannable_policies(policies, base)
    capacity, nbytes = plan_bound(rows, candidates)
    seed = seed_row(rows, candidates, (capacity, nbytes))
    by_name = {s.name: s for s in schemes}
    if seed is not None and seed.buckets not in by_name:
        raise ConfigError(f"the sweep row's bucket scheme {seed.buckets!r} is none of the schemes given "
                          f"({', '.join(by_name) or 'none'})")
    origin = by_name[seed.buckets] if seed is not None else None
    at = with_fields(base, max_graphs=capacity, max_bytes=nbytes,
                     **({} if origin is None else {"buckets": origin.buckets.model_dump(mode="json")}))
    live = [e for e in evictions if e != BELADY] or ["lru"]
    plan = plan_graphs(steps, at, AttentionPlanLevel(model, rejected=rejected), candidates, live, None, max_buckets)
    (defaults,) = simulate_layouts(steps, ["varlen"], [None], ["lru"], base, model, rejected=rejected)
    config_dir = out / CONFIG_DIR
    plan.config.save(config_dir)
    write_json(config_dir / "plan.json", {"source": source, "rejected": rejected,
                                          **({"workload": workload.to_json()} if workload else {}),
                                          **plan.to_json()})
    write_text_atomic(config_dir / "plan.md", plan_markdown(plan, source, workload))
    chosen, own = plan.chosen, plan.chosen.baseline("lru")
    rec = Recommendation(
        policy=plan.policy, buckets=chosen.buckets, max_graphs=capacity, max_bytes=nbytes,
        eviction=chosen.eviction, warm_graphs=len(plan.warm), warm_compile_seconds=plan.warm_compile_seconds,
        warm_calls=sum(w.uses for w in plan.warm), calls=chosen.row.calls,
        total_seconds=chosen.row.total_seconds, peak_bytes=chosen.row.peak_bytes,
        peak_graphs=chosen.row.peak_graphs, distinct_graphs=chosen.row.distinct_keys, hit_rate=chosen.row.hit_rate,
        default_total_seconds=defaults.total_seconds, default_peak_bytes=defaults.peak_bytes,
        base_buckets=own.buckets if origin is None else origin.name,
        base_lru_total_seconds=own.total_seconds, base_lru_peak_bytes=own.peak_bytes,
        config_dir=str(config_dir), apply=apply_commands(config_dir),
        plan_seconds=time.perf_counter() - start, simulator_error=simulator_error(validation))
    seed_lru = None if seed is None else next(
        (p.baseline("lru").total_seconds for p in plan.policies if p.policy == seed.policy), None)
    return rec, plan, frontier(rec, rows, at, seed, candidates, max_buckets, seed_lru)


def frontier(rec: Recommendation, rows: Sequence[SimRow], at: AttnPolicyConfig, seed: SimRow | None,
             policies: Sequence[str], max_buckets: int, seed_lru: float | None = None) -> Frontier:
    """The first screen's rows: ``rec`` (planned at ``at``, from ``seed``'s buckets,
    which take ``seed_lru`` seconds in the plan with LRU), the fastest online row of
    ``rows`` and the leanest within :data:`LEANEST_TOLERANCE` of it, with :func:`explain`'s
    sentence."""
    runnable = online(rows)
    fastest = fastest_row(runnable)
    leanest = leanest_row(runnable)
    buckets = plan_buckets(rec.buckets, at.buckets, rec.base_buckets, at.max_batch_tokens,
                           (at.max_seq_len, at.max_batch_tokens))
    named = NamedRow(RECOMMENDED, rec.policy, buckets, rec.max_graphs, rec.max_bytes, rec.eviction, rec.total_seconds,
                  rec.total_seconds / fastest.total_seconds, rec.peak_bytes, rec.peak_graphs, rec.distinct_graphs,
                  rec.hit_rate)
    return Frontier((named, NamedRow.of_row(FASTEST, fastest, fastest), NamedRow.of_row(LEANEST, leanest, fastest)),
                    explain(named, fastest, leanest, seed, policies, max_buckets, seed_lru))
