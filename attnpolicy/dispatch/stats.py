"""What a dispatcher counts: the typed counters it keeps and the typed snapshot
:meth:`~attnpolicy.dispatch.dispatcher.Dispatcher.stats` returns."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from attnpolicy.cache.disk_store import StoreStats
from attnpolicy.cache.graph_cache import CacheStats
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.modes import MaskMode
from attnpolicy.kernels.flex import BlockMaskCache
from attnpolicy.kernels.mask_cache import MaskCacheStats


@dataclass(slots=True)
class Counters:
    """The running counts of a dispatcher, or a model runner's strict-mode
    and background counts (every field an int, all start at 0).

    ``modes`` counts batches by the mode that ran (a mode's value: the stats key).
    The others are read by :meth:`Dispatcher.stats` under the names of
    :class:`DispatcherStats`; ``background_*`` and ``pad_up_*`` feed
    :class:`BackgroundStats` (``background_eager``: misses run uncompiled while their graph
    compiles, of a family that runs them so), ``switch_*`` :class:`SwitchStats`, ``real_tokens`` and
    ``padded_tokens`` :class:`PaddingStats`."""

    batches: int = 0
    calls: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    overflow: int = 0
    mask_fallbacks: int = 0
    compile_error_fallbacks: int = 0
    strict_violations: int = 0
    loaded_after_warmup: int = 0
    direct_call_fallbacks: int = 0
    kernel_violations: int = 0
    layers_elsewhere: int = 0
    background_requested: int = 0
    background_switched: int = 0
    background_failed: int = 0
    background_discarded: int = 0
    background_loaded: int = 0
    pad_up_calls: int = 0
    pad_up_tokens: int = 0
    background_eager: int = 0
    switch_requested: int = 0
    switch_replaced: int = 0
    switch_failed: int = 0
    switches: int = 0
    switch_compiled: int = 0
    switch_loaded: int = 0
    switch_batches: int = 0
    switch_discarded: int = 0
    backend_compiles: int = 0
    modes: dict[str, int] = field(default_factory=lambda: dict.fromkeys((m.value for m in MaskMode), 0))

    def backend_counter(self, then: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """A compile counter (``counter(gm)`` of :func:`~attnpolicy.graphs.compile.compile_graph`)
        that counts each backend compile in ``backend_compiles`` (from any thread), then calls
        ``then(gm)`` if given."""
        lock = threading.Lock()

        def counted(gm: Any) -> None:
            with lock:
                self.backend_compiles += 1
            if then is not None:
                then(gm)
        return counted

    def count(self, step: Any) -> None:
        """Count one prepared batch: its mode, calls and tokens (``step``: a
        :class:`~attnpolicy.dispatch.step.Step`, not imported: steps import this module)."""
        self.modes[step.mode_name] += 1
        if step.fell_back:
            self.mask_fallbacks += 1
        self.batches += 1
        self.calls += step.n_calls
        self.real_tokens += step.layout.total_tokens
        self.padded_tokens += step.padded_tokens

    def background(self, config: AttnPolicyConfig, pending: int, compile_seconds: float) -> BackgroundStats:
        """The background compiles of these counts, ``pending`` of them not switched in, the
        worker's ``compile_seconds``: the one schema of dispatchers and model runners."""
        return BackgroundStats(
            config.compile_mode, config.switch_after, self.background_requested, self.background_switched,
            self.background_failed, self.background_discarded, pending, compile_seconds, self.pad_up_calls,
            self.pad_up_tokens, self.background_loaded)

    def snapshot(self, config: AttnPolicyConfig, *, guard_fallbacks: int, observer_errors: dict[str, int],
                 plans: int, masks: MaskCacheStats, block_masks: BlockMaskStats, cache: CacheStats,
                 stalls: list[float], pending: int, compile_seconds: float,
                 disk: StoreStats | None = None, switching: int = 0,
                 compiler_compiles: int | None = None) -> DispatcherStats:
        """These counts with the figures kept elsewhere, as :class:`DispatcherStats`."""
        real, padded = self.real_tokens, self.padded_tokens
        return DispatcherStats(
            batches=self.batches, calls=self.calls, modes=dict(self.modes), guard_fallbacks=guard_fallbacks,
            overflow=self.overflow, mask_fallbacks=self.mask_fallbacks,
            compile_error_fallbacks=self.compile_error_fallbacks, strict_violations=self.strict_violations,
            loaded_after_warmup=self.loaded_after_warmup,
            direct_call_fallbacks=self.direct_call_fallbacks, kernel_violations=self.kernel_violations,
            layers_elsewhere=self.layers_elsewhere, observer_errors=observer_errors,
            padding=PaddingStats(real, padded, padded / real if real else 0.0), plans=plans, masks=masks,
            block_masks=block_masks, cache=cache, stalls=stall_stats(self.batches, stalls),
            background=self.background(config, pending, compile_seconds),
            switch=SwitchStats(self.switch_requested, self.switch_replaced, self.switch_failed, self.switches,
                               switching, self.switch_compiled, self.switch_loaded, self.switch_batches,
                               self.switch_discarded),
            disk=disk, backend_compiles=self.backend_compiles, compiler_compiles=compiler_compiles)


@dataclass(frozen=True, slots=True)
class PaddingStats:
    """Real query tokens and the rows graphs padded on top of them."""

    real_tokens: int
    padded_tokens: int
    waste: float


@dataclass(frozen=True, slots=True)
class BlockMaskStats:
    """The FlexAttention block masks a dispatcher keeps (one per layout, bounded by
    count and bytes)."""

    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    builds: int

    @classmethod
    def of(cls, blocks: BlockMaskCache) -> BlockMaskStats:
        return cls(len(blocks), blocks.nbytes, blocks.max_entries, blocks.max_bytes, blocks.builds)


@dataclass(frozen=True, slots=True)
class StallStats:
    """Wall seconds batches spent inside :meth:`Dispatcher.prepare` waiting for a
    graph: compiling it synchronously, or waiting for a background compile at its
    switch point. Percentiles (nearest rank) over every batch counted in ``batches``,
    stall-free ones included; warm-up is no batch."""

    batches: int
    stalled: int
    seconds: float
    p50: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class BackgroundStats:
    """Background compiles (``compile_mode="background"``) and the pad-up calls that
    served their keys meanwhile: ``requested`` compiles, ``switched`` into the cache at
    their switch point, ``failed`` there, ``discarded`` by ``close()`` after they had
    run (built, never switched in), ``pending`` now; ``compile_seconds`` measured in
    the worker (of those switched in); ``pad_up_calls`` ran on a larger resident bucket, adding
    ``pad_up_tokens`` query rows of padding (also in ``padding``); ``loaded``: of those
    switched in, the graphs the worker loaded from the store instead of compiling."""

    compile_mode: str
    switch_after: int
    requested: int
    switched: int
    failed: int
    discarded: int
    pending: int
    compile_seconds: float
    pad_up_calls: int
    pad_up_tokens: int
    loaded: int = 0


@dataclass(frozen=True, slots=True)
class SwitchStats:
    """Switches to a new config (:meth:`Dispatcher.switch_to`, see docs/plan.md):
    ``requested``, ``replaced`` by a later request while pending, ``failed`` (a graph
    of the switch set failed to build: the switch was dropped), ``switches`` applied,
    ``pending`` now (0 or 1); the switch-set graphs the worker ``compiled`` and
    ``loaded`` from the store; ``batches`` served by the old config while a switch was
    pending; ``discarded``: graphs the worker compiled that never entered the cache (of a
    replaced, failed or closed switch, or cached meanwhile by the running config)."""

    requested: int
    replaced: int
    failed: int
    switches: int
    pending: int
    compiled: int
    loaded: int
    batches: int
    discarded: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeStats:
    """What a snapshot of a :class:`Dispatcher` and of a model runner holds:
    batches, batches per mode (a mode's value: the key), guard fallbacks, strict-mode
    violations, its graph cache's stats and its graph store's (``disk``; ``None``
    without one, see docs/store.md). ``to_json()`` gives the dict of the JSON outputs."""

    batches: int
    modes: dict[str, int]
    guard_fallbacks: int
    strict_violations: int
    #: graphs loaded from the store after warm-up (no compile: no strict violation),
    #: counted under strict "warn" and "raise"
    loaded_after_warmup: int
    cache: CacheStats
    disk: StoreStats | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class DispatcherStats(RuntimeStats):
    """A snapshot of a :class:`Dispatcher`: :class:`RuntimeStats`, its other counters, and
    its mask cache's stats (see docs/cache.md)."""

    calls: int
    overflow: int
    mask_fallbacks: int
    compile_error_fallbacks: int
    direct_call_fallbacks: int
    #: plugin kernels caught breaking their contract: a failed probe, a bad output
    #: at run time, a compile that failed on one
    kernel_violations: int
    #: attention layers of a host's model that run on the host's own code (vLLM)
    layers_elsewhere: int
    observer_errors: dict[str, int]
    padding: PaddingStats
    plans: int
    masks: MaskCacheStats
    block_masks: BlockMaskStats
    stalls: StallStats
    background: BackgroundStats
    switch: SwitchStats
    #: backend compiles attnpolicy's wrapper around the compiler's backend saw (every
    #: compile of this dispatcher's graphs: a recompile after a release, ahead of time too)
    backend_compiles: int = 0
    #: the compiles the compiler counted itself since the dispatcher was built (process-wide:
    #: other runtimes' compiles included); ``None`` where the compiler counts none
    compiler_compiles: int | None = None


def percentile(values: list[float], total: int, p: float) -> float:
    """The nearest-rank ``p`` percentile of ``total`` values: ``values`` (sorted) and
    ``total - len(values)`` zeros."""
    if total <= 0:
        return 0.0
    rank = max(1, math.ceil(p * total))
    zeros = total - len(values)
    return 0.0 if rank <= zeros else values[rank - zeros - 1]


def stall_stats(batches: int, stalls: list[float]) -> StallStats:
    """The stall statistics of ``batches`` batches of which ``stalls`` stalled (summed
    in ascending order: a modelled replay's totals are sums of the same stalls)."""
    ordered = sorted(stalls)
    return StallStats(batches, len(stalls), sum(ordered), percentile(ordered, batches, 0.5),
                      percentile(ordered, batches, 0.99), ordered[-1] if ordered else 0.0)
