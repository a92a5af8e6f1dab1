"""Compile stalls per batch, modelled: synchronous compiles against background
compiles with pad-up (``compile_mode``), on a modelled clock.

The batches go through a real :class:`~attnpolicy.dispatch.Dispatcher` with the
simulation's builder (nothing compiles; see :mod:`attnpolicy.modelling.simulation`),
so decisions, pad-ups, switch points, hits and evictions are those of a real run.
Time is the cost model's: a batch runs for its calls' run seconds (plus dispatch
overhead and host mask builds); a synchronous compile stalls its batch for the
key's compile seconds; a background compile requested at modelled time ``t`` runs
on one worker (compiles queue) and finishes at ``max(t, worker free) + compile
seconds``; at its switch point the batch stalls for ``max(0, finish − now)``. The
worker is assumed to run beside the batches without slowing them. Warm-up compiles
before the first batch and is reported apart (``warmup_seconds``), not as a stall.
With a graph store (``store_dir``, :mod:`attnpolicy.modelling.tiers`) a key on the
modelled disk is loaded instead, for its load seconds, wherever it would compile:
at warm-up, in the batch, on the worker. See docs/simulate.md.

On whole-model graphs (:func:`compare_model_stalls`) the key stream is the model
simulation's (:func:`~attnpolicy.modelling.simulation.key_stream`: the guarded
policy's modes, the runner's keys), served as the runner serves it by its
:class:`~attnpolicy.dispatch.graph_source.GraphSource` and (``background``) its
:class:`~attnpolicy.dispatch.background.Background` over :class:`ModelledGraphs`
(nothing compiles), through a cache of the config's bounds and eviction, sized by the
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`, on the same
:class:`Clock`: ``sync`` stalls a batch for the compile seconds of its miss;
``background`` runs a miss on its pad-up (its run seconds) else eagerly (costed as its
own graph's run seconds: the model holds no eager figure) while it compiles. The
process's one-off ``warmup_seconds`` is left out of both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher
from attnpolicy.dispatch.background import Background
from attnpolicy.dispatch.family import K
from attnpolicy.dispatch.graph_source import GraphSource
from attnpolicy.dispatch.stats import Counters, StallStats, stall_stats
from attnpolicy.engine.graph_family import ModelFamily
from attnpolicy.engine.keys import ModelKey
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.modelling.simulation import SimulatedGraph, decided_modes, key_stream, simulated, spec_of
from attnpolicy.modelling.tiers import StoreFigures, StoreModel, reload_option, row_json
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch

#: A batch as a replay serves it (a layout, a key).
B = TypeVar("B")
#: ``warm`` values besides ``prefix:N``.
WARM_NONE, WARM_ALL = "none", "all"


@dataclass(frozen=True)
class StallRow:
    """One modelled run. ``total_seconds`` is the modelled wall time of the batches:
    ``attention_seconds`` (run seconds of the calls as they ran, pad-ups included,
    overheads and mask builds) plus ``stall_seconds`` (synchronous compiles and waits
    at switch points). ``compiles``/``compile_seconds`` count every compile after
    warm-up (synchronous and background); ``warm_keys``/``warmup_seconds`` are the
    warm-up's. Stall percentiles are nearest-rank over all ``batches``. ``store`` (a
    modelled graph store only, else not in the JSON): what it served after warm-up
    (its loads are not in ``compiles``; warm-up's are in ``warmup_seconds``)."""

    policy: str
    capacity: int | None
    eviction: str
    compile_mode: str
    switch_after: int
    warm: str
    warm_keys: int
    warmup_seconds: float
    batches: int
    attention_seconds: float
    stall_seconds: float
    total_seconds: float
    stall_p50: float
    stall_p99: float
    stall_max: float
    stalled_batches: int
    compiles: int
    compile_seconds: float
    background_compiles: int
    background_compile_seconds: float
    pad_up_calls: int
    pad_up_tokens: int
    distinct_keys: int
    store: StoreFigures | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as JSON: one key per field (``store`` only when one was modelled)."""
        return row_json(self)


def warm_layouts(layouts: Sequence[BatchLayout], warm: str) -> list[BatchLayout]:
    """The layouts to warm up with: ``none``, ``all`` (every layout: the keys the
    whole workload uses) or ``prefix:N`` (the first ``N``)."""
    if warm == WARM_NONE:
        return []
    if warm == WARM_ALL:
        return list(layouts)
    head, _, count = warm.partition(":")
    if head == "prefix" and count.isdigit():
        return list(layouts[:int(count)])
    raise ConfigError(f"warm must be 'none', 'all' or 'prefix:N' (N ≥ 0 batches), got {warm!r}")


class Clock(Generic[K]):
    """The modelled clock of one replay of either family. A batch starts when the one
    before it ended, then waits at its switch points for the one background worker and
    stalls for its synchronous compiles (or loads); a background compile requested in
    it queues on the worker from then. ``fetch(key)``: the seconds that bring ``key``
    in, and whether a store served it (a load, not counted as a compile). The cache
    reports each graph it takes to :meth:`compiled` (its ``on_compile``)."""

    def __init__(self, fetch: Callable[[K], tuple[float, bool]]) -> None:
        self._fetch = fetch
        self.inserted: list[K] = []  # the keys the cache took since the batch began
        self.now = self._worker_free = 0.0
        self._finish: dict[K, float] = {}
        self._stalls: list[float] = []
        self.run = self.compile_seconds = self.background_seconds = 0.0
        self.compiles = self.background = 0

    def compiled(self, key: K, seconds: float, nbytes: int) -> None:
        """The cache took ``key``'s graph (built or switched in)."""
        self.inserted.append(key)

    def replay(self, batches: Iterable[B], pending: Callable[[], Iterable[K]], serve: Callable[[B], float]) -> None:
        """Serve each of ``batches`` in turn: ``serve(batch)`` runs it through the runtime
        and returns its run seconds; ``pending()``: the runtime's background compiles
        not switched in yet."""
        for batch in batches:
            before = set(pending())
            self.inserted.clear()
            run = serve(batch)
            self._batch(before, pending(), run)

    def _batch(self, before: Collection[K], pending: Iterable[K], run: float) -> None:
        """One batch that had ``before`` pending at its start and ``pending`` at its
        end, and ran for ``run`` seconds."""
        t = self.now
        sync = []
        for key in self.inserted:  # switch points first (at the batch's start), then sync compiles
            if key in before and key in self._finish:  # its first insertion: the switch
                t = max(t, self._finish.pop(key))
            else:  # compiled in the batch (again, if evicted since its switch)
                sync.append(key)
        for key in sync:
            seconds, loaded = self._fetch(key)
            t += seconds
            if not loaded:
                self.compiles += 1
                self.compile_seconds += seconds
        for key in pending:
            if key not in before:  # requested in this batch: queued on the one worker
                seconds, loaded = self._fetch(key)
                self._worker_free = self._finish[key] = max(t, self._worker_free) + seconds
                self.background += 1
                self.background_seconds += seconds
                if not loaded:
                    self.compiles += 1
                    self.compile_seconds += seconds
        if t > self.now:
            self._stalls.append(t - self.now)
        self.run += run
        self.now = t + run

    def stalls(self, batches: int) -> StallStats:
        """The stalls over ``batches`` batches."""
        return stall_stats(batches, self._stalls)


def stall_row(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, model: CostModel | None = None,
              spec: TensorSpec | None = None, warm: str = WARM_NONE, store_warm: bool = False) -> StallRow:
    """Replay ``steps`` under ``config`` (its ``compile_mode`` and ``switch_after``)
    on the modelled clock, after warming up as ``warm`` says (see :func:`warm_layouts`);
    over ``config``'s graph store if it has one (``store_warm``: filled by a first run)."""
    model = model or CostModel.default()
    store = StoreModel.of(config, store_warm)
    if store is None:
        return _stalls(steps, config, model, spec, warm, None)[0]
    disk = store.disk(model)
    if store_warm:
        _stalls(steps, config, model, spec, warm, disk)
        disk.reset_counters()
    row, loads, seconds = _stalls(steps, config, model, spec, warm, disk)
    return replace(row, store=StoreFigures(store.max_disk_bytes, store.warm, disk.loads - loads,
                                           disk.load_seconds - seconds, disk.evictions, disk.peak_bytes))


def _stalls(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, model: CostModel,
            spec: TensorSpec | None, warm: str, disk: DiskMirror | None) -> tuple[StallRow, int, float]:
    """The row over ``disk`` (``None``: no store), and the loads and load seconds of its warm-up."""
    spec = spec or model.spec
    layouts = [s.layout if isinstance(s, ScheduledBatch) else s for s in steps]
    warm_set = warm_layouts(layouts, warm)

    def fetch(key: GraphKey) -> tuple[float, bool]:
        """The seconds that bring ``key`` in, and whether the disk served it."""
        loaded = None if disk is None else disk.load(key)
        if loaded is not None:
            return loaded, True
        if disk is not None:
            disk.save(key)
        return model.compile_seconds(key), False

    clock: Clock[GraphKey] = Clock(fetch)
    cache: GraphCache[SimulatedGraph] = GraphCache.from_config(
        config, sizeof=model.graph_bytes, compile_cost=model.compile_cost, on_compile=clock.compiled,
        eviction_options=reload_option(config.eviction, disk))
    costs = BatchCost(model, config.max_mask_bytes)
    keys: set[GraphKey] = set()

    with Dispatcher(config, builder=simulated, cost_model=model, cache=cache) as dispatcher:
        def serve(layout: BatchLayout) -> float:
            """Run ``layout`` through the dispatcher: its calls' run seconds and mask builds."""
            run = 0.0
            for call, graph in dispatcher.prepare(layout, spec):
                graph_key = graph.key if isinstance(graph, SimulatedGraph) else None  # None: runs uncompiled
                if graph_key is not None:
                    keys.add(graph_key)
                run += costs.call_seconds(call, graph_key)
                build = costs.mask_seconds(layout, call, spec.device, spec.features.window)
                if build is not None:
                    run += build
            return run

        warm_keys = dispatcher.warmup(warm_set, spec)
        warmed = [fetch(key) for key in clock.inserted]
        warmup_seconds = cache.stats().compile_seconds if disk is None else sum(s for s, _ in warmed)
        clock.replay(layouts, lambda: [key for key, _ in dispatcher.pending()], serve)
        stats = dispatcher.stats()
    n = len(layouts)
    stalls = clock.stalls(n)
    row = StallRow(
        policy=config.policy, capacity=config.max_graphs, eviction=config.eviction,
        compile_mode=config.compile_mode, switch_after=config.switch_after, warm=warm,
        warm_keys=len(warm_keys), warmup_seconds=warmup_seconds, batches=n,
        attention_seconds=clock.run, stall_seconds=stalls.seconds, total_seconds=clock.run + stalls.seconds,
        stall_p50=stalls.p50, stall_p99=stalls.p99, stall_max=stalls.max, stalled_batches=stalls.stalled,
        compiles=clock.compiles, compile_seconds=clock.compile_seconds,
        background_compiles=clock.background, background_compile_seconds=clock.background_seconds,
        pad_up_calls=stats.background.pad_up_calls, pad_up_tokens=stats.background.pad_up_tokens,
        distinct_keys=len(keys))
    return row, sum(loaded for _, loaded in warmed), sum(s for s, loaded in warmed if loaded)


def stall_configs(base: AttnPolicyConfig, policies: Sequence[str], capacities: Sequence[int | None],
                  switch_after: int | None = None) -> dict[tuple[str, int | None, str], AttnPolicyConfig]:
    """The config of each (policy, capacity, compile mode) of :func:`compare_stalls`,
    every one validated before any is run: :class:`ConfigError` names the capacity
    of one that is invalid (e.g. fewer graphs than the base config's warm-up set)."""
    fields = base.model_dump(mode="json")
    configs = {}
    for policy in policies:
        for capacity in capacities:
            for mode in ("sync", "background"):
                try:
                    configs[policy, capacity, mode] = AttnPolicyConfig.model_validate(
                        {**fields, "policy": policy, "policy_options": fields["policy_options"]
                         if policy == base.policy else {}, "max_graphs": capacity, "compile_mode": mode,
                         "switch_after": switch_after or base.switch_after})
                except ValidationError as exc:
                    message = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
                    raise ConfigError(f"capacity {'inf' if capacity is None else capacity}: {message}") from None
    return configs


def compare_stalls(steps: Sequence[ScheduledBatch | BatchLayout], base: AttnPolicyConfig, policies: Sequence[str],
                   capacities: Sequence[int | None], warm: Sequence[str], switch_after: int | None = None,
                   model: CostModel | None = None, spec: TensorSpec | None = None,
                   progress: Callable[[str], None] | None = None, store_warm: bool = False) -> list[StallRow]:
    """For each policy × capacity × warm set, the ``sync`` row then the
    ``background`` row (``switch_after``: default the base config's; configs as
    :func:`stall_configs` checks them); ``progress(label)`` after each row."""
    configs = stall_configs(base, policies, capacities, switch_after)
    rows = []
    for policy in policies:
        for capacity in capacities:
            for warm_set in warm:
                for mode in ("sync", "background"):
                    rows.append(stall_row(steps, configs[policy, capacity, mode], model, spec, warm_set,
                                             store_warm))
                    if progress:
                        progress(f"{policy} capacity={capacity} warm={warm_set} {mode}")
    return rows


# -- whole-model graphs ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStallRow:
    """One modelled run on whole-model graphs: run seconds (as served: padded up or
    eager included) plus stall seconds (synchronous compiles, waits at switch points)."""

    policy: str
    capacity: int | None
    compile_mode: str
    switch_after: int
    batches: int
    compiles: int
    compile_seconds: float
    padded_up: int
    eager_served: int
    run_seconds: float
    stall_seconds: float
    stall_p50: float
    stall_p99: float
    stall_max: float
    stalled_batches: int

    @property
    def total_seconds(self) -> float:
        return self.run_seconds + self.stall_seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_seconds": self.total_seconds}


class ModelledGraphs:
    """The runner's whole-model graphs (a :class:`~attnpolicy.dispatch.family.GraphFamily`)
    on ``model``'s clock: :class:`~attnpolicy.engine.graph_family.ModelFamily`'s rows,
    pad-up and eager misses, nothing compiled (a key stands for its graph, built at
    once: the cache records ``model``'s compile seconds), nothing stored."""

    eager_misses = ModelFamily.eager_misses
    store = None
    rows = staticmethod(ModelFamily.rows)
    pad_up = staticmethod(ModelFamily.pad_up)

    def __init__(self, config: AttnPolicyConfig, model: ModelCostModel) -> None:
        self.config = config
        self._model = model

    def estimate_bytes(self, key: ModelKey) -> int:
        return self._model.graph_bytes(key)

    def build(self, key: ModelKey, request: None) -> ModelKey:
        return key

    def identity(self, key: ModelKey) -> None:
        return None

    def load(self, key: ModelKey) -> None:
        return None

    def eager(self, key: ModelKey, request: None) -> None:
        return None

    def release(self, key: ModelKey, graph: Any) -> None:
        return None


def _runner_stalls(layouts: Sequence[BatchLayout], model: ModelCostModel, config: AttnPolicyConfig) -> ModelStallRow:
    """Replay ``layouts`` under ``config`` (its policy, buckets, bounds, ``compile_mode``
    and ``switch_after``) through the runner's graph source and background worker over
    :class:`ModelledGraphs`, on ``model``'s clock."""
    keys = key_stream(layouts, decided_modes(layouts, config, spec_of(model)), config)
    clock: Clock[ModelKey] = Clock(lambda key: (model.compile_seconds(key), False))
    family = ModelledGraphs(config, model)
    cache: GraphCache[ModelKey] = GraphCache.from_config(
        config, sizeof=family.estimate_bytes, compile_cost=lambda key, _: model.compile_seconds(key),
        on_compile=clock.compiled)
    counters = Counters()
    source: GraphSource[ModelKey, None] = GraphSource(cache, counters, family)
    background = Background(source) if config.compile_mode == "background" else None
    try:  # a batch run eagerly (served None) is costed as its own graph
        clock.replay(keys, lambda: () if background is None else background.pending,
                     lambda key: model.run_seconds(_served(source, background, key) or key))
    finally:
        if background is not None:
            background.close()
    n = len(keys)
    stalls = clock.stalls(n)
    return ModelStallRow(config.policy, config.max_graphs, config.compile_mode, config.switch_after, n,
                         clock.compiles, clock.compile_seconds, counters.pad_up_calls, counters.background_eager,
                         clock.run, stalls.seconds, stalls.p50, stalls.p99, stalls.max, stalls.stalled)


def _served(source: GraphSource[ModelKey, None], background: Background[ModelKey, None] | None,
            key: ModelKey) -> ModelKey | None:
    """The key whose graph runs a batch of ``key``, fetched from ``source`` as the runner
    fetches a whole-model batch's (``None``: it runs eagerly while its graph compiles)."""
    if background is not None:
        background.next_batch()
        if key not in source.cache:
            key_or_none = background.serve(key, None)
            if key_or_none is None:
                return None
            key = key_or_none
    source.get(key, None)
    return key


def compare_model_stalls(layouts: Sequence[BatchLayout], model: ModelCostModel, configs: Sequence[AttnPolicyConfig]
                         ) -> list[ModelStallRow]:
    """For each config, its ``sync`` row then its ``background`` row."""
    return [_runner_stalls(layouts, model, config.model_copy(update={"compile_mode": mode}))
            for config in configs for mode in ("sync", "background")]
