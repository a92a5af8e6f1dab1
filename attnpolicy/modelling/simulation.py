"""Replay a workload with a cost model instead of compute: fast enough to sweep
bucket schemes × policies × cache bounds × evictions.

A configuration runs a real :class:`~attnpolicy.dispatch.Dispatcher` (decision,
guard, plan, graph cache) over the batches of a
:class:`~attnpolicy.workloads.batching.BatchFormer`, with a builder that compiles nothing:
a miss is charged the model's compile seconds, and every call its modelled cost
(:class:`~attnpolicy.graphs.batch_cost.BatchCost`: run seconds plus the dispatch
overhead, and a host mask build for a MASK call whose mask the dispatcher's mask
cache would not hold). Hits, misses and evictions are therefore exactly those of
a real run of the same batches and config.

A policy whose decisions do not depend on the cache (``stateless``: every fixed
policy) requests the same graphs under any bound and eviction, and its attention
seconds, mask builds and overflows do not depend on them either: its dispatcher
runs once, unbounded, recording the key stream, and each bound × eviction replays
that stream through the eviction alone (:func:`~attnpolicy.cache.key_stream.replay_stream`),
with the counters the dispatcher's cache would report. A cache-aware policy
(``cost-aware``) runs its dispatcher per configuration; those runs go to worker
processes (``workers``), each process's side by side: every batch goes through
each of them in turn, planned once for all by one shared planner, which also keeps
the policy's cache-independent pricing (every dispatcher still has its own policy,
cache and counters).

``belady`` is the offline optimum: the key sequence of the policy's LRU run at the
same bounds is replayed through Belady's strategy (evict the graph needed
farthest in the future). For a stateless policy that sequence is the one it always
requests, so the row is the fewest misses any eviction could achieve (with a
``max_graphs`` bound; with ``max_bytes`` and unequal sizes it is a heuristic). A
cache-aware policy chooses differently under another cache; its belady row is the
bound for the sequence it chose under LRU. Every row also carries
``bound_seconds``: its attention seconds plus each distinct graph compiled once,
a lower bound on the total of any eviction and bound for the same decisions. A
config with ``store_dir`` models its graph store (:mod:`attnpolicy.modelling.tiers`).
See ``docs/simulate.md``.

On whole-model graphs (the ``model`` family: one graph per forward of a
:class:`~attnpolicy.engine.runner.StaticModelRunner`, priced by a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`; :func:`replay_key_streams`
over the configs of :func:`sweep_configs`; same :class:`SimRow`, whole-model JSON keys) the
batches are the key stream the runner would request: each batch's mode is the guarded
policy's decision (as the runner's), its key the runner's own
:func:`~attnpolicy.engine.keys.step_keys`, and the stream is replayed by
:func:`~attnpolicy.cache.key_stream.replay_stream` with the runner's cache bounds and
eviction, the graphs' bytes being the runner's own estimate: the misses, compiles and
evictions are those a real runner replay of the same batches counts (tested). Seconds
come from the cost model: a compile per miss, a run per batch, and the process's one-off
``warmup_seconds`` once when anything compiles. The runner serves prefill without cached
context, so the batches are prefill-only (an embedding-style workload:
:func:`~attnpolicy.workloads.batching.model_former`).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from attnpolicy.cache.eviction_registry import eviction_registry
from attnpolicy.cache.graph_cache import CacheStats, GraphCache
from attnpolicy.cache.key_stream import BELADY, StreamStats, next_uses, replay_stream
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey, step_keys
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.modelling.bucket_schemes import BucketScheme, base_scheme
from attnpolicy.modelling.streams import KeyStream
from attnpolicy.modelling.tiers import StoredRuns, StoreFigures, StoreModel
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.layout_stream import LayoutRun
from attnpolicy.workloads.traces import Request

if TYPE_CHECKING:
    from attnpolicy.dispatch import Dispatcher

@dataclass(frozen=True)
class SimRow:
    """One simulated (bucket scheme, policy, bounds, eviction) at either level: cache
    counters and modelled seconds.

    ``buckets`` names the bucket scheme; ``capacity`` is ``max_graphs`` and
    ``max_bytes`` the byte bound (``None``: unbounded); ``run_seconds`` are the batches'
    (at the attention level its calls' with dispatch overheads and mask builds, also
    given alone as ``mask_build_seconds``); ``compile_seconds`` the cache's compiles and
    ``warmup_seconds`` the cost model's one-off backend start-up, charged when the row
    compiles anything (:attr:`compile_with_warmup_seconds`: both); ``total_seconds``: run plus
    those (plus a modelled store's loads); ``distinct_keys``: the graphs used.

    At the attention level only: ``bound_seconds`` is run seconds plus each distinct
    graph's compile once (no eviction or bound does better for these decisions) and
    ``bound_gap`` is ``total / bound - 1``; ``modes`` counts batches per mode;
    ``policy_options`` are the options the policy ran with; ``rejected`` counts the
    requests the batch former left out (too long); ``store`` (a modelled graph store
    only, else not in the JSON): the misses the disk served, their ``load_seconds`` in
    ``total_seconds``. ``json_keys``: the (JSON key, attribute) pairs of :meth:`to_json`,
    its level's."""

    policy: str
    buckets: str
    capacity: int | None
    max_bytes: int | None
    eviction: str
    hits: int
    misses: int
    compiles: int
    compile_seconds: float
    warmup_seconds: float
    run_seconds: float
    total_seconds: float
    peak_bytes: int
    peak_graphs: int
    evictions: int
    distinct_keys: int
    batches: int
    json_keys: tuple[tuple[str, str], ...] = field(repr=False, compare=False)
    calls: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    guard_fallbacks: int = 0
    overflow_calls: int = 0
    mask_builds: int = 0
    mask_build_seconds: float = 0.0
    bound_seconds: float = 0.0
    bound_gap: float = 0.0
    policy_options: dict[str, Any] = field(default_factory=dict)
    rejected: int = 0
    store: StoreFigures | None = None

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    @property
    def compile_with_warmup_seconds(self) -> float:
        """Compile seconds with the backend start-up."""
        return self.compile_seconds + self.warmup_seconds

    def to_json(self) -> dict[str, Any]:
        """The row as JSON: its level's keys (``store`` too when one was modelled)."""
        out = {key: getattr(self, name) for key, name in self.json_keys}
        return out if self.store is None else {**out, "store": asdict(self.store)}


def own_keys(*names: str) -> tuple[tuple[str, str], ...]:
    """(JSON key, attribute) pairs of attributes written under their own names."""
    return tuple((name, name) for name in names)


#: The JSON keys of an attention-level row (:attr:`SimRow.json_keys`).
ATTENTION_KEYS = (*own_keys("policy", "buckets", "capacity", "max_bytes", "eviction", "hits", "misses", "hit_rate",
                            "compiles"), ("compile_seconds", "compile_with_warmup_seconds"),
                  ("attention_seconds", "run_seconds"),
                  *own_keys("total_seconds", "peak_bytes", "peak_graphs", "evictions", "distinct_keys", "batches",
                            "calls", "modes", "guard_fallbacks", "overflow_calls", "mask_builds", "mask_build_seconds",
                            "bound_seconds", "bound_gap", "policy_options", "rejected", "warmup_seconds"))
#: The JSON keys of a whole-model row.
MODEL_KEYS = (*own_keys("policy", "buckets"), ("max_graphs", "capacity"), *own_keys("max_bytes", "eviction", "batches"),
              ("graphs", "distinct_keys"), *own_keys("misses", "compiles", "evictions", "compile_seconds",
                                                    "warmup_seconds", "run_seconds", "peak_graphs", "peak_bytes",
                                                    "total_seconds"))
#: The JSON form of every attention row holds at least these keys (the stable contract).
ROW_FIELDS = ("policy", "buckets", "capacity", "max_bytes", "eviction", "hits", "misses", "hit_rate",
              "compiles", "compile_seconds", "attention_seconds", "total_seconds", "peak_bytes",
              "bound_seconds", "bound_gap")


class SimulatedGraph:
    """What the simulation's builder returns for a key: it stands for the compiled
    graph in the cache and is never called."""

    __slots__ = ("key",)

    def __init__(self, key: GraphKey) -> None:
        self.key = key

    def __call__(self, *args: Any) -> Any:
        raise TypeError(f"the simulated graph for key {self.key} has no computation")


def simulated(call: Call, key: GraphKey, spec: TensorSpec) -> SimulatedGraph:
    """The builder of a modelled run: a :class:`SimulatedGraph` of ``key``."""
    return SimulatedGraph(key)


def simulation_config(model: CostModel, former: BatchFormer, **fields: Any) -> AttnPolicyConfig:
    """The base config for simulating ``former``'s batches with ``model``: the model's
    backend, ``attn_impl`` and ``partition_len``, ``max_seq_len`` = the former's
    ``max_model_len`` and ``max_batch_tokens`` at least ``max_num_seqs × max_model_len``,
    so that no packed MASK call (whose kv length is the sum of its sequences'
    contexts) overflows the buckets, and ``oversize="uncached"``: under a ``max_bytes``
    bound a graph larger than the bound is compiled for each use, not refused.
    ``fields`` override any of these."""
    base: dict[str, Any] = {"backend": model.backend, "attn_impl": model.impl, "oversize": "uncached",
                            "partition_len": model.partition_len, "max_seq_len": former.max_model_len,
                            "max_batch_tokens": packed_tokens(former)}
    return AttnPolicyConfig.model_validate({**base, **fields})


def packed_tokens(former: BatchFormer) -> int:
    """The ``max_batch_tokens`` a simulation of ``former``'s steps needs: at least
    ``max_num_seqs × max_model_len`` (a packed MASK call's keys are every running
    sequence's context) and at least the config's default."""
    default: int = AttnPolicyConfig.model_fields["max_batch_tokens"].default
    return max(former.max_num_seqs * former.max_model_len, default)


@dataclass
class Recording:
    """What one dispatcher run over the batches produced (before any Belady pass);
    the planner fills one from its call table (``keys``: each key once)."""

    keys: list[GraphKey] = field(default_factory=list)
    attention_seconds: float = 0.0
    mask_builds: int = 0
    mask_build_seconds: float = 0.0
    overflow_calls: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    cache: StreamStats | None = None


def _replays(steps: Sequence[ScheduledBatch | BatchLayout], configs: Sequence[AttnPolicyConfig], model: CostModel,
             spec: TensorSpec | None = None, warm_store: bool = False) -> list[Recording]:
    """One dispatcher run per config over ``steps``, side by side (:func:`_dispatched`);
    with the configs' store modelled, twice when ``warm_store`` (the first runs fill
    their stores, the second are recorded)."""
    stores = [StoreModel.of(config, warm_store) for config in configs]
    if all(store is None for store in stores):
        return _dispatched(steps, configs, model, spec, [GraphCache.from_config(
            config, sizeof=model.graph_bytes, compile_cost=model.compile_cost) for config in configs])
    runs = [StoredRuns(store, config, model) for store, config in zip(stores, configs) if store is not None]
    if warm_store:
        _dispatched(steps, configs, model, spec, [run.cache() for run in runs])
        for run in runs:
            run.warmed()
    out = _dispatched(steps, configs, model, spec, [run.cache() for run in runs])
    for recording, run in zip(out, runs):
        assert recording.cache is not None
        recording.cache = run.counted(recording.cache, recording.keys)
    return out


class _Run:
    """One dispatcher over the batches, priced as it goes into a :class:`Recording`."""

    def __init__(self, dispatcher: Dispatcher, model: CostModel) -> None:
        self.dispatcher = dispatcher
        self.costs = BatchCost(model, dispatcher.config.max_mask_bytes)
        self.out = Recording()
        self.seconds = 0.0

    def batch(self, layout: BatchLayout, spec: TensorSpec) -> None:
        out, costs, keys = self.out, self.costs, self.out.keys
        for call, graph in self.dispatcher.prepare(layout, spec):
            key = graph.key if isinstance(graph, SimulatedGraph) else None
            if key is not None:
                keys.append(key)
            else:  # longer than the largest bucket: runs uncompiled (on_overflow="eager")
                out.overflow_calls += 1
            self.seconds += costs.call_seconds(call, key)
            build = costs.mask_seconds(layout, call, spec.device, spec.features.window)
            if build is not None:
                out.mask_builds += 1
                out.mask_build_seconds += build

    def recording(self) -> Recording:
        out, dispatcher = self.out, self.dispatcher
        out.attention_seconds = self.seconds + out.mask_build_seconds
        out.stats = dispatcher.stats().to_json()
        out.cache = _counts(dispatcher.cache.stats())
        return out


def _dispatched(steps: Sequence[ScheduledBatch | BatchLayout], configs: Sequence[AttnPolicyConfig], model: CostModel,
                spec: TensorSpec | None, caches: Sequence[GraphCache[SimulatedGraph]]) -> list[Recording]:
    """A dispatcher per (config, cache) over ``steps``, each batch through all of them in
    turn: they share one planner (the configs plan alike: a sweep's differ in bounds and
    eviction), so each batch is planned, and priced by a cost-aware policy, once for all."""
    from attnpolicy.dispatch import Dispatcher  # the runtime, and torch, load when a run needs one

    spec = spec or model.spec
    runs: list[_Run] = []
    planner = None
    for config, cache in zip(configs, caches):
        dispatcher = Dispatcher(config, builder=simulated, cost_model=model, cache=cache, planner=planner)
        planner = dispatcher.planner
        runs.append(_Run(dispatcher, model))
    for step in steps:
        layout = step.layout if isinstance(step, ScheduledBatch) else step
        for run in runs:
            run.batch(layout, spec)
    return [run.recording() for run in runs]


def belady_cache(keys: Sequence[GraphKey], config: AttnPolicyConfig,
                 model: CostModel) -> GraphCache[SimulatedGraph]:
    """A graph cache bounded like ``config`` that served ``keys`` in order with Belady's
    eviction (an oracle of the sequence's future); its stats are the bound."""
    upcoming: dict[GraphKey, float] = {}
    cache: GraphCache[SimulatedGraph] = GraphCache.from_config(
        config, eviction=BELADY, eviction_options={"next_use": upcoming.__getitem__},
        sizeof=model.graph_bytes, compile_cost=model.compile_cost)
    for key, nxt in zip(keys, next_uses(keys)):
        upcoming[key] = nxt
        cache.get_or_compile(key, partial(SimulatedGraph, key))
    return cache


def _counts(stats: CacheStats) -> StreamStats:
    return StreamStats(stats.hits, stats.misses, stats.compiles, stats.compile_seconds, stats.evictions,
                       stats.uncached, stats.peak_graphs, stats.peak_bytes)


def _compulsory_seconds(keys: Sequence[GraphKey], model: CostModel) -> float:
    """Each distinct key's compile seconds once, summed in first-request order."""
    return sum(model.compile_cost(key, 0.0) for key in dict.fromkeys(keys))


def sim_row(scheme: str, policy: str, config: AttnPolicyConfig, eviction: str, replay: Recording,
            cache: StreamStats, compulsory: float, rejected: int, warmup: float = 0.0,
            store_warm: bool = False) -> SimRow:
    """The row of ``replay`` served by a cache that counted ``cache`` (``warmup``: the cost
    model's start-up seconds, charged when the row compiles; ``store_warm``: a warm store)."""
    stats = replay.stats
    warmup = warmup if cache.compiles else 0.0
    store = StoreModel.of(config, store_warm)
    compulsory = compulsory if cache.first_miss_seconds is None else cache.first_miss_seconds
    total = replay.attention_seconds + cache.compile_seconds + cache.load_seconds + warmup
    bound = replay.attention_seconds + compulsory + warmup
    return SimRow(
        policy=policy, buckets=scheme, capacity=config.max_graphs, max_bytes=config.max_bytes, eviction=eviction,
        hits=cache.hits, misses=cache.misses, compiles=cache.compiles, compile_seconds=cache.compile_seconds,
        warmup_seconds=warmup, run_seconds=replay.attention_seconds, total_seconds=total,
        peak_bytes=cache.peak_bytes, peak_graphs=cache.peak_graphs, evictions=cache.evictions,
        distinct_keys=len(set(replay.keys)), batches=stats["batches"], json_keys=ATTENTION_KEYS,
        calls=stats["calls"], modes=dict(stats["modes"]), guard_fallbacks=stats["guard_fallbacks"],
        overflow_calls=replay.overflow_calls, mask_builds=replay.mask_builds,
        mask_build_seconds=replay.mask_build_seconds, bound_seconds=bound,
        bound_gap=total / bound - 1 if bound else 0.0, policy_options=dict(config.policy_options),
        rejected=rejected, store=None if store is None else StoreFigures.of(store, cache))


@dataclass(frozen=True)
class PolicyBound:
    """How near a (bucket scheme, policy)'s rows come to optimal: ``bound_seconds``
    (attention + every distinct graph compiled once; for a cache-aware policy the
    lowest of its rows', whose decisions differ) against the best total of an online
    eviction and of Belady over the sweep's bounds (``None``: none swept)."""

    buckets: str
    policy: str
    distinct_keys: int
    attention_seconds: float
    bound_seconds: float
    best_online: float | None
    best_belady: float | None


def lower_bounds(rows: Sequence[SimRow]) -> list[PolicyBound]:
    """One :class:`PolicyBound` per (bucket scheme, policy) of ``rows``, in row order."""
    groups: dict[tuple[str, str], list[SimRow]] = {}
    for row in rows:
        groups.setdefault((row.buckets, row.policy), []).append(row)
    out = []
    for (buckets, policy), group in groups.items():
        low = min(group, key=lambda r: r.bound_seconds)
        online = [r.total_seconds for r in group if r.eviction != BELADY]
        belady = [r.total_seconds for r in group if r.eviction == BELADY]
        out.append(PolicyBound(buckets, policy, low.distinct_keys, low.run_seconds, low.bound_seconds,
                               min(online, default=None), min(belady, default=None)))
    return out


def check_model(config: AttnPolicyConfig, model: CostModel) -> None:
    """:class:`ConfigError` unless ``model`` was calibrated for ``config``'s backend and impl."""
    if (config.backend, config.attn_impl) != (model.backend, model.impl):
        raise ConfigError(f"config backend={config.backend!r}, attn_impl={config.attn_impl!r} differ from "
                          f"the cost model's backend={model.backend!r}, impl={model.impl!r}: calibrate a "
                          "model for this config or change it")


def _check_evictions(evictions: Iterable[str]) -> None:
    known = set(eviction_registry())
    for name in evictions:
        if name not in known:
            raise ConfigError(f"eviction {name!r} is not a registered eviction strategy; "
                              f"known evictions: {', '.join(sorted(known))}")


def simulate(
    requests: Sequence[Request],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    evictions: Sequence[str],
    config_base: AttnPolicyConfig | None = None,
    model: CostModel | None = None,
    former_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    buckets: Sequence[BucketScheme] | None = None,
    max_bytes: Sequence[int | None] | None = None,
    workers: int = 1,
    store_warm: bool = False,
) -> list[SimRow]:
    """One row per (bucket scheme, policy, capacity, max_bytes, eviction), in that
    nesting order.

    ``capacity`` is ``max_graphs`` (``None``: unbounded); ``buckets`` (default: the
    base config's own) are the schemes compared, see
    :mod:`attnpolicy.modelling.bucket_schemes`; ``max_bytes`` (default: the base
    config's) are the byte bounds; every other config field comes from
    ``config_base`` (default: :func:`simulation_config`); ``model`` defaults to
    :meth:`CostModel.default`; ``former_options`` are :class:`BatchFormer` keyword
    arguments. ``progress(label)`` is called after each row. ``policy_options[name]``
    are the options of policy ``name``; the base config's ``policy_options`` apply to
    its own policy only. ``workers`` > 1 runs the dispatchers in that many processes
    (the rows are the same). A base config with ``store_dir`` models its graph store
    (``store_warm``: filled by a previous run; see :mod:`attnpolicy.modelling.tiers`).
    A trace whose every request is rejected (longer than
    ``max_model_len``) raises :class:`ConfigError` saying why; ``rejected`` in each
    row counts the requests left out. Rows hold :data:`ROW_FIELDS` and more (see
    :class:`SimRow`).
    """
    model = model or CostModel.default()
    former = BatchFormer(**dict(former_options or {}))
    base = config_base or simulation_config(model, former)
    check_model(base, model)
    steps = list(former.steps(requests))
    rejected = former.rejected
    if rejected and len(rejected) == len(requests):
        raise ConfigError(f"{former.rejections(len(requests))}: nothing to simulate (raise max_model_len "
                          "or check the trace)")
    return simulate_layouts(steps, policies, capacities, evictions, base, model, progress=progress,
                            policy_options=policy_options, rejected=len(rejected), buckets=buckets,
                            max_bytes=max_bytes, workers=workers, store_warm=store_warm)


def simulate_layouts(
    steps: Sequence[ScheduledBatch | BatchLayout],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    evictions: Sequence[str],
    config_base: AttnPolicyConfig,
    model: CostModel | None = None,
    spec: TensorSpec | None = None,
    progress: Callable[[str], None] | None = None,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
    rejected: int = 0,
    *,
    buckets: Sequence[BucketScheme] | None = None,
    max_bytes: Sequence[int | None] | None = None,
    workers: int = 1,
    store_warm: bool = False,
) -> list[SimRow]:
    """:func:`simulate` over given steps (or layouts, e.g. a recorded layout stream,
    see :mod:`attnpolicy.workloads.layout_stream`) instead of a batch former's.

    ``spec`` (default: the model's) is the tensor spec of the graph keys: give the
    recorded one to reproduce a recorded run's keys, and with them its hits, misses
    and ``max_bytes`` evictions exactly. Costs are the model's, whatever its backend.
    ``rejected`` is reported in every row (requests the caller left out). Every row
    starts with an empty cache: ``config_base``'s warm-up set is not modelled (it is
    left out of the rows' configs, whose buckets and capacities it may not fit; see
    :mod:`attnpolicy.modelling.stalls` for warm-up). Whole-model graphs are swept by
    :func:`replay_key_streams` over the configs of :func:`sweep_configs`.
    """
    model = model or CostModel.default()
    base = config_base
    schemes, byte_bounds = _swept(base, buckets, max_bytes)
    _check_evictions(evictions)
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if base.store_dir is not None or store_warm:
        StoreModel.of(base, store_warm).disk(model)  # type: ignore[union-attr]  # refused up front
    bounds = list(enumerate(capacities)), list(enumerate(byte_bounds))
    jobs: list[_Job] = []
    for s, scheme in enumerate(schemes):
        for p, policy in enumerate(policies):
            job_fields = _sweep_fields(base, policy, scheme, policy_options)
            stateless = Guard.for_policy(policy, job_fields["policy_options"]).stateless
            job = partial(_Job, s, scheme.name, p, policy, job_fields, stateless)
            if stateless:
                jobs.append(job([(c, b, list(enumerate(evictions))) for c in bounds[0] for b in bounds[1]]))
                continue
            runs = [(c, b, group) for c in bounds[0] for b in bounds[1]
                    for group in _eviction_groups(list(enumerate(evictions)))]
            jobs += [job(runs[i::workers]) for i in range(min(workers, len(runs)))]
    sweep = _Sweep(steps, model, spec, rejected, store_warm)
    return _run(jobs, sweep, workers, progress)


def sweep_configs(base: AttnPolicyConfig, policies: Sequence[str], capacities: Sequence[int | None], *,
                  buckets: Sequence[BucketScheme] | None = None, max_bytes: Sequence[int | None] | None = None,
                  policy_options: Mapping[str, Mapping[str, Any]] | None = None) -> list[AttnPolicyConfig]:
    """The config of each row of a sweep of ``base`` (eviction ``lru``; the sweep gives
    each its evictions), built by :func:`simulate_layouts`' rule: one per (policy, bucket
    scheme, capacity, ``max_bytes``), in that nesting order; no ``buckets`` or
    ``max_bytes``: ``base``'s."""
    schemes, byte_bounds = _swept(base, buckets, max_bytes)
    return [_config(_sweep_fields(base, policy, scheme, policy_options), capacity, nbytes, "lru")
            for policy in policies for scheme in schemes for capacity in capacities for nbytes in byte_bounds]


def _swept(base: AttnPolicyConfig, buckets: Sequence[BucketScheme] | None, max_bytes: Sequence[int | None] | None
           ) -> tuple[list[BucketScheme], Sequence[int | None]]:
    """The bucket schemes and byte bounds a sweep of ``base`` rows (none given: ``base``'s)."""
    return list(buckets) if buckets else [base_scheme(base)], [base.max_bytes] if max_bytes is None else max_bytes


def _sweep_fields(base: AttnPolicyConfig, policy: str, scheme: BucketScheme,
                  policy_options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """The fields of ``base`` under ``policy`` (its options: ``base``'s when it is
    ``base``'s policy, then ``policy_options``') and ``scheme``'s buckets, no warm-up set."""
    options = {**(base.policy_options if policy == base.policy else {}), **(policy_options or {}).get(policy, {})}
    return {**base.model_dump(mode="json"), "warmup": [], "policy": policy, "policy_options": options,
            "buckets": scheme.buckets.model_dump(mode="json")}


def _config(fields: dict[str, Any], capacity: int | None, max_bytes: int | None, eviction: str) -> AttnPolicyConfig:
    """The config of ``fields`` with these bounds and eviction (``belady`` replays ``lru``'s)."""
    return AttnPolicyConfig.model_validate({**fields, "max_graphs": capacity, "max_bytes": max_bytes,
                                            "eviction": "lru" if eviction == BELADY else eviction})


#: A row's place in the sweep: (scheme, policy, capacity, max_bytes, eviction) indices.
Position = tuple[int, int, int, int, int]


def _eviction_groups(evictions: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """One dispatcher run per eviction; ``belady`` replays the ``lru`` run's keys, so it
    goes with ``lru`` (alone when ``lru`` is not swept)."""
    groups = [[e] for e in evictions if e[1] not in ("lru", BELADY)]
    paired = [e for e in evictions if e[1] in ("lru", BELADY)]
    return ([paired] if paired else []) + groups


@dataclass(frozen=True)
class _Sweep:
    """What every job of a sweep shares (sent once to each worker process)."""

    steps: Sequence[ScheduledBatch | BatchLayout]
    model: CostModel
    spec: TensorSpec | None
    rejected: int
    store_warm: bool = False


#: One run of a job: its capacity and max_bytes (indexed) and the evictions it rows.
_JobRun = tuple[tuple[int, Any], tuple[int, Any], list[tuple[int, str]]]


@dataclass(frozen=True)
class _Job:
    """Rows of one policy under one bucket scheme. A stateless policy's job is one
    recording, every bound × eviction of ``runs`` a stream replay of it; a cache-aware
    policy's runs a dispatcher per run (bound and eviction group: ``belady`` with
    ``lru``), side by side. Indices order the rows."""

    scheme: int
    scheme_name: str
    policy_index: int
    policy: str
    fields: dict[str, Any]
    stateless: bool
    runs: list[_JobRun]

    def config(self, capacity: int | None, max_bytes: int | None, eviction: str) -> AttnPolicyConfig:
        return _config(self.fields, capacity, max_bytes, eviction)

    def run(self, sweep: _Sweep) -> list[tuple[Position, SimRow]]:
        return self._replayed(sweep) if self.stateless else self._dispatched(sweep)

    def _replayed(self, sweep: _Sweep) -> list[tuple[Position, SimRow]]:
        """One unbounded dispatcher run records the key stream; each bound × eviction
        replays it."""
        (recording,) = _replays(sweep.steps, [self.config(None, None, "lru")], sweep.model, sweep.spec,
                                sweep.store_warm)
        stream = KeyStream.of(recording.keys, sweep.model)
        out = []
        for (c, capacity), (b, nbytes), evictions in self.runs:
            for e, eviction in evictions:
                config = self.config(capacity, nbytes, eviction)
                out.append(((self.scheme, self.policy_index, c, b, e),
                            self._row(config, eviction, recording, stream.replay(config, eviction, sweep.store_warm),
                                      stream.compulsory, sweep)))
        return out

    def _dispatched(self, sweep: _Sweep) -> list[tuple[Position, SimRow]]:
        """A dispatcher per run, side by side; ``belady`` replays the ``lru`` run's keys
        (the run's dispatcher is ``lru`` when ``belady`` is in its group)."""
        configs = [self.config(capacity, nbytes, group[0][1]) for (_, capacity), (_, nbytes), group in self.runs]
        out = []
        recordings = _replays(sweep.steps, configs, sweep.model, sweep.spec, sweep.store_warm)
        for ((c, _), (b, _), group), config, recording in zip(self.runs, configs, recordings):
            for e, eviction in group:
                if eviction == BELADY:
                    stream = KeyStream.of(recording.keys, sweep.model)
                    row = self._row(config, eviction, recording, stream.replay(config, eviction, sweep.store_warm),
                                    stream.compulsory, sweep)
                else:
                    assert recording.cache is not None
                    row = self._row(config, eviction, recording, recording.cache,
                                    _compulsory_seconds(recording.keys, sweep.model), sweep)
                out.append(((self.scheme, self.policy_index, c, b, e), row))
        return out

    def _row(self, config: AttnPolicyConfig, eviction: str, replay: Recording, cache: StreamStats,
             compulsory: float, sweep: _Sweep) -> SimRow:
        return sim_row(self.scheme_name, self.policy, config, eviction, replay, cache, compulsory, sweep.rejected,
                       sweep.model.warmup_cost(replay.keys), sweep.store_warm)


_SHARED: list[_Sweep] = []


def _share(sweep: _Sweep) -> None:
    _SHARED[:] = [sweep]


def _run_shared(job: _Job) -> list[tuple[Position, SimRow]]:
    return job.run(_SHARED[0])


def _run(jobs: Sequence[_Job], sweep: _Sweep, workers: int,
         progress: Callable[[str], None] | None) -> list[SimRow]:
    """Every job's rows in index order; in ``workers`` processes when there are several jobs."""
    rows: dict[Position, SimRow] = {}

    def done(part: list[tuple[Position, SimRow]]) -> None:
        for index, row in part:
            rows[index] = row
            if progress:
                progress(f"{row.buckets} {row.policy} capacity={row.capacity}"
                         + (f" max_bytes={row.max_bytes}" if row.max_bytes else "") + f" {row.eviction}")

    if workers == 1 or len(jobs) < 2:
        for job in jobs:
            done(job.run(sweep))
    else:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, initializer=_share,
                                 initargs=(sweep,)) as pool:
            futures = [pool.submit(_run_shared, job) for job in jobs]
            try:
                for future in as_completed(futures):
                    done(future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [rows[index] for index in sorted(rows)]


def simulate_run(run: LayoutRun, policies: Sequence[str], capacities: Sequence[int | None],
                 evictions: Sequence[str], model: CostModel | None = None,
                 config_base: AttnPolicyConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 policy_options: Mapping[str, Mapping[str, Any]] | None = None, *,
                 buckets: Sequence[BucketScheme] | None = None, max_bytes: Sequence[int | None] | None = None,
                 workers: int = 1, store_warm: bool = False) -> list[SimRow]:
    """:func:`simulate_layouts` over a recorded run's layouts, with its tensor spec and
    (unless ``config_base`` is given) the config it ran with: the row for the recorded
    policy, ``max_graphs`` and eviction reproduces the run's misses."""
    return simulate_layouts(run.layouts, policies, capacities, evictions, config_base or run.config,
                            model, run.spec, progress, policy_options, buckets=buckets, max_bytes=max_bytes,
                            workers=workers, store_warm=store_warm)


# -- whole-model graphs ------------------------------------------------------------------


def model_layouts(steps: Sequence[ScheduledBatch | BatchLayout]) -> list[BatchLayout]:
    """The layouts of ``steps``; one with cached context (decode, a prefill chunk) is an
    error: whole-model graphs here serve prefill only."""
    layouts = [s.layout if isinstance(s, ScheduledBatch) else s for s in steps]
    for i, layout in enumerate(layouts):
        if layout.has_context or not layout.causal:
            raise ConfigError(f"batch {i} ({layout.describe()}) is not a causal prefill without cached context: "
                              "whole-model graphs serve prefill-only workloads")
    return layouts


def model_config(model: ModelCostModel, max_seq_len: int, max_batch_tokens: int, **fields: Any
                 ) -> AttnPolicyConfig:
    """The runner config a simulation of ``model`` assumes (its backend, the limits), with ``fields``."""
    return AttnPolicyConfig(**{"backend": model.backend, "max_seq_len": max_seq_len,
                               "max_batch_tokens": max_batch_tokens, "strict": "off", **fields})


def spec_of(model: ModelCostModel) -> TensorSpec:
    """The attention tensor spec the runner's policy sees for ``model``."""
    d = model.dims
    return TensorSpec("float32" if d.itemsize == 4 else "float16", d.heads, d.kv_heads, d.head_dim)


def decided_modes(layouts: Sequence[BatchLayout], config: AttnPolicyConfig, spec: TensorSpec) -> list[MaskMode]:
    """The guarded policy's mode per layout, in the context the runner gives it."""
    guard = Guard.for_policy(config.policy, config.policy_options, on_illegal=config.on_illegal,
                             fallback=MaskMode(config.fallback_mode))
    context = PolicyContext(config=config, spec=spec)
    return [guard.decide(layout, context).mode for layout in layouts]


def key_stream(layouts: Sequence[BatchLayout], modes: Sequence[MaskMode], config: AttnPolicyConfig, *,
               kv: bool = False) -> list[ModelKey]:
    """The keys the batches request, each batch's forwards in order (the runner's
    :func:`~attnpolicy.engine.keys.step_keys`: one forward a batch, a ROWS batch one per
    phase); ``kv``: each engine step's served over a KV cache, as ``run --model`` serves
    whole requests (every step, a first prefill too, on a step graph)."""
    return [key for layout, mode in zip(layouts, modes) for key in step_keys(layout, mode, config, kv=kv)]


def replay_keys(keys: Sequence[ModelKey], model: ModelCostModel, config: AttnPolicyConfig,
                eviction: str, *, builds_run: bool = False, batches: int | None = None) -> SimRow:
    """Replay ``keys`` through a cache of ``config``'s bounds with ``eviction`` (or
    ``belady``), costed by ``model``; ``batches``: how many batches requested them
    (default: one a key; a ROWS step requests one per phase). ``builds_run``: a miss's build runs its own batch
    (a step graph: the runner builds it on the step, and calibration times build and
    step together), so a batch that misses costs its compile seconds alone and
    ``run_seconds`` are the hits'."""
    ids: dict[ModelKey, int] = {}
    stream = [ids.setdefault(k, len(ids)) for k in keys]
    distinct = list(ids)
    sizes = [model.graph_bytes(k) for k in distinct]
    costs = [model.compile_seconds(k) for k in distinct]
    run = [model.run_seconds(k) for k in distinct]
    def replayed(cost: list[float]) -> StreamStats:
        return replay_stream(stream, sizes, cost, max_graphs=config.max_graphs, max_bytes=config.max_bytes,
                             eviction=eviction, oversize=config.oversize, name=lambda i: distinct[i])

    stats = replayed(costs)
    run_seconds = sum(run[i] for i in stream)
    if builds_run:  # the same misses, priced at their run seconds: those are in their builds
        run_seconds -= replayed(run).compile_seconds
    warmup = model.warmup_seconds if stats.compiles else 0.0
    return SimRow(config.policy, config.buckets.describe(), config.max_graphs, config.max_bytes, eviction,
                  stats.hits, stats.misses, stats.compiles, stats.compile_seconds, warmup, run_seconds,
                  stats.compile_seconds + warmup + run_seconds, stats.peak_bytes, stats.peak_graphs,
                  stats.evictions, len(distinct), len(keys) if batches is None else batches, MODEL_KEYS)


def replay_key_streams(layouts: Sequence[BatchLayout], model: ModelCostModel, configs: Sequence[AttnPolicyConfig],
                   evictions: Sequence[str], *, steps: bool = False) -> list[SimRow]:
    """One row per config × eviction: each config's policy decides, its buckets key
    (``steps``: the layouts are engine steps served over a KV cache, see :func:`key_stream`)."""
    spec = spec_of(model)
    rows = []
    for config in configs:
        modes = decided_modes(layouts, config, spec)
        keys = key_stream(layouts, modes, config, kv=steps)
        rows += [replay_keys(keys, model, config, eviction, builds_run=steps, batches=len(layouts))
                 for eviction in evictions]
    return rows
