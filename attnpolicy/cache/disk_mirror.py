"""DiskMirror: what a :class:`~attnpolicy.cache.disk_store.DiskStore` would hold, without files.

The modelled disk tier under a simulated graph cache: the same byte bound
(``max_disk_bytes``), least-recently-used order and eviction rule as the store (a
load and a save each count as a use; a save evicts the least recently used artifacts
until the new one fits; an artifact larger than the bound alone is not stored: both
run :class:`~attnpolicy.core.bounded_order.BoundedOrder`).
A memory miss asks :meth:`DiskMirror.load`: a key on the mirror costs its load
seconds; any other is compiled and then :meth:`DiskMirror.save`\\ d, as the
dispatcher's graph source does with a real store.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator

from attnpolicy.core.bounded_order import BoundedOrder, OrderFigures
from attnpolicy.errors import ConfigError


class DiskMirror(OrderFigures):
    """The keys a store bounded by ``max_bytes`` would hold, least recently used first;
    ``size(key)`` is a key's bytes on disk and ``load_cost(key)`` its load seconds.
    ``stored(key)``: whether the key's graph goes to the store at all (default: every
    key). Counters: ``loads``, ``load_seconds``, ``saves``, ``evictions`` (artifacts
    removed to make room), ``oversize`` (not stored: larger than the bound),
    ``nbytes``, ``peak_graphs`` and ``peak_bytes``
    (:class:`~attnpolicy.core.bounded_order.OrderFigures`). The keys are a
    least-recently-used :class:`~attnpolicy.core.bounded_order.BoundedOrder`, the
    store's own eviction rule. No lock: for one thread (a simulation)."""

    __slots__ = ("_load_cost", "_order", "_size", "_stored", "load_seconds", "loads", "max_bytes", "oversize",
                 "saves")

    def __init__(self, max_bytes: int, size: Callable[[Hashable], int], load_cost: Callable[[Hashable], float],
                 stored: Callable[[Hashable], bool] | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_disk_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._size = size
        self._load_cost = load_cost
        self._stored = stored
        self._order: BoundedOrder[Hashable, int] = BoundedOrder.lru(max_bytes=max_bytes)
        self.loads = self.saves = self.oversize = 0
        self.load_seconds = 0.0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        """The keys held, least recently used first (a snapshot)."""
        return iter(list(self._order.entries))

    def reload_seconds(self, key: Hashable) -> float | None:
        """Seconds to bring ``key`` back from the mirror, ``None`` when it is not there
        (no side effect: the ``reload`` option of the ``cost`` eviction)."""
        return self._load_cost(key) if key in self._order else None

    def load(self, key: Hashable) -> float | None:
        """A memory miss of ``key``: its load seconds if held (a use, counted), else ``None``."""
        if key not in self._order:
            return None
        self._order.touch(key)
        seconds = self._load_cost(key)
        self.loads += 1
        self.load_seconds += seconds
        return seconds

    def save(self, key: Hashable) -> bool:
        """Store ``key`` just compiled (a use), evicting least recently used keys until it
        fits; returns whether it was stored."""
        if self._stored is not None and not self._stored(key):
            return False
        size = self._size(key)
        held = self._order
        if not held.fits(size):
            self.oversize += 1
            return False
        held.remove(key)
        held.admit(key, size, size, 0.0)
        self.saves += 1
        return True

    def reset_counters(self) -> None:
        """Zero the counters, keeping what is held (a warm start: the next run's store)."""
        self.loads = self.saves = self.oversize = 0
        self.load_seconds = 0.0
        self._order.reset_peaks()
