"""The bounded cache of masks a dispatcher keeps (:class:`MaskCache`) and the one rule
its entries are keyed and sized by (:func:`mask_entry`), which every model of that
cache (``graphs.batch_cost``, the planner's call table) calls. No torch: a model of
the cache holds no tensors, and the masks themselves are built in
:mod:`~attnpolicy.kernels.masks`."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from attnpolicy.core.bounded_order import BoundedOrder
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.names import DEFAULT_MAX_MASK_BYTES

if TYPE_CHECKING:
    import torch

#: Small tensors (real-row masks, VARLEN bounds, zero padding blocks) a MaskCache
#: keeps at most, by count ...
SMALL_CACHE_SIZE = 4096
#: ... and by bytes: at most this many, and never more than the cache's ``max_bytes``
#: (``AttnPolicyConfig.max_mask_bytes``, which bounds its dense masks). A small tensor
#: larger than the bound is built for its call and not kept.
SMALL_CACHE_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class MaskCacheStats:
    """A snapshot of a :class:`MaskCache` (see docs/cache.md)."""

    masks: int
    bytes: int
    peak_bytes: int
    max_bytes: int | None
    hits: int
    misses: int
    evictions: int
    uncached: int
    small: int
    small_bytes: int
    max_small_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def mask_entry(layout: BatchLayout, rows: int, cols: int, device: object,
               window: int | None = None) -> tuple[Hashable, int]:
    """The :class:`MaskCache` entry of ``layout``'s dense ``rows × cols`` mask on ``device``
    (under a sliding ``window``): the key it is kept under and its bytes (one per
    boolean). The one rule by which the dispatcher keeps masks and every model of its
    cache (``graphs.batch_cost``, the planner's call table) counts them; they call it,
    so a change here is a change there. A function of its arguments' values: the
    planner calls it once per distinct argument tuple."""
    key = (layout, rows, cols, device) if window is None else (layout, rows, cols, device, window)
    return key, rows * cols


class MaskCache:
    """The masks one owner (a Dispatcher) keeps: dense boolean masks, least recently
    used first out, at most ``max_bytes`` bytes together (a mask larger than that is
    built and returned uncached); and small tensors (real-row masks, VARLEN bounds,
    zero padding blocks), least recently used first out, at most ``max_small`` of
    them and ``max_small_bytes`` bytes together (default: :data:`SMALL_CACHE_BYTES`,
    at most ``max_bytes``). Both are a least-recently-used
    :class:`~attnpolicy.core.bounded_order.BoundedOrder`, the eviction rule the models
    of this cache (``graphs.batch_cost``, the planner's call table) run too, on the keys of
    :func:`mask_entry`. Not thread-safe: its dispatcher uses it under its own lock."""

    def __init__(self, max_bytes: int | None = DEFAULT_MAX_MASK_BYTES, max_small: int = SMALL_CACHE_SIZE,
                 max_small_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_small = max_small
        if max_small_bytes is None:
            max_small_bytes = SMALL_CACHE_BYTES if max_bytes is None else min(SMALL_CACHE_BYTES, max_bytes)
        self.max_small_bytes = max_small_bytes
        self._dense: BoundedOrder[Hashable, Any] = BoundedOrder.lru(max_bytes=max_bytes)
        self._small: BoundedOrder[Hashable, torch.Tensor] = BoundedOrder.lru(max_graphs=max_small,
                                                                             max_bytes=max_small_bytes)
        self._hits = self._misses = self._uncached = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a dense mask of ``nbytes`` is kept once built (within ``max_bytes``)."""
        return self._dense.fits(nbytes)

    def lookup(self, key: Hashable, nbytes: int, build: Callable[[], Any]) -> Any:
        """The dense entry for ``key`` (``nbytes`` large), built by ``build()`` on a miss
        (its value must not be ``None``)."""
        dense = self._dense
        hit = dense.get(key)
        if hit is not None:
            self._hits += 1
            return hit
        self._misses += 1
        value = build()
        if not dense.fits(nbytes):
            self._uncached += 1
            return value
        dense.admit(key, value, nbytes, 0.0)
        return value

    def __contains__(self, key: Hashable) -> bool:
        """Whether a dense entry for ``key`` is cached (no recency side effect)."""
        return key in self._dense

    def small(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The small tensor for ``key``, built by ``build()`` on a miss (and not kept
        if larger than ``max_small_bytes``)."""
        small = self._small
        hit = small.get(key)
        if hit is not None:
            return hit
        value = build()
        if small.fits(value.nbytes):
            small.admit(key, value, value.nbytes, 0.0)
        return value

    def clear(self) -> None:
        """Drop every mask and small tensor (counters stay)."""
        self._dense.clear()
        self._small.clear()

    def stats(self) -> MaskCacheStats:
        dense, small = self._dense, self._small
        return MaskCacheStats(len(dense), dense.nbytes, dense.peak_bytes, self.max_bytes, self._hits,
                              self._misses, dense.evictions, self._uncached, len(small),
                              small.nbytes, self.max_small_bytes)
