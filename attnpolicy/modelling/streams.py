"""A recorded key stream replayed through a graph cache's bounds and evictions, over
the graph store modelled when the config has one (:mod:`attnpolicy.modelling.tiers`).

A stateless policy requests the same graphs under any bound and eviction: the
simulation records its key stream once and replays it per bound × eviction
(:func:`~attnpolicy.cache.key_stream.replay_stream`); the planner builds one from
its call table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.key_stream import StreamStats, replay_stream, runs
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey
from attnpolicy.modelling.tiers import StoreModel, compulsory_seconds, reload_option


@dataclass(frozen=True)
class KeyStream:
    """A recorded key stream as runs of ids (first request order): ``ids[i]`` requested
    ``counts[i]`` times in a row (:func:`~attnpolicy.cache.key_stream.runs`), with each
    key's bytes and compile seconds; ``compulsory`` is every distinct key compiled once.
    ``model`` sizes and times each key in a graph store, when one is modelled."""

    ids: list[int]
    counts: list[int]
    keys: list[GraphKey]
    sizes: list[int]
    costs: list[float]
    compulsory: float
    model: CostModel | None = None

    @classmethod
    def of(cls, keys: Sequence[GraphKey], model: CostModel) -> KeyStream:
        index: dict[GraphKey, int] = {}
        ids = [index.setdefault(key, len(index)) for key in keys]
        return cls.of_ids(ids, list(index), model)

    @classmethod
    def of_ids(cls, ids: Sequence[int] | np.ndarray, keys: list[GraphKey], model: CostModel) -> KeyStream:
        """The stream of ``ids`` into ``keys`` (ids numbered in first-request order)."""
        costs = [model.compile_cost(key, 0.0) for key in keys]
        return cls(*runs(ids), keys, [model.graph_bytes(key) for key in keys], costs, sum(costs), model)

    @cached_property
    def fingerprint(self) -> tuple[tuple[GraphKey, ...], bytes]:
        """Equal for two streams of the same requests of the same keys, bytes and seconds:
        the keys, and a BLAKE2b digest of the runs, bytes and seconds."""
        digest = hashlib.blake2b(digest_size=32)
        for column, dtype in ((self.ids, np.int64), (self.counts, np.int64), (self.sizes, np.int64),
                              (self.costs, np.float64)):
            digest.update(np.asarray(column, dtype=dtype).tobytes())
        return tuple(self.keys), digest.digest()

    @cached_property
    def _store(self) -> tuple[list[int], list[float], list[bool]]:
        """Each key's bytes on disk, load seconds and whether it is stored."""
        model = self.model
        assert model is not None  # only a stream with a model replays through a store
        return ([model.stored_bytes(k) for k in self.keys], [model.load_seconds(k) for k in self.keys],
                [model.stored(k) for k in self.keys])

    def stored_after(self, config: AttnPolicyConfig, eviction: str) -> set[int]:
        """The key ids ``config``'s store holds after one replay from empty (none without a store)."""
        store = StoreModel.of(config)
        if store is None:
            return set()
        disk = self._disk(store)
        self._replay(config, eviction, disk)
        return {k for k in disk if isinstance(k, int)}

    def _disk(self, store: StoreModel) -> DiskMirror:
        assert self.model is not None
        self.model.require_store(f"(backend {self.model.backend})")
        sizes, loads, stored = self._store
        return DiskMirror(store.max_disk_bytes, sizes.__getitem__, loads.__getitem__,  # type: ignore[arg-type]
                          stored.__getitem__)  # type: ignore[arg-type]

    def replay(self, config: AttnPolicyConfig, eviction: str, store_warm: bool = False) -> StreamStats:
        """The counters of a graph cache bounded like ``config`` with ``eviction``, over
        ``config``'s graph store if it has one (``store_warm``: filled by a first replay)."""
        store = StoreModel.of(config, store_warm)
        if store is None:
            return self._replay(config, eviction, None)
        disk = self._disk(store)
        if not store_warm:
            return self._replay(config, eviction, disk)
        self._replay(config, eviction, disk)
        disk.reset_counters()
        first = compulsory_seconds(range(len(self.keys)), self.costs, set(disk), self._store[1].__getitem__)
        return replace(self._replay(config, eviction, disk), first_miss_seconds=first)

    def _replay(self, config: AttnPolicyConfig, eviction: str, disk: DiskMirror | None) -> StreamStats:
        """One replay from the cache empty, bounded like ``config``, over ``disk`` if given."""
        return replay_stream(self.ids, self.sizes, self.costs, max_graphs=config.max_graphs,
                             max_bytes=config.max_bytes, eviction=eviction, oversize=config.oversize,
                             eviction_options=reload_option(eviction, disk), name=self.keys.__getitem__, disk=disk,
                             counts=self.counts)
