"""The modelled cost of a batch's calls on a :class:`~attnpolicy.graphs.costmodel.CostModel`.

One call costs its graph's run seconds (or, run uncompiled past the largest bucket,
its shape's) plus the dispatch overhead; a MASK call also costs the build of its
dense mask when the dispatcher's mask cache does not hold it. :class:`MaskMirror`
is that cache without the masks (a :class:`~attnpolicy.kernels.mask_cache.MaskCache` of
the same byte bound, holding no tensors) and the same key and bytes
(:func:`~attnpolicy.kernels.mask_cache.mask_entry`, the sliding window included, looked up
when called: the rule itself, not a copy), so every model counts the builds the
dispatcher makes; a windowed build is priced by the
cost model's ``mask_build_window``. Simulation, stall modelling (and the planner through simulation)
cost batches with :class:`BatchCost`; the cost-aware policy prices its options with
a :class:`MaskMirror` per shadow.
"""

from __future__ import annotations

from collections.abc import Hashable

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import Call, GraphKey
from attnpolicy.kernels import mask_cache
from attnpolicy.kernels.mask_cache import MaskCache


class MaskNeed:
    """One dense mask a MASK call needs: its mask-cache key, its bytes and its modelled
    build seconds."""

    __slots__ = ("key", "nbytes", "seconds")

    def __init__(self, layout: BatchLayout, rows: int, cols: int, device: object, model: CostModel,
                 window: int | None = None) -> None:
        self.key, self.nbytes = mask_cache.mask_entry(layout, rows, cols, device, window)
        self.seconds = model.mask_build_seconds(rows, cols, window)


class MaskMirror:
    """The dense masks a dispatcher's :class:`~attnpolicy.kernels.mask_cache.MaskCache` would
    hold, bounded by ``max_bytes`` (``max_mask_bytes``) and keyed as it keys them."""

    __slots__ = ("_cache",)

    def __init__(self, max_bytes: int | None) -> None:
        self._cache = MaskCache(max_bytes)

    def held(self, key: Hashable) -> bool:
        """Whether the mask of ``key`` is cached (no recency side effect)."""
        return key in self._cache

    def settled(self, need: MaskNeed) -> bool:
        """Whether using ``need`` leaves the mirror as it is: cached, or too large to cache."""
        return need.key in self._cache or not self._cache.fits(need.nbytes)

    def use(self, key: Hashable, nbytes: int) -> None:
        """Record a use of the mask of ``key`` (``nbytes`` large), as the dispatcher's lookup does."""
        self._cache.lookup(key, nbytes, bool)


class BatchCost:
    """Modelled seconds of the calls a dispatcher prepares, with its mask builds counted
    against a :class:`MaskMirror` of ``max_mask_bytes``. Costs are per call, in call
    order, so callers add them up in the order they run."""

    __slots__ = ("masks", "model", "_overhead")

    def __init__(self, model: CostModel, max_mask_bytes: int | None) -> None:
        self.model = model
        self.masks = MaskMirror(max_mask_bytes)
        self._overhead = model.call_overhead_seconds

    def call_seconds(self, call: Call, key: GraphKey | None) -> float:
        """Run seconds of ``call`` with the dispatch overhead: its graph's (``key``) or,
        with ``key`` None (uncompiled, longer than the largest bucket), its shape's."""
        if key is not None:
            return self.model.run_seconds(key) + self._overhead
        return self.model.call_seconds(call.kind, call.q_bucket, call.kv_bucket, call.rows) + self._overhead

    def mask_seconds(self, layout: BatchLayout, call: Call, device: object,
                     window: int | None = None) -> float | None:
        """Build seconds of ``call``'s dense mask on ``device`` (under a sliding ``window``)
        when it is a MASK call whose mask the cache does not hold (None: nothing is
        built); records the use."""
        if call.kind is not CallKind.MASK:
            return None
        rows, cols = call.q_bucket, call.kv_bucket
        key, nbytes = mask_cache.mask_entry(layout, rows, cols, device, window)
        built = None if self.masks.held(key) else self.model.mask_build_seconds(rows, cols, window)
        self.masks.use(key, nbytes)
        return built
