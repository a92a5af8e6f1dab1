"""Replay a stream of graph requests through a bounded cache's eviction, without graphs.

:func:`replay_stream` gives the counters a :class:`~attnpolicy.cache.graph_cache.GraphCache`
with the same bounds, eviction, ``sizeof``, ``compile_cost`` and ``oversize`` would
report after serving the same requests in order with builds that never fail: the
same eviction structure (:func:`~attnpolicy.plugins.registry.make_eviction`) is
touched the same way (a hit reads ``s[key]``, a miss evicts with ``popitem()`` until
the graph fits, then ``note``\\s and inserts it), without the cache's locks, futures,
per-key statistics and callbacks. Pins do not change these counters (a pinned graph
is evicted like any other; pins only delay its release), so the stream needs none.
A simulation replays one recorded stream through many bounds and evictions with it.

:class:`StreamCache` is that bookkeeping for one request at a time (cost-aware's
shadow caches use it too); for the ``lru`` and ``fifo`` orders without a disk it
also serves a whole stream in one loop (:meth:`StreamCache.serve_ordered`).
:func:`replay_stream`'s keys are ints ``0..n-1`` (positions in ``sizes`` and
``costs``), so lookups hash ints. With a ``disk``
(:class:`~attnpolicy.cache.disk_mirror.DiskMirror`, the graph store modelled) a miss
of a key on the disk is a load, any other a compile saved to the disk.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import cachetools
import numpy as np

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.core.names import Oversize
from attnpolicy.errors import GraphTooLargeError
from attnpolicy.plugins.registry import make_eviction

BELADY = "belady"


@dataclass(frozen=True, slots=True)
class StreamStats:
    """The counters of a replayed stream, as :class:`~attnpolicy.cache.graph_cache.CacheStats`
    names them."""

    hits: int
    misses: int
    compiles: int
    compile_seconds: float
    evictions: int
    uncached: int
    peak_graphs: int
    peak_bytes: int
    loads: int = 0  # misses served by the disk tier
    load_seconds: float = 0.0
    disk_evictions: int = 0
    disk_peak_bytes: int = 0
    #: each distinct key's first miss at its cheapest when the disk held some before
    #: the replay (a warm store); ``None``: their compile seconds
    first_miss_seconds: float | None = None


def next_uses(stream: Sequence[Hashable]) -> list[float]:
    """For each position, the position of the same key's next request (``inf``: none)."""
    out: list[float] = [math.inf] * len(stream)
    last: dict[Hashable, float] = {}
    for i in range(len(stream) - 1, -1, -1):
        key = stream[i]
        out[i] = last.get(key, math.inf)
        last[key] = i
    return out


class StreamCache:
    """The bookkeeping of a bounded graph cache without graphs: the eviction order of
    the keys it holds, their bytes, and the counters of its misses. A request is
    ``cache.touch(key)``, which raises ``KeyError`` on a miss (the caller counts hits);
    :meth:`miss` then evicts until the graph fits and inserts it. No lock: for one
    thread (a simulation, a policy's shadow of the cache).

    The order is the registered strategy's structure
    (:func:`~attnpolicy.plugins.registry.make_eviction`), touched as the graph cache
    touches it (a hit reads ``order[key]``, a miss ``popitem()``\\s then ``note``\\s and
    inserts). cachetools' ``LRUCache`` and ``FIFOCache`` (the ``lru`` and ``fifo``
    strategies) are kept as the ``OrderedDict`` they are inside, in C: a hit moves
    the key to the end (LRU) or changes nothing (FIFO), eviction pops the front."""

    __slots__ = ("_cap", "_limit", "_name", "_note", "_oversize", "_pop", "_sizes", "compile_seconds",
                 "compiles", "disk", "evictions", "max_bytes", "misses", "nbytes", "order", "peak_bytes", "peak_graphs",
                 "touch", "uncached")

    def __init__(self, *, max_graphs: int | None = None, max_bytes: int | None = None, eviction: str = "lru",
                 oversize: Oversize = "raise", eviction_options: dict[str, Any] | None = None,
                 name: Callable[[Any], object] = str, disk: DiskMirror | None = None) -> None:
        structure = make_eviction(eviction, eviction_options)
        self.order: MutableMapping[Hashable, Any]
        if type(structure) in (cachetools.LRUCache, cachetools.FIFOCache):
            order: OrderedDict[Hashable, Any] = OrderedDict()
            lru = type(structure) is cachetools.LRUCache
            self.order = order
            self.touch: Callable[[Hashable], object] = order.move_to_end if lru else order.__getitem__
            self._pop: Callable[[], tuple[Hashable, Any]] = partial(order.popitem, last=False)
            self._note = None
        else:
            self.order = structure
            self.touch = structure.__getitem__
            self._pop = structure.popitem
            self._note = getattr(structure, "note", None)
        self._cap = math.inf if max_graphs is None else max_graphs
        self._limit = math.inf if max_bytes is None else max_bytes
        self.max_bytes = max_bytes
        self._oversize = oversize
        self._name = name
        self.disk = disk
        self._sizes: dict[Hashable, int] = {}
        self.misses = self.compiles = self.evictions = self.uncached = 0
        self.compile_seconds = 0.0
        self.nbytes = self.peak_graphs = self.peak_bytes = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    @property
    def held(self) -> Mapping[Hashable, int]:
        """The keys held now, with their bytes (a live view: do not change it)."""
        return self._sizes

    def keys(self) -> list[Hashable]:
        """The keys held now (a snapshot)."""
        return list(self._sizes)

    def miss(self, key: Hashable, size: int, cost: float) -> None:
        """Serve a request for ``key`` (not held) whose graph has ``size`` bytes and
        costs ``cost`` compile seconds. A graph over ``max_bytes`` raises
        :class:`GraphTooLargeError` (naming ``name(key)``) under ``oversize="raise"``,
        and is built but not kept under ``"uncached"``, as in the graph cache. With a
        ``disk`` a key on it is loaded instead; a compiled one is saved to it. The
        eviction is told ``cost`` either way, as the graph cache tells it."""
        self.misses += 1
        if size > self._limit and self._oversize == "raise":
            raise self._too_large(key, size)
        disk = self.disk
        if disk is None or disk.load(key) is None:
            self.compiles += 1
            self.compile_seconds += cost
            if disk is not None:
                disk.save(key)
        if size > self._limit:
            self.uncached += 1
            return
        order, sizes, pop = self.order, self._sizes, self._pop
        while len(order) >= self._cap or self.nbytes + size > self._limit:
            victim, _ = pop()
            self.evictions += 1
            self.nbytes -= sizes.pop(victim)
        if self._note is not None:
            self._note(key, cost=cost, size=size if self.max_bytes is not None else 1)
        order[key] = key
        sizes[key] = size
        self.nbytes += size
        if len(order) > self.peak_graphs:
            self.peak_graphs = len(order)
        if self.nbytes > self.peak_bytes:
            self.peak_bytes = self.nbytes

    def _too_large(self, key: Hashable, size: int) -> GraphTooLargeError:
        return GraphTooLargeError(
            f"the graph for key {self._name(key)} needs {size} bytes, more than max_bytes={self.max_bytes}")

    def serve_ordered(self, stream: Sequence[int], sizes: Sequence[int], costs: Sequence[float],
                      counts: Sequence[int] | None = None) -> int:
        """Serve every request of ``stream`` (key ids) in order, each a :meth:`touch` and,
        when that misses, a :meth:`miss` with ``sizes[key]`` and ``costs[key]``; returns the hits.
        Only for the ``lru`` and ``fifo`` orders (an ``OrderedDict``), whose
        bookkeeping this is with :meth:`miss` inlined: the same victims, counters and
        sums in the same order, without a call per miss. ``counts``: ``stream[i]`` is
        requested ``counts[i]`` times in a row (a run: after its first request the key
        is held and last in the order, so the rest are hits that change nothing, unless
        it is too large to keep: each request misses)."""
        order = self.order
        assert isinstance(order, OrderedDict), "serve_ordered needs the lru or fifo order"
        touch, pop, held = self.touch, order.popitem, self._sizes
        cap, limit, refuse = self._cap, self._limit, self._oversize == "raise"
        misses = compiles = evictions = uncached = 0
        seconds, nbytes, peak_graphs, peak_bytes = self.compile_seconds, self.nbytes, self.peak_graphs, self.peak_bytes
        total = len(stream)
        if counts is not None:
            total = sum(counts)
            if limit < math.inf and any(sizes[key] > limit for key in set(stream)):  # never kept: each misses
                stream = [key for key, n in zip(stream, counts) for _ in range(n if sizes[key] > limit else 1)]
        try:
            for key in stream:
                try:
                    touch(key)
                    continue
                except KeyError:
                    pass
                misses += 1
                size = sizes[key]
                if size > limit:
                    if refuse:
                        raise self._too_large(key, size)
                    compiles += 1
                    seconds += costs[key]
                    uncached += 1
                    continue
                compiles += 1
                seconds += costs[key]
                while len(order) >= cap or nbytes + size > limit:
                    victim, _ = pop(last=False)
                    evictions += 1
                    nbytes -= held.pop(victim)
                order[key] = key
                held[key] = size
                nbytes += size
                if len(order) > peak_graphs:
                    peak_graphs = len(order)
                if nbytes > peak_bytes:
                    peak_bytes = nbytes
        finally:
            self.misses += misses
            self.compiles += compiles
            self.evictions += evictions
            self.uncached += uncached
            self.compile_seconds, self.nbytes = seconds, nbytes
            self.peak_graphs, self.peak_bytes = peak_graphs, peak_bytes
        return total - misses


def runs(ids: Sequence[int] | np.ndarray) -> tuple[list[int], list[int]]:
    """``ids`` as runs: each run's key and how many times it is requested in a row."""
    a = np.asarray(ids, dtype=np.int64)
    if not a.size:
        return [], []
    starts = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
    return a[starts].tolist(), np.diff(np.append(starts, a.size)).tolist()


def replay_stream(
    stream: Sequence[int],
    sizes: Sequence[int],
    costs: Sequence[float],
    *,
    max_graphs: int | None = None,
    max_bytes: int | None = None,
    eviction: str = "lru",
    oversize: Oversize = "raise",
    eviction_options: dict[str, Any] | None = None,
    name: Callable[[int], object] = str,
    disk: DiskMirror | None = None,
    counts: Sequence[int] | None = None,
) -> StreamStats:
    """Serve ``stream`` (key ids) in order through a :class:`StreamCache`; key ``i`` has
    ``sizes[i]`` bytes and costs ``costs[i]`` compile seconds. ``belady`` gets its
    ``next_use`` oracle from the stream itself; ``lru`` and ``fifo`` without a ``disk``
    are served by :meth:`StreamCache.serve_ordered`. ``disk``: the graph store
    modelled (its counters are this replay's: zero them before a replay that reuses one).
    ``counts``: ``stream`` is runs (:func:`runs`), ``stream[i]`` requested ``counts[i]``
    times in a row; the counters are those of the expanded stream. Belady's oracle
    counts positions in runs (the same order of next uses: no key is evicted within a
    run, which hits until its end)."""
    upcoming: list[float] = [math.inf] * len(sizes)
    if eviction == BELADY:
        eviction_options = {"next_use": upcoming.__getitem__}
    cache = StreamCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction, oversize=oversize,
                        eviction_options=eviction_options, name=name, disk=disk)
    if disk is None and isinstance(cache.order, OrderedDict):
        hits = cache.serve_ordered(stream, sizes, costs, counts)
    else:
        touch, miss = cache.touch, cache.miss
        hits = 0
        futures = next_uses(stream) if eviction == BELADY else None
        for i, key in enumerate(stream):
            if futures is not None:
                upcoming[key] = futures[i]
            for _ in range(1 if counts is None else counts[i]):  # a run: the same requests in order
                try:
                    touch(key)
                except KeyError:
                    miss(key, sizes[key], costs[key])
                else:
                    hits += 1
    if disk is None:
        return StreamStats(hits, cache.misses, cache.compiles, cache.compile_seconds, cache.evictions,
                           cache.uncached, cache.peak_graphs, cache.peak_bytes)
    return StreamStats(hits, cache.misses, cache.compiles, cache.compile_seconds, cache.evictions,
                       cache.uncached, cache.peak_graphs, cache.peak_bytes, disk.loads, disk.load_seconds,
                       disk.evictions, disk.peak_bytes)
