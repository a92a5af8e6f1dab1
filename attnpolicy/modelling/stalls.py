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
policy's modes, the runner's keys) through a cache of the config's bounds and
eviction, sized by the :class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`,
on its clock: ``sync`` stalls a batch for the compile seconds of its miss;
``background`` follows the runner's rule (:func:`~attnpolicy.engine.keys.dominates`):
a miss runs on the smallest resident graph that dominates its key (its run seconds)
else eagerly (costed as its own graph's run seconds: the model holds no eager figure),
while the compile runs on one worker (compiles queue) and switches in
``switch_after`` batches after its request, the batch waiting ``max(0, finish − now)``
then. The process's one-off ``warmup_seconds`` is left out of both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from pydantic import ValidationError

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher
from attnpolicy.dispatch.stats import percentile
from attnpolicy.engine.keys import ModelKey, dominates
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.modelling.simulation import SimulatedGraph, decided_modes, key_stream, simulated, spec_of
from attnpolicy.modelling.tiers import StoreFigures, StoreModel, reload_option, row_json
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch

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
    inserted: list[GraphKey] = []
    cache: GraphCache[SimulatedGraph] = GraphCache.from_config(
        config, sizeof=model.graph_bytes, compile_cost=model.compile_cost,
        on_compile=lambda key, seconds, nbytes: inserted.append(key),
        eviction_options=reload_option(config.eviction, disk))
    costs = BatchCost(model, config.max_mask_bytes)

    def fetch(key: GraphKey) -> tuple[float, bool]:
        """The seconds that bring ``key`` in, and whether the disk served it."""
        loaded = None if disk is None else disk.load(key)
        if loaded is not None:
            return loaded, True
        if disk is not None:
            disk.save(key)
        return model.compile_seconds(key), False

    with Dispatcher(config, builder=simulated, cost_model=model, cache=cache) as dispatcher:
        warm_keys = dispatcher.warmup(warm_set, spec)
        warmed = [fetch(key) for key in inserted]
        warmup_seconds = cache.stats().compile_seconds if disk is None else sum(s for s, _ in warmed)
        now = worker_free = 0.0
        finish: dict[GraphKey, float] = {}
        stalls: list[float] = []
        attention = compile_seconds = background_seconds = 0.0
        compiles = background = 0
        keys: set[GraphKey] = set()
        for layout in layouts:
            before = dict(dispatcher.pending())
            inserted.clear()
            graphs = dispatcher.prepare(layout, spec)
            t = now
            sync = []
            for key in inserted:  # switch points first (at the batch's start), then sync compiles
                if key in before and key in finish:  # its first insertion: the switch
                    t = max(t, finish.pop(key))
                else:  # compiled in the batch (again, if evicted since its switch)
                    sync.append(key)
            for key in sync:
                seconds, loaded = fetch(key)
                t += seconds
                if not loaded:
                    compiles += 1
                    compile_seconds += seconds
            for key, _ in dispatcher.pending():
                if key not in before:  # requested in this batch: queued on the one worker
                    seconds, loaded = fetch(key)
                    worker_free = finish[key] = max(t, worker_free) + seconds
                    background += 1
                    background_seconds += seconds
                    if not loaded:
                        compiles += 1
                        compile_seconds += seconds
            if t > now:
                stalls.append(t - now)
            run = 0.0
            for call, graph in graphs:
                graph_key = graph.key if isinstance(graph, SimulatedGraph) else None  # None: runs uncompiled
                if graph_key is not None:
                    keys.add(graph_key)
                run += costs.call_seconds(call, graph_key)
                build = costs.mask_seconds(layout, call, spec.device, spec.features.window)
                if build is not None:
                    run += build
            attention += run
            now = t + run
        stats = dispatcher.stats()
    stalls.sort()
    n = len(layouts)
    stall_total = sum(stalls)
    row = StallRow(
        policy=config.policy, capacity=config.max_graphs, eviction=config.eviction,
        compile_mode=config.compile_mode, switch_after=config.switch_after, warm=warm,
        warm_keys=len(warm_keys), warmup_seconds=warmup_seconds, batches=n,
        attention_seconds=attention, stall_seconds=stall_total, total_seconds=attention + stall_total,
        stall_p50=percentile(stalls, n, 0.5), stall_p99=percentile(stalls, n, 0.99),
        stall_max=stalls[-1] if stalls else 0.0, stalled_batches=len(stalls),
        compiles=compiles, compile_seconds=compile_seconds,
        background_compiles=background, background_compile_seconds=background_seconds,
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


def model_stall_row(layouts: Sequence[BatchLayout], model: ModelCostModel, config: AttnPolicyConfig) -> ModelStallRow:
    """Replay ``layouts`` under ``config`` (its policy, buckets, bounds, ``compile_mode``
    and ``switch_after``) on ``model``'s clock."""
    keys = key_stream(layouts, decided_modes(layouts, config, spec_of(model)), config)
    cache: GraphCache[ModelKey] = GraphCache.from_config(config, sizeof=model.graph_bytes,
                                                         compile_cost=lambda key, _: model.compile_seconds(key))
    background = config.compile_mode == "background"
    pending: dict[ModelKey, tuple[float, int]] = {}  # key -> (modelled finish, due batch)
    now = worker_free = run = compile_seconds = 0.0
    compiles = padded = eager = 0
    stalls: list[float] = []
    for batch, key in enumerate(keys, start=1):
        t = now
        for other, (finish, due) in list(pending.items()):  # switch points, in request order
            if due <= batch:
                del pending[other]
                t = max(t, finish)
                cache.get_or_compile(other, _itself(other))
        if key in cache:
            cache.get_or_compile(key, _itself(key))
            seconds = model.run_seconds(key)
        elif not background:
            cache.get_or_compile(key, _itself(key))
            t += model.compile_seconds(key)
            compiles += 1
            compile_seconds += model.compile_seconds(key)
            seconds = model.run_seconds(key)
        else:
            if key not in pending:
                worker_free = max(t, worker_free) + model.compile_seconds(key)
                pending[key] = (worker_free, batch + config.switch_after)
                compiles += 1
                compile_seconds += model.compile_seconds(key)
            resident = cache.keys()  # a snapshot (the cache is not iterable)
            larger = [k for k in resident if isinstance(k, ModelKey) and dominates(k, key)]
            if larger:
                padded += 1
                seconds = model.run_seconds(min(larger, key=lambda k: (k.tokens, k.segments)))
            else:
                eager += 1
                seconds = model.run_seconds(key)
        if t > now:
            stalls.append(t - now)
        run += seconds
        now = t + seconds
    stalls.sort()
    n = len(keys)
    return ModelStallRow(config.policy, config.max_graphs, config.compile_mode, config.switch_after, n,
                         compiles, compile_seconds, padded, eager, run, sum(stalls),
                         percentile(stalls, n, 0.5), percentile(stalls, n, 0.99),
                         stalls[-1] if stalls else 0.0, len(stalls))


def compare_model_stalls(layouts: Sequence[BatchLayout], model: ModelCostModel, configs: Sequence[AttnPolicyConfig]
                         ) -> list[ModelStallRow]:
    """For each config, its ``sync`` row then its ``background`` row."""
    return [model_stall_row(layouts, model, config.model_copy(update={"compile_mode": mode}))
            for config in configs for mode in ("sync", "background")]


def _itself(key: ModelKey) -> Callable[[], ModelKey]:
    """The modelled build of ``key``'s graph: the key stands for its graph."""
    return lambda: key
