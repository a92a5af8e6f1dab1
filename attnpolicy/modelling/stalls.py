"""Compile stalls per batch, modelled: synchronous compiles against background
compiles with pad-up (``compile_mode``), on a modelled clock, at either level.

One replay (:func:`stall_row`) serves the batches through a level's real runtime with
nothing compiled, so decisions, pad-ups, switch points, hits and evictions are those of
a real run, and prices them on one :class:`Clock`. A batch runs for its run seconds;
a synchronous compile stalls its batch for the key's compile seconds; a background
compile requested at modelled time ``t`` runs on one worker (compiles queue) and
finishes at ``max(t, worker free) + compile seconds``; at its switch point the batch
stalls for ``max(0, finish − now)``. The worker is assumed to run beside the batches
without slowing them. Warm-up compiles before the first batch and is reported apart
(``warmup_seconds``), not as a stall. With a graph store (``store_dir``,
:mod:`attnpolicy.modelling.tiers`) a key on the modelled disk is loaded instead, for
its load seconds, wherever it would compile: at warm-up, in the batch, on the worker.

What differs between the levels is how a batch is served, a :class:`StallLevel`:

* :class:`AttentionLevel`: each batch's calls go through a
  :class:`~attnpolicy.dispatch.Dispatcher` with the simulation's builder (see
  :mod:`attnpolicy.modelling.simulation`) and run for their calls' run seconds (plus
  dispatch overhead and host mask builds) on a :class:`~attnpolicy.graphs.costmodel.CostModel`.
* :class:`WholeModelLevel`: the key stream is the model simulation's
  (:func:`~attnpolicy.modelling.simulation.key_stream`: the guarded policy's modes, the
  runner's keys), served as the runner serves it by its
  :class:`~attnpolicy.dispatch.graph_source.GraphSource` and (``background``) its
  :class:`~attnpolicy.dispatch.background.Background` over :class:`ModelledGraphs`, priced
  by a :class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`: a miss in
  ``background`` runs on its pad-up (its run seconds) else eagerly (costed as its own
  graph's run seconds: the model holds no eager figure) while it compiles. No warm-up
  and no store are modelled. See docs/simulate.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

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
from attnpolicy.modelling.simulation import (
    SimulatedGraph,
    decided_modes,
    key_stream,
    own_keys,
    simulated,
    spec_of,
)
from attnpolicy.modelling.tiers import StoreFigures, StoreModel, reload_option
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch

#: A batch as a replay serves it (a layout, a key).
B = TypeVar("B")
#: A server's batch and key (see :class:`BatchServer`).
B_in = TypeVar("B_in", contravariant=True)
K_out = TypeVar("K_out", covariant=True)
#: ``warm`` values besides ``prefix:N``.
WARM_NONE, WARM_ALL = "none", "all"
#: The compile modes each configuration is replayed under, in row order.
MODES = ("sync", "background")


@dataclass(frozen=True)
class StallRow:
    """One modelled run. ``total_seconds`` is the modelled wall time of the batches:
    ``run_seconds`` (run seconds of the batches as they ran, pad-ups and eager runs
    included; at the attention level overheads and mask builds too) plus
    ``stall_seconds`` (synchronous compiles and waits at switch points).
    ``compiles``/``compile_seconds`` count every compile after warm-up (synchronous and
    background); ``warm_keys``/``warmup_seconds`` are the warm-up's. Stall percentiles
    are nearest-rank over all ``batches``. ``distinct_keys``: the graphs that served a
    batch. ``store`` (a modelled graph store only): what it served after warm-up (its
    loads are not in ``compiles``; warm-up's are in ``warmup_seconds``).
    ``json_keys``: the (JSON key, field) pairs of :meth:`to_json`, its level's."""

    policy: str
    capacity: int | None
    eviction: str
    compile_mode: str
    switch_after: int
    warm: str
    warm_keys: int
    warmup_seconds: float
    batches: int
    run_seconds: float
    stall_seconds: float
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
    eager_served: int
    distinct_keys: int
    json_keys: tuple[tuple[str, str], ...] = field(repr=False, compare=False)
    store: StoreFigures | None = None

    @property
    def total_seconds(self) -> float:
        return self.run_seconds + self.stall_seconds

    def to_json(self) -> dict[str, Any]:
        """The row as JSON: its level's keys (``store`` too when one was modelled)."""
        out = {key: getattr(self, name) for key, name in self.json_keys}
        return out if self.store is None else {**out, "store": asdict(self.store)}


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


class BatchServer(Protocol[B_in, K_out]):
    """How a level serves one replay's batches from one cache (its real runtime, nothing
    compiled): ``warmup(layouts)`` warms the cache up and says how many keys it warmed;
    ``pending()``: the background compiles not switched in yet; ``serve(batch)``: the
    batch's run seconds and the keys whose graphs served it; ``counters``: its counts."""

    counters: Counters

    def warmup(self, layouts: Sequence[BatchLayout]) -> int: ...
    def pending(self) -> Iterable[K_out]: ...
    def serve(self, batch: B_in) -> tuple[float, Iterable[K_out]]: ...
    def close(self) -> None: ...


class StallLevel(Protocol[B, K]):
    """What differs between the levels in a stalls replay: the ``batches`` of a workload
    under a config, a key's compile seconds and bytes, a store's mirror (``disk``), how
    a batch is served (``server``) and its rows' JSON keys (:attr:`StallRow.json_keys`)."""

    row_keys: tuple[tuple[str, str], ...]

    def batches(self, layouts: Sequence[BatchLayout], config: AttnPolicyConfig) -> Sequence[B]: ...
    def compile_seconds(self, key: K) -> float: ...
    def graph_bytes(self, key: K) -> int: ...
    def disk(self, store: StoreModel) -> DiskMirror: ...
    def server(self, config: AttnPolicyConfig, cache: GraphCache[Any]) -> BatchServer[B, K]: ...


class AttentionLevel:
    """Attention calls: each batch's calls served by a :class:`~attnpolicy.dispatch.Dispatcher`
    with the simulation's builder, priced by ``model`` (default: the built-in one) for
    ``spec`` (default: the model's)."""

    row_keys = (*own_keys("policy", "capacity", "eviction", "compile_mode", "switch_after", "warm", "warm_keys",
                          "warmup_seconds", "batches"),
                ("attention_seconds", "run_seconds"),
                *own_keys("stall_seconds", "total_seconds", "stall_p50", "stall_p99", "stall_max", "stalled_batches",
                          "compiles", "compile_seconds", "background_compiles", "background_compile_seconds",
                          "pad_up_calls", "pad_up_tokens", "distinct_keys"))

    def __init__(self, model: CostModel | None = None, spec: TensorSpec | None = None) -> None:
        self.model = model or CostModel.default()
        self.spec = spec or self.model.spec

    def batches(self, layouts: Sequence[BatchLayout], config: AttnPolicyConfig) -> Sequence[BatchLayout]:
        return layouts

    def compile_seconds(self, key: GraphKey) -> float:
        return self.model.compile_seconds(key)

    def graph_bytes(self, key: GraphKey) -> int:
        return self.model.graph_bytes(key)

    def disk(self, store: StoreModel) -> DiskMirror:
        return store.disk(self.model)

    def server(self, config: AttnPolicyConfig, cache: GraphCache[Any]) -> _Dispatched:
        return _Dispatched(self, config, cache)


class _Dispatched:
    """A :class:`~attnpolicy.dispatch.Dispatcher` as a :class:`BatchServer`."""

    def __init__(self, level: AttentionLevel, config: AttnPolicyConfig, cache: GraphCache[SimulatedGraph]) -> None:
        self._spec = level.spec
        self._costs = BatchCost(level.model, config.max_mask_bytes)
        self._dispatcher = Dispatcher(config, builder=simulated, cost_model=level.model, cache=cache)
        self.counters = self._dispatcher.counters

    def warmup(self, layouts: Sequence[BatchLayout]) -> int:
        return len(self._dispatcher.warmup(layouts, self._spec))

    def pending(self) -> list[GraphKey]:
        return [key for key, _ in self._dispatcher.pending()]

    def serve(self, layout: BatchLayout) -> tuple[float, list[GraphKey]]:
        """Run ``layout`` through the dispatcher: its calls' run seconds and mask builds."""
        run, keys = 0.0, []
        for call, graph in self._dispatcher.prepare(layout, self._spec):
            graph_key = graph.key if isinstance(graph, SimulatedGraph) else None  # None: runs uncompiled
            if graph_key is not None:
                keys.append(graph_key)
            run += self._costs.call_seconds(call, graph_key)
            build = self._costs.mask_seconds(layout, call, self._spec.device, self._spec.features.window)
            if build is not None:
                run += build
        return run, keys

    def close(self) -> None:
        self._dispatcher.close()


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


class WholeModelLevel:
    """Whole-model graphs: the key stream of the model simulation served by the runner's
    graph source and background worker over :class:`ModelledGraphs`, priced by ``model``."""

    row_keys = (*own_keys("policy", "capacity", "compile_mode", "switch_after", "batches", "compiles",
                          "compile_seconds"),
                ("padded_up", "pad_up_calls"),
                *own_keys("eager_served", "run_seconds", "stall_seconds", "stall_p50", "stall_p99", "stall_max",
                          "stalled_batches", "total_seconds"))

    def __init__(self, model: ModelCostModel) -> None:
        self.model = model

    def batches(self, layouts: Sequence[BatchLayout], config: AttnPolicyConfig) -> list[ModelKey]:
        return key_stream(layouts, decided_modes(layouts, config, spec_of(self.model)), config)

    def compile_seconds(self, key: ModelKey) -> float:
        return self.model.compile_seconds(key)

    def graph_bytes(self, key: ModelKey) -> int:
        return self.model.graph_bytes(key)

    def disk(self, store: StoreModel) -> DiskMirror:
        raise ConfigError("whole-model graphs model no graph store: leave store_dir unset")

    def server(self, config: AttnPolicyConfig, cache: GraphCache[Any]) -> _Sourced:
        return _Sourced(self.model, config, cache)


class _Sourced:
    """The runner's :class:`~attnpolicy.dispatch.graph_source.GraphSource` and (``background``)
    :class:`~attnpolicy.dispatch.background.Background` as a :class:`BatchServer`."""

    def __init__(self, model: ModelCostModel, config: AttnPolicyConfig, cache: GraphCache[ModelKey]) -> None:
        self._model = model
        self.counters = Counters()
        self._source: GraphSource[ModelKey, None] = GraphSource(cache, self.counters, ModelledGraphs(config, model))
        self._background = Background(self._source) if config.compile_mode == "background" else None

    def warmup(self, layouts: Sequence[BatchLayout]) -> int:
        if layouts:
            raise ConfigError("warm must be 'none' on whole-model graphs: no warm-up is modelled")
        return 0

    def pending(self) -> Iterable[ModelKey]:
        return () if self._background is None else self._background.pending

    def serve(self, key: ModelKey) -> tuple[float, list[ModelKey]]:
        """Fetch the graph of a batch of ``key`` as the runner fetches a whole-model batch's:
        a batch run eagerly while its graph compiles is costed as its own graph."""
        served = key
        if self._background is not None:
            self._background.next_batch()
            if key not in self._source.cache:
                key_or_none = self._background.serve(key, None)
                if key_or_none is None:
                    return self._model.run_seconds(key), []
                served = key_or_none
        self._source.get(served, None)
        return self._model.run_seconds(served), [served]

    def close(self) -> None:
        if self._background is not None:
            self._background.close()


def stall_row(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, level: StallLevel[Any, Any],
              warm: str = WARM_NONE, store_warm: bool = False) -> StallRow:
    """Replay ``steps`` under ``config`` (its ``compile_mode`` and ``switch_after``) as
    ``level`` serves them, on the modelled clock, after warming up as ``warm`` says (see
    :func:`warm_layouts`); over ``config``'s graph store if it has one (``store_warm``:
    filled by a first run)."""
    layouts = [s.layout if isinstance(s, ScheduledBatch) else s for s in steps]
    store = StoreModel.of(config, store_warm)
    if store is None:
        return _stalls(layouts, config, level, warm, None)[0]
    disk = level.disk(store)
    if store_warm:
        _stalls(layouts, config, level, warm, disk)
        disk.reset_counters()
    row, loads, seconds = _stalls(layouts, config, level, warm, disk)
    return replace(row, store=StoreFigures(store.max_disk_bytes, store.warm, disk.loads - loads,
                                           disk.load_seconds - seconds, disk.evictions, disk.peak_bytes))


def _stalls(layouts: Sequence[BatchLayout], config: AttnPolicyConfig, level: StallLevel[B, K], warm: str,
            disk: DiskMirror | None) -> tuple[StallRow, int, float]:
    """The row over ``disk`` (``None``: no store), and the loads and load seconds of its warm-up."""
    warm_set = warm_layouts(layouts, warm)

    def fetch(key: K) -> tuple[float, bool]:
        """The seconds that bring ``key`` in, and whether the disk served it."""
        loaded = None if disk is None else disk.load(key)
        if loaded is not None:
            return loaded, True
        if disk is not None:
            disk.save(key)
        return level.compile_seconds(key), False

    clock: Clock[K] = Clock(fetch)
    cache: GraphCache[Any] = GraphCache.from_config(
        config, sizeof=level.graph_bytes, compile_cost=lambda key, _: level.compile_seconds(key),
        on_compile=clock.compiled, eviction_options=reload_option(config.eviction, disk))
    keys: set[K] = set()
    server = level.server(config, cache)

    def serve(batch: B) -> float:
        run, served = server.serve(batch)
        keys.update(served)
        return run

    try:
        warm_keys = server.warmup(warm_set)
        warmed = [fetch(key) for key in clock.inserted]
        warmup_seconds = cache.stats().compile_seconds if disk is None else sum(s for s, _ in warmed)
        batches = level.batches(layouts, config)
        clock.replay(batches, server.pending, serve)
    finally:
        server.close()
    n = len(batches)
    stalls = clock.stalls(n)
    counters = server.counters
    row = StallRow(
        policy=config.policy, capacity=config.max_graphs, eviction=config.eviction,
        compile_mode=config.compile_mode, switch_after=config.switch_after, warm=warm,
        warm_keys=warm_keys, warmup_seconds=warmup_seconds, batches=n, run_seconds=clock.run,
        stall_seconds=stalls.seconds, stall_p50=stalls.p50, stall_p99=stalls.p99, stall_max=stalls.max,
        stalled_batches=stalls.stalled, compiles=clock.compiles, compile_seconds=clock.compile_seconds,
        background_compiles=clock.background, background_compile_seconds=clock.background_seconds,
        pad_up_calls=counters.pad_up_calls, pad_up_tokens=counters.pad_up_tokens,
        eager_served=counters.background_eager, distinct_keys=len(keys), json_keys=level.row_keys)
    return row, sum(loaded for _, loaded in warmed), sum(s for s, loaded in warmed if loaded)


def stall_configs(base: AttnPolicyConfig, policies: Sequence[str], capacities: Sequence[int | None],
                  switch_after: int | None = None) -> list[AttnPolicyConfig]:
    """The config of each policy × capacity (in that order) of ``base`` (``switch_after``:
    default the base config's), every one validated before any is run: :class:`ConfigError`
    names the capacity of one that is invalid (e.g. fewer graphs than the base config's
    warm-up set)."""
    fields = base.model_dump(mode="json")
    configs = []
    for policy in policies:
        for capacity in capacities:
            try:
                configs.append(AttnPolicyConfig.model_validate(
                    {**fields, "policy": policy, "policy_options": fields["policy_options"]
                     if policy == base.policy else {}, "max_graphs": capacity,
                     "switch_after": switch_after or base.switch_after}))
            except ValidationError as exc:
                message = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
                raise ConfigError(f"capacity {'inf' if capacity is None else capacity}: {message}") from None
    return configs


def compare_stalls(steps: Sequence[ScheduledBatch | BatchLayout], level: StallLevel[Any, Any],
                   configs: Sequence[AttnPolicyConfig], warm: Sequence[str] = (WARM_NONE,),
                   progress: Callable[[str], None] | None = None, store_warm: bool = False) -> list[StallRow]:
    """For each of ``configs`` (e.g. :func:`stall_configs`) × warm set, the ``sync`` row
    then the ``background`` row, served as ``level`` serves them; ``progress(label)``
    after each row."""
    rows = []
    for config in configs:
        for warm_set in warm:
            for mode in MODES:
                rows.append(stall_row(steps, config.model_copy(update={"compile_mode": mode}), level, warm_set,
                                      store_warm))
                if progress:
                    progress(f"{config.policy} capacity={config.max_graphs} warm={warm_set} {mode}")
    return rows
