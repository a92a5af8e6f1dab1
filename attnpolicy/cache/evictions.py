"""Eviction strategies: ``cachetools.Cache`` structures used only to order victims.

:class:`~attnpolicy.cache.graph_cache.GraphCache` builds one structure per cache with
``factory(**eviction_options)``; the structure is unbounded (``maxsize=inf``) and
the GraphCache enforces its own bounds, asking ``popitem()`` for the victim. It
touches a structure only through ``s[key]`` (a hit: updates recency/frequency),
``s[key] = entry`` (an insert), ``key in s`` (no side effect), ``popitem()``,
``pop``, iteration, ``len`` and ``clear``.

Per-entry metadata: a structure with a ``note(key, *, cost, size)`` method is
told, just before each insert, the entry's measured compile seconds (``cost``)
and what it occupies of the bound that evicts (``size``): its bytes in a cache with
a byte bound, 1 in a cache bounded by graph count alone (a large graph takes one
slot like a small one, so ranking by bytes there would evict large graphs whatever
their use). Strategies needing other inputs take them as factory
options (``belady`` takes ``next_use``; ``cost`` takes ``reload``, the seconds to
bring a key back from a graph store below the cache).

Built-ins (registered through the ``attnpolicy_register_evictions`` hook):
``lru``, ``lfu``, ``fifo`` (cachetools' own), ``cost`` (:class:`GDSFCache`) and
``belady`` (:class:`BeladyCache`, offline optimum for simulations).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import cachetools

from attnpolicy.plugins.hookspecs import hookimpl


@dataclass(slots=True)
class _Priority:
    priority: float
    seq: int
    freq: int
    cost: float
    size: int
    aged: float = 0.0  # ``L`` when the priority was last set


class GDSFCache(cachetools.Cache[Hashable, Any]):
    """Greedy-Dual-Size-Frequency ordering: evicts the entry with the lowest priority

    ``H = L + freq * cost / size``, where ``cost`` is the entry's compile seconds,
    ``size`` the size it was noted with (at least 1), ``freq`` its uses since it was inserted (the
    insert counts as 1) and ``L`` the priority of the last victim (aging: entries
    inserted or used later start higher, so old frequent entries eventually go).
    ``H`` is recomputed on every use. Ties go to the entry inserted first.
    Entries inserted without :meth:`note` have cost 0 and size 1.

    ``reload(key)``: the seconds to bring ``key`` back from a lower tier (a graph store
    on disk), ``None`` when it is not there. With it, a key's ``cost`` is what its
    eviction would cost now: its reload seconds while it is on disk, its compile
    seconds otherwise; asked when a victim is chosen, since the disk evicts too.
    """

    def __init__(self, reload: Callable[[Hashable], float | None] | None = None) -> None:
        if reload is not None and not callable(reload):
            raise TypeError(f"reload must be callable, got {reload!r}")
        super().__init__(math.inf)
        self._reload = reload
        self._meta: dict[Hashable, _Priority] = {}
        self._noted: dict[Hashable, tuple[float, int]] = {}
        self._age = 0.0
        self._seq = itertools.count()

    def note(self, key: Hashable, *, cost: float, size: int) -> None:
        """Record the compile seconds and bytes of the entry about to be inserted."""
        self._noted[key] = (float(cost), max(int(size), 1))

    def __getitem__(self, key: Hashable) -> Any:
        value = super().__getitem__(key)
        meta = self._meta[key]
        meta.freq += 1
        meta.priority = self._age + meta.freq * meta.cost / meta.size
        meta.aged = self._age
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        super().__setitem__(key, value)
        cost, size = self._noted.pop(key, (0.0, 1))
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = _Priority(0.0, next(self._seq), 0, cost, size)
        meta.freq += 1
        meta.cost, meta.size = cost, size
        meta.priority = self._age + meta.freq * cost / size
        meta.aged = self._age

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        del self._meta[key]

    def popitem(self) -> tuple[Hashable, Any]:
        """Remove and return the entry with the lowest priority; ``L`` becomes its priority."""
        if not self._meta:
            raise KeyError(f"{type(self).__name__} is empty")
        if self._reload is not None:
            for k, meta in self._meta.items():
                restore = self._reload(k)
                cost = meta.cost if restore is None else restore
                meta.priority = meta.aged + meta.freq * cost / meta.size
        key = min(self._meta, key=lambda k: (self._meta[k].priority, self._meta[k].seq))
        self._age = self._meta[key].priority
        value = cachetools.Cache.__getitem__(self, key)
        del self[key]
        return key, value

    def clear(self) -> None:
        super().clear()
        self._meta.clear()
        self._noted.clear()

    def priority(self, key: Hashable) -> float:
        """The current priority ``H`` of a cached key (for reports and tests)."""
        return self._meta[key].priority


class BeladyCache(cachetools.Cache[Hashable, Any]):
    """Belady's offline optimum: evicts the entry whose next request is farthest away.

    ``next_use(key)`` must return the index of ``key``'s next request after the
    current one (``math.inf`` if never); it is asked at eviction time, so a
    simulator advances its position before each request. Ties (e.g. several keys
    never used again) go to the entry inserted first. With a graph-count bound this
    is the fewest possible misses for the sequence — the bound for online
    strategies; with a byte bound and unequal sizes it is a heuristic.
    """

    def __init__(self, next_use: Callable[[Hashable], float]) -> None:
        if not callable(next_use):
            raise TypeError(f"next_use must be callable, got {next_use!r}")
        super().__init__(math.inf)
        self._next_use = next_use
        self._seq: dict[Hashable, int] = {}
        self._counter = itertools.count()

    def __setitem__(self, key: Hashable, value: Any) -> None:
        super().__setitem__(key, value)
        if key not in self._seq:
            self._seq[key] = next(self._counter)

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        del self._seq[key]

    def popitem(self) -> tuple[Hashable, Any]:
        """Remove and return the entry used farthest in the future."""
        if not self._seq:
            raise KeyError(f"{type(self).__name__} is empty")
        key = max(self._seq, key=lambda k: (self._next_use(k), -self._seq[k]))
        value = cachetools.Cache.__getitem__(self, key)
        del self[key]
        return key, value

    def clear(self) -> None:
        super().clear()
        self._seq.clear()


BUILTIN: dict[str, Callable[..., cachetools.Cache[Hashable, Any]]] = {
    "lru": partial(cachetools.LRUCache, math.inf),
    "lfu": partial(cachetools.LFUCache, math.inf),
    "fifo": partial(cachetools.FIFOCache, math.inf),
    "cost": GDSFCache,
    "belady": BeladyCache,
}


@hookimpl
def attnpolicy_register_evictions(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register the built-in strategies."""
    for name, factory in BUILTIN.items():
        register(name, factory)
