"""Replay a stream of graph requests through a bounded cache's eviction, without graphs.

:func:`replay_stream` gives the counters a :class:`~attnpolicy.cache.graph_cache.GraphCache`
with the same bounds, eviction, ``sizeof``, ``compile_cost`` and ``oversize`` would
report after serving the same requests in order with builds that never fail: the
same eviction structure (:func:`~attnpolicy.cache.graph_cache.make_eviction`) is
touched the same way (a hit reads ``s[key]``, a miss evicts with ``popitem()`` until
the graph fits, then ``note``\\s and inserts it), without the cache's locks, futures,
per-key statistics and callbacks. Pins do not change these counters (a pinned graph
is evicted like any other; pins only delay its release), so the stream needs none.
A simulation replays one recorded stream through many bounds and evictions with it.

Keys are ints ``0..n-1`` (positions in ``sizes`` and ``costs``), so lookups hash ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from attnpolicy.cache.graph_cache import make_eviction
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


def next_uses(stream: Sequence[Hashable]) -> list[float]:
    """For each position, the position of the same key's next request (``inf``: none)."""
    out: list[float] = [math.inf] * len(stream)
    last: dict[Hashable, float] = {}
    for i in range(len(stream) - 1, -1, -1):
        key = stream[i]
        out[i] = last.get(key, math.inf)
        last[key] = i
    return out


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
) -> StreamStats:
    """Serve ``stream`` (key ids) in order; key ``i`` has ``sizes[i]`` bytes and costs
    ``costs[i]`` compile seconds. ``belady`` gets its ``next_use`` oracle from the
    stream itself. A graph over ``max_bytes`` raises :class:`GraphTooLargeError`
    (naming ``name(i)``) under ``oversize="raise"``, and is built but not kept under
    ``"uncached"``, as in the graph cache."""
    upcoming: list[float] = [math.inf] * len(sizes)
    if eviction == BELADY:
        eviction_options = {"next_use": upcoming.__getitem__}
    order = make_eviction(eviction, eviction_options)
    note = getattr(order, "note", None)
    hits = misses = compiles = evictions = uncached = 0
    seconds = 0.0
    nbytes = peak_graphs = peak_bytes = 0
    cap = math.inf if max_graphs is None else max_graphs
    limit = math.inf if max_bytes is None else max_bytes
    futures = next_uses(stream) if eviction == BELADY else None
    for i, key in enumerate(stream):
        if futures is not None:
            upcoming[key] = futures[i]
        try:
            order[key]
        except KeyError:
            pass
        else:
            hits += 1
            continue
        misses += 1
        size = sizes[key]
        if size > limit:
            if oversize == "raise":
                raise GraphTooLargeError(
                    f"the graph for key {name(key)} needs {size} bytes, more than max_bytes={max_bytes}")
            compiles += 1
            seconds += costs[key]
            uncached += 1
            continue
        compiles += 1
        cost = costs[key]
        seconds += cost
        while len(order) >= cap or nbytes + size > limit:
            victim, _ = order.popitem()
            evictions += 1
            nbytes -= sizes[cast(int, victim)]
        if note is not None:
            note(key, cost=cost, size=size)
        order[key] = key
        nbytes += size
        if len(order) > peak_graphs:
            peak_graphs = len(order)
        if nbytes > peak_bytes:
            peak_bytes = nbytes
    return StreamStats(hits, misses, compiles, seconds, evictions, uncached, peak_graphs, peak_bytes)
