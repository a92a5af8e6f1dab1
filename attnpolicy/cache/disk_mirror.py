"""DiskMirror: what a :class:`~attnpolicy.cache.disk_store.DiskStore` would hold, without files.

The modelled disk tier under a simulated graph cache: the same byte bound
(``max_disk_bytes``) and the same least-recently-used order as the store (a load
and a save each count as a use; a save evicts the least recently used artifacts
until the new one fits; an artifact larger than the bound alone is not stored).
A memory miss asks :meth:`DiskMirror.load`: a key on the mirror costs its load
seconds; any other is compiled and then :meth:`DiskMirror.save`\\ d, as the
dispatcher's graph source does with a real store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from attnpolicy.errors import ConfigError


class DiskMirror:
    """The keys a store bounded by ``max_bytes`` would hold, least recently used first;
    ``size(key)`` is a key's bytes on disk and ``load_cost(key)`` its load seconds.
    ``stored(key)``: whether the key's graph goes to the store at all (default: every
    key). Counters: ``loads``, ``load_seconds``, ``saves``, ``evictions`` (artifacts
    removed to make room), ``oversize`` (not stored: larger than the bound),
    ``nbytes`` and ``peak_bytes``. No lock: for one thread (a simulation)."""

    __slots__ = ("_held", "_load_cost", "_size", "_stored", "evictions", "load_seconds", "loads", "max_bytes",
                 "nbytes", "oversize", "peak_bytes", "saves")

    def __init__(self, max_bytes: int, size: Callable[[Hashable], int], load_cost: Callable[[Hashable], float],
                 stored: Callable[[Hashable], bool] | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_disk_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._size = size
        self._load_cost = load_cost
        self._stored = stored
        self._held: OrderedDict[Hashable, int] = OrderedDict()
        self.loads = self.saves = self.evictions = self.oversize = 0
        self.load_seconds = 0.0
        self.nbytes = self.peak_bytes = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Hashable]:
        """The keys held, least recently used first (a snapshot)."""
        return iter(list(self._held))

    def reload_seconds(self, key: Hashable) -> float | None:
        """Seconds to bring ``key`` back from the mirror, ``None`` when it is not there
        (no side effect: the ``reload`` option of the ``cost`` eviction)."""
        return self._load_cost(key) if key in self._held else None

    def load(self, key: Hashable) -> float | None:
        """A memory miss of ``key``: its load seconds if held (a use, counted), else ``None``."""
        if key not in self._held:
            return None
        self._held.move_to_end(key)
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
        if size > self.max_bytes:
            self.oversize += 1
            return False
        held = self._held
        self.nbytes -= held.pop(key, 0)
        while self.nbytes + size > self.max_bytes:
            _, gone = held.popitem(last=False)
            self.nbytes -= gone
            self.evictions += 1
        held[key] = size
        self.nbytes += size
        self.saves += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return True

    def reset_counters(self) -> None:
        """Zero the counters, keeping what is held (a warm start: the next run's store)."""
        self.loads = self.saves = self.evictions = self.oversize = 0
        self.load_seconds = 0.0
        self.peak_bytes = self.nbytes
