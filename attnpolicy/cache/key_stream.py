"""Replay a stream of graph requests through a bounded cache's eviction, without graphs.

:func:`replay_stream` gives the counters a :class:`~attnpolicy.cache.graph_cache.GraphCache`
with the same bounds, eviction, ``sizeof``, ``compile_cost`` and ``oversize`` would
report after serving the same requests in order with builds that never fail: the
same eviction rule (:class:`~attnpolicy.core.bounded_order.BoundedOrder`, over the
structure of :func:`~attnpolicy.cache.eviction_registry.make_eviction`) is run the same way
(a hit reads ``s[key]``, a miss admits the graph), without the cache's locks, futures,
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
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.eviction_registry import make_eviction
from attnpolicy.core.bounded_order import BoundedOrder, OrderFigures
from attnpolicy.core.names import Oversize
from attnpolicy.errors import GraphTooLargeError

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


class StreamCache(OrderFigures):
    """The bookkeeping of a bounded graph cache without graphs: the keys it holds in
    their eviction order, their bytes, and the counters of its misses. A request is
    ``cache.touch(key)``, which raises ``KeyError`` on a miss (the caller counts hits);
    :meth:`miss` then evicts until the graph fits and inserts it. No lock: for one
    thread (a simulation, a policy's shadow of the cache).

    The keys are a :class:`~attnpolicy.core.bounded_order.BoundedOrder` of the
    registered strategy's structure (:func:`~attnpolicy.cache.eviction_registry.make_eviction`),
    the graph cache's own eviction rule, touched as the graph cache touches it;
    ``lru`` and ``fifo`` are kept as their ``OrderedDict`` (``ordered``)."""

    __slots__ = ("_fits", "_name", "_order", "_oversize", "compile_seconds", "compiles", "disk", "held",
                 "max_bytes", "misses", "touch", "uncached")

    def __init__(self, *, max_graphs: int | None = None, max_bytes: int | None = None, eviction: str = "lru",
                 oversize: Oversize = "raise", eviction_options: dict[str, Any] | None = None,
                 name: Callable[[Any], object] = str, disk: DiskMirror | None = None) -> None:
        self._order: BoundedOrder[Hashable, Hashable] = BoundedOrder(
            make_eviction(eviction, eviction_options), max_graphs=max_graphs, max_bytes=max_bytes, ordered=True)
        self.touch: Callable[[Hashable], object] = self._order.touch
        #: the keys held now, with their bytes (a live view: do not change it)
        self.held: Mapping[Hashable, int] = self._order.sizes
        self._fits = self._order.fits
        self.max_bytes = max_bytes
        self._oversize = oversize
        self._name = name
        self.disk = disk
        self.misses = self.compiles = self.uncached = 0
        self.compile_seconds = 0.0

    @property
    def order(self) -> Mapping[Hashable, Hashable]:
        """The keys held in the strategy's structure (for reading)."""
        return self._order.entries

    def keys(self) -> list[Hashable]:
        """The keys held now (a snapshot)."""
        return list(self._order.sizes)

    def miss(self, key: Hashable, size: int, cost: float) -> None:
        """Serve a request for ``key`` (not held) whose graph has ``size`` bytes and
        costs ``cost`` compile seconds. A graph over ``max_bytes`` raises
        :class:`GraphTooLargeError` (naming ``name(key)``) under ``oversize="raise"``,
        and is built but not kept under ``"uncached"``, as in the graph cache. With a
        ``disk`` a key on it is loaded instead; a compiled one is saved to it. The
        eviction is told ``cost`` either way, as the graph cache tells it."""
        self.misses += 1
        fits = self._fits(size)
        if not fits and self._oversize == "raise":
            raise self._too_large(key, size)
        disk = self.disk
        if disk is None or disk.load(key) is None:
            self.compiles += 1
            self.compile_seconds += cost
            if disk is not None:
                disk.save(key)
        if not fits:
            self.uncached += 1
            return
        self._order.admit(key, key, size, cost)

    def _too_large(self, key: Hashable, size: int) -> GraphTooLargeError:
        return GraphTooLargeError(
            f"the graph for key {self._name(key)} needs {size} bytes, more than max_bytes={self.max_bytes}")

    def serve_ordered(self, stream: Sequence[int], sizes: Sequence[int], costs: Sequence[float],
                      counts: Sequence[int] | None = None) -> int:
        """Serve every request of ``stream`` (key ids) in order, each a :meth:`touch` and,
        when that misses, a :meth:`miss` with ``sizes[key]`` and ``costs[key]``; returns the hits.
        Only for the ``lru`` and ``fifo`` orders without a disk (an ``OrderedDict``),
        whose requests :meth:`BoundedOrder.serve <attnpolicy.core.bounded_order.BoundedOrder.serve>`
        serves in one loop, with the same victims; the counters are then added up in
        request order, as :meth:`miss` adds them. ``counts``: ``stream[i]`` is
        requested ``counts[i]`` times in a row (a run: after its first request the key
        is held and last in the order, so the rest are hits that change nothing, unless
        it is too large to keep: each request misses)."""
        core = self._order
        assert isinstance(core.entries, OrderedDict) and self.disk is None, \
            "serve_ordered needs the lru or fifo order, without a disk"
        total = len(stream)
        too_large = set() if core.max_bytes is None else {  # never kept: each of their requests misses
            key for key in set(stream) if not core.fits(sizes[key])}
        if counts is not None:
            total = sum(counts)
            if too_large:
                stream = [key for key, n in zip(stream, counts) for _ in range(n if key in too_large else 1)]
        refused = None  # under "raise", the first request of a key too large to keep raises
        if too_large and self._oversize == "raise":
            at = next((i for i, key in enumerate(stream) if key in too_large), None)
            if at is not None:
                refused, stream = stream[at], stream[:at]
        missed = cast(list[int], core.serve(stream, cast(Callable[[Hashable], int], sizes.__getitem__), too_large))
        seconds = self.compile_seconds
        for key in missed:
            seconds += costs[key]
        self.compile_seconds = seconds
        self.misses += len(missed)
        self.compiles += len(missed)
        if too_large:
            self.uncached += sum(key in too_large for key in missed)
        if refused is not None:
            self.misses += 1
            raise self._too_large(refused, sizes[refused])
        return total - len(missed)


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
    if disk is None and isinstance(cache.order, OrderedDict):  # lru, fifo
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
