"""BoundedOrder: the one eviction rule of every bounded cache in attnpolicy.

A bounded cache holds entries by key, each of some size, within a count bound
(``max_graphs``) and a byte bound (``max_bytes``); an eviction strategy (a
``cachetools.Cache`` structure, see :mod:`attnpolicy.cache.evictions`) ranks the
entries. Admitting a new entry evicts the strategy's victims (``popitem()``) until
the entry fits under both bounds, then tells the strategy the entry's cost and
footprint (``note``) and inserts it. An entry larger than the byte bound alone never
fits (:meth:`BoundedOrder.fits`): its owner refuses it or serves it uncached.

The real caches and their models all run this rule: the graph cache
(:class:`~attnpolicy.cache.graph_cache.GraphCache`) and its replay without graphs
(:class:`~attnpolicy.cache.key_stream.StreamCache`), the graph store on disk
(:class:`~attnpolicy.cache.disk_store.DiskStore`) and its model
(:class:`~attnpolicy.cache.disk_mirror.DiskMirror`), and the dispatcher's mask cache
(:class:`~attnpolicy.kernels.mask_cache.MaskCache`, which the mask models reuse). Pins are
no part of it: a pinned entry is evicted like any other (its owner keeps it alive).

cachetools' ``LRUCache`` and ``FIFOCache`` keep an ``OrderedDict`` inside; with
``ordered=True`` a bounded order of either strategy is kept as that ``OrderedDict``
itself, in C (a hit moves the key to the end, or, first in first out, changes
nothing; the victim is the front): the same victims, without a Python call per touch.
A bounded order iterates in admission order either way.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, MutableMapping
from functools import partial
from operator import attrgetter
from typing import Any, Generic, TypeVar

import cachetools

from attnpolicy.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: The strategies kept as their inner ``OrderedDict`` under ``ordered=True``: whether a
#: hit moves the key to the end.
_ORDERED: dict[type, bool] = {cachetools.LRUCache: True, cachetools.FIFOCache: False}


def _bound(name: str, value: int | None) -> float:
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
    return value


class BoundedOrder(Generic[K, V]):
    """Entries by key, ranked for eviction by ``structure`` (an empty ``cachetools.Cache``),
    never more than ``max_graphs`` of them nor ``max_bytes`` bytes after :meth:`admit`.

    ``entries`` is the ranking structure itself, for reading (a ``cachetools`` structure
    or, ``ordered``, an ``OrderedDict``); ``get(key)`` (``None`` when not held) and
    ``touch(key)`` (``KeyError`` when not held) are a use, ``key in order`` is not.
    Change it only through this object. No lock: its owner
    locks. ``nbytes``, ``peak_graphs``, ``peak_bytes`` and ``evictions`` (victims of
    :meth:`admit`) are its figures."""

    __slots__ = ("_cap", "_limit", "_moves", "_note", "_ordered", "_pop", "_sizes", "entries", "evictions", "get",
                 "max_bytes", "max_graphs", "nbytes", "peak_bytes", "peak_graphs", "touch", "touch_once")

    def __init__(self, structure: cachetools.Cache[Any, Any], *, max_graphs: int | None = None,
                 max_bytes: int | None = None, ordered: bool = False) -> None:
        """``ordered``: keep ``lru`` and ``fifo`` as their ``OrderedDict`` (values must not be ``None``)."""
        self._cap = _bound("max_graphs", max_graphs)
        self._limit = _bound("max_bytes", max_bytes)
        self.max_graphs, self.max_bytes = max_graphs, max_bytes
        self._sizes: dict[K, int] = {}
        self.nbytes = self.peak_graphs = self.peak_bytes = self.evictions = 0
        self._ordered = ordered
        self._use(structure)

    @classmethod
    def lru(cls, *, max_graphs: int | None = None, max_bytes: int | None = None) -> BoundedOrder[K, V]:
        """Least recently used first out, kept as an ``OrderedDict``."""
        return cls(cachetools.LRUCache(math.inf), max_graphs=max_graphs, max_bytes=max_bytes, ordered=True)

    def _use(self, structure: cachetools.Cache[Any, Any]) -> None:
        moves = _ORDERED.get(type(structure)) if self._ordered else None
        self._moves = bool(moves)  # a hit moves the key to the end of an ordered order
        #: touching a run of keys equals touching each distinct key once, at its last touch
        self.touch_once = type(structure) in _ORDERED
        if moves is not None:
            inner: OrderedDict[K, V] = OrderedDict()
            self.entries: MutableMapping[K, V] = inner
            self.touch: Callable[[K], object] = inner.move_to_end if moves else inner.__getitem__
            self.get: Callable[[K], V | None] = partial(_get_moved, inner) if moves else inner.get
            self._pop: Callable[[], tuple[K, V]] = partial(inner.popitem, last=False)
            self._note: Callable[..., None] | None = None
        else:
            self.entries = structure
            self.touch = structure.__getitem__
            self.get = structure.get
            self._pop = structure.popitem
            self._note = getattr(structure, "note", None)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[K]:
        """The keys held, in the order they were admitted (as ``cachetools`` iterates a
        structure, whatever its victim order)."""
        return iter(self._sizes)

    @property
    def sizes(self) -> Mapping[K, int]:
        """The keys held, with their sizes (a live view: do not change it)."""
        return self._sizes

    def fits(self, size: int) -> bool:
        """Whether an entry of ``size`` bytes can be held at all (within ``max_bytes`` alone)."""
        return size <= self._limit

    def footprint(self, size: int) -> int:
        """What an entry of ``size`` bytes takes of the bound evictions free room under
        (``note``'s ``size``): its bytes under a byte bound, one slot under a count bound
        alone (a large entry takes one slot like a small one)."""
        return size if self.max_bytes is not None else 1

    def admit(self, key: K, value: V, size: int, cost: float,
              victims: list[tuple[K, V]] | None = None) -> None:
        """Insert ``key`` (not held) with ``value`` of ``size`` bytes costing ``cost``
        seconds to rebuild: evict the strategy's victims until it fits (appended to
        ``victims`` as they go, so a raising strategy leaves them there), note it, insert
        it. ``size`` must :meth:`fits`."""
        entries = self.entries
        nbytes = self.nbytes + size
        if len(entries) >= self._cap or nbytes > self._limit:
            sizes, pop, cap, limit = self._sizes, self._pop, self._cap, self._limit
            try:
                while len(entries) >= cap or nbytes > limit:
                    victim, gone = pop()
                    nbytes -= sizes.pop(victim)
                    self.evictions += 1
                    if victims is not None:
                        victims.append((victim, gone))
            finally:
                self.nbytes = nbytes - size
        if self._note is not None:
            self._note(key, cost=cost, size=size if self.max_bytes is not None else 1)
        entries[key] = value
        self._sizes[key] = size
        self.nbytes = nbytes
        if len(entries) > self.peak_graphs:
            self.peak_graphs = len(entries)
        if nbytes > self.peak_bytes:
            self.peak_bytes = nbytes

    def serve(self, keys: Iterable[K], sizes: Callable[[K], int], never: Container[K] = ()) -> list[K]:
        """Request each of ``keys`` in order, in an ``ordered`` order (``lru``, ``fifo``):
        a held key is touched; any other is a miss, admitted as :meth:`admit` admits it
        (its value the key itself, ``size`` ``sizes(key)``; no ``note``: these orders
        take none), unless it is in ``never`` (an entry too large to keep: not kept).
        Returns the missed keys in request order. The same victims and figures as a
        :meth:`touch` per request and an :meth:`admit` per miss, in one loop."""
        entries = self.entries
        if not isinstance(entries, OrderedDict):
            raise TypeError(f"serve needs an ordered lru or fifo order, got {type(entries).__name__}")
        moves = self._moves
        move, pop, held = entries.move_to_end, entries.popitem, self._sizes
        cap, limit = self._cap, self._limit
        nbytes, evictions, peak_graphs, peak_bytes = self.nbytes, self.evictions, self.peak_graphs, self.peak_bytes
        missed: list[K] = []
        miss = missed.append
        try:
            for key in keys:
                if key in entries:
                    if moves:
                        move(key)
                    continue
                miss(key)
                if never and key in never:
                    continue
                size = sizes(key)
                while len(entries) >= cap or nbytes + size > limit:
                    victim, _ = pop(last=False)
                    nbytes -= held.pop(victim)
                    evictions += 1
                nbytes += size
                entries[key] = key  # a stream's value is its key
                held[key] = size
                if len(entries) > peak_graphs:
                    peak_graphs = len(entries)
                if nbytes > peak_bytes:
                    peak_bytes = nbytes
        finally:
            self.nbytes, self.evictions, self.peak_graphs, self.peak_bytes = nbytes, evictions, peak_graphs, peak_bytes
        return missed

    def restore(self, key: K, value: V, size: int) -> None:
        """Enter ``key`` (not held) as held already, last in the victim order, evicting
        nothing: contents read back (a store's files), which the next :meth:`admit` brings
        within the bounds."""
        self.entries[key] = value
        self._sizes[key] = size
        self.nbytes += size

    def remove(self, key: K) -> V | None:
        """Take ``key`` out (not counted as an eviction); its value, ``None`` if not held."""
        if key not in self._sizes:
            return None
        value = self.entries.pop(key)
        self.nbytes -= self._sizes.pop(key)
        return value

    def clear(self) -> list[tuple[K, V]]:
        """Take every entry out (not counted as evictions); they are returned."""
        gone = list(self.entries.items())
        self.entries.clear()
        self._sizes.clear()
        self.nbytes = 0
        return gone

    def reset_peaks(self) -> None:
        """The peaks and the eviction count restart from the contents now."""
        self.peak_graphs, self.peak_bytes, self.evictions = len(self._sizes), self.nbytes, 0

    def reorder(self, structure: cachetools.Cache[Any, Any], cost: Callable[[K, V], float]) -> None:
        """Rank by ``structure`` from now on: the entries move over in the old victim order,
        each noted with ``cost(key, value)`` and its footprint; none is evicted, their uses
        start over. If this raises the old order stays whole."""
        moved: list[tuple[K, V]] = []
        old = (self.entries, self.touch, self.get, self._pop, self._note, self.touch_once, self._moves)
        self._use(structure)
        try:
            while old[0]:
                moved.append(old[3]())
            for key, value in moved:
                if self._note is not None:
                    self._note(key, cost=cost(key, value), size=self.footprint(self._sizes[key]))
                self.entries[key] = value
            sizes = {key: self._sizes[key] for key, _ in moved}  # admitted in the victim order now
            self._sizes.clear()
            self._sizes.update(sizes)
        except BaseException:
            self.entries, self.touch, self.get, self._pop, self._note, self.touch_once, self._moves = old
            for key, value in moved:
                self.entries[key] = value
            raise


def _figure(name: str) -> Any:
    """A read-only property: the figure ``name`` of its owner's ``_order``."""
    return property(attrgetter(f"_order.{name}"), doc=f"The bounded order's ``{name}``.")


class OrderFigures:
    """What an owner of a :class:`BoundedOrder` ``_order`` reads through it: ``key in owner``
    (not a use) and the figures ``evictions``, ``nbytes``, ``peak_graphs`` and ``peak_bytes``
    (read-only). A base for slotted owners (it adds no slot; the owner's ``__slots__`` has
    ``_order``)."""

    __slots__ = ()
    _order: BoundedOrder[Any, Any]
    evictions: int = _figure("evictions")
    nbytes: int = _figure("nbytes")
    peak_graphs: int = _figure("peak_graphs")
    peak_bytes: int = _figure("peak_bytes")

    def __contains__(self, key: object) -> bool:
        return key in self._order


def _get_moved(order: OrderedDict[Any, Any], key: Any) -> Any:
    """``order[key]`` moved to the end (a use), ``None`` when not held."""
    value = order.get(key)
    if value is not None:
        order.move_to_end(key)
    return value
