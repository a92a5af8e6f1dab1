"""The graph store modelled under a simulated graph cache: a memory miss served from disk.

A config with ``store_dir`` set runs with a :class:`~attnpolicy.cache.disk_store.DiskStore`
bounded by ``max_disk_bytes``; simulation, stall modelling and the planner model it
with a :class:`~attnpolicy.cache.disk_mirror.DiskMirror` of the same bound and LRU
order, sized and timed by the cost model's ``store_bytes`` and ``store_load`` fits:
a memory miss whose key is on the modelled disk costs its load seconds, any other
its compile seconds, and is then saved to the disk. ``warm``: the store starts with
what a previous run of the same traffic and config left on it (the run is replayed
once first, its counters dropped). Nothing is written to disk. See docs/simulate.md.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.cache.key_stream import StreamStats
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel

V = TypeVar("V")
#: The eviction strategy that weighs a reload against a recompile (its ``reload`` option).
COST = "cost"


@dataclass(frozen=True)
class StoreModel:
    """The graph store a simulation models: its bound and whether it starts warm."""

    max_disk_bytes: int
    warm: bool = False

    @classmethod
    def of(cls, config: AttnPolicyConfig, warm: bool = False) -> StoreModel | None:
        """The store of ``config`` (``None`` without ``store_dir``); ``warm`` needs one."""
        if config.store_dir is None:
            if warm:
                raise ConfigError("a warm store needs a store: set store_dir (or --store-bytes)")
            return None
        return cls(config.max_disk_bytes, warm)

    def disk(self, model: CostModel) -> DiskMirror:
        """An empty mirror of this store for graph keys, on ``model``'s fits."""
        model.require_store(f"(backend {model.backend}, {model.torch_version or 'torch unknown'})")
        return DiskMirror(self.max_disk_bytes, model.stored_bytes, model.load_seconds, model.stored)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StoreFigures:
    """The disk tier of a modelled run: its bound, whether it started warm, the memory
    misses it served (``loads``, ``load_seconds``), the artifacts it evicted and its
    peak bytes."""

    max_disk_bytes: int
    warm: bool
    loads: int
    load_seconds: float
    disk_evictions: int
    disk_peak_bytes: int

    @classmethod
    def of(cls, store: StoreModel, stats: StreamStats) -> StoreFigures:
        return cls(store.max_disk_bytes, store.warm, stats.loads, stats.load_seconds, stats.disk_evictions,
                   stats.disk_peak_bytes)


def reload_option(eviction: str, disk: DiskMirror | None) -> dict[str, Any] | None:
    """The eviction options that tell ``cost`` what is on ``disk`` (``None``: no options)."""
    return {"reload": disk.reload_seconds} if disk is not None and eviction == COST else None


def compulsory_seconds(keys: Sequence[Any], costs: Sequence[float], held: Container[Any],
                       load_cost: Callable[[Any], float]) -> float:
    """Each distinct key's first miss at its cheapest: loaded (``load_cost``) when a warm
    store ``held`` it before the run, else compiled (``costs``, in ``keys`` order)."""
    return sum(load_cost(key) if key in held else cost for key, cost in zip(keys, costs))


class DiskBackedCache(GraphCache[V]):
    """A simulated :class:`GraphCache` over a :class:`DiskMirror`: a miss of a key on the
    mirror is served by a load (counted by the mirror, on the modelled clock), any other
    is built and saved to the mirror, as the dispatcher's graph source does with a store."""

    def __init__(self, *args: Any, disk: DiskMirror, **options: Any) -> None:
        super().__init__(*args, **options)
        self.disk = disk

    def get_or_compile(self, key: Hashable, build: Callable[[], V], *, pin: bool = False,
                       seconds: float | None = None, load: Callable[[], V | None] | None = None) -> V:
        return super().get_or_compile(key, partial(self._build, key, build), pin=pin, seconds=seconds,
                                      load=partial(self._load, key, build))

    def _load(self, key: Hashable, build: Callable[[], V]) -> V | None:
        return None if self.disk.load(key) is None else build()

    def _build(self, key: Hashable, build: Callable[[], V]) -> V:
        value = build()
        self.disk.save(key)
        return value


class StoredRuns:
    """Dispatcher runs of one config over its modelled store: the caches they use (one
    :class:`DiskBackedCache` per run, one mirror for all), and their counters."""

    def __init__(self, store: StoreModel, config: AttnPolicyConfig, model: CostModel) -> None:
        self.config = config
        self.model = model
        self.disk = store.disk(model)
        self._held: set[Hashable] | None = None

    def cache(self) -> GraphCache[Any]:
        """A fresh memory cache over the store (``cost`` told what is on disk)."""
        model = self.model
        return DiskBackedCache.from_config(self.config, disk=self.disk, sizeof=model.graph_bytes,
                                           compile_cost=model.compile_cost,
                                           eviction_options=reload_option(self.config.eviction, self.disk))

    def warmed(self) -> None:
        """The run just made filled the store: the next run starts from it, counters zeroed."""
        self.disk.reset_counters()
        self._held = set(self.disk)

    def counted(self, stats: StreamStats, keys: Sequence[Any]) -> StreamStats:
        """``stats`` of the last run's memory cache with the store's counters (and, after
        :meth:`warmed`, each distinct key's cheapest first miss)."""
        disk, first = self.disk, None
        if self._held is not None:
            distinct = list(dict.fromkeys(keys))
            first = compulsory_seconds(distinct, [self.model.compile_cost(k, 0.0) for k in distinct], self._held,
                                       self.model.load_seconds)
        return replace(stats, loads=disk.loads, load_seconds=disk.load_seconds, disk_evictions=disk.evictions,
                       disk_peak_bytes=disk.peak_bytes, first_miss_seconds=first)
