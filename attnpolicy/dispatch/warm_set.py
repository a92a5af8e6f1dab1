"""The warm set: the graphs a dispatcher compiles (or loads from its store) before
the first request, refused up front unless they can stay resident."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter
from typing import Any

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision
from attnpolicy.dispatch.background import Background
from attnpolicy.dispatch.batch_plan import BatchPlanner, WarmCall, warm_call
from attnpolicy.dispatch.call_graphs import CallRequest, CallSource
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import backend_setup
from attnpolicy.graphs.keys import GraphKey, TensorSpec

log = logging.getLogger("attnpolicy.dispatch")


class WarmSet:
    """The config's warm set per tensor spec, and the graphs of warmed layouts."""

    def __init__(self, config: AttnPolicyConfig, planner: BatchPlanner, cache: GraphCache[Any], source: CallSource,
                 background: Background[GraphKey, CallRequest] | None) -> None:
        self.config, self.planner, self.cache = config, planner, cache
        self.source, self.background = source, background
        self.keys: dict[GraphKey, None] = {}  # the config's warm sets, of every spec warmed
        self.warmed: set[TensorSpec] = set()  # the specs whose warm set was given

    def warm(self, batches: Iterable[BatchLayout], spec: TensorSpec,
             preview: Callable[[BatchLayout, TensorSpec], Decision]) -> list[GraphKey]:
        """Compile or load the config's warm set for ``spec`` (once per spec) and the
        graphs of ``batches`` as ``preview`` decides them (the backend's per-process
        set-up started ahead, see :mod:`~attnpolicy.graphs.backend_setup`); log one line
        (when it warmed anything) with how long it took and whether it was a warm start
        (no graph compiled)."""
        fresh = bool(self.config.warmup) and spec not in self.warmed
        warm_set = self.resident(spec) if fresh else {}
        calls = self.planner.warm_calls(batches, spec, preview, self.warmed)
        if self.background is not None:
            calls = _settled(self.background, calls)
        before, start = self.cache.stats(), perf_counter()
        real = fresh and self.source.calls.custom_builder is None  # a custom builder (the simulator's) compiles nothing
        setup = backend_setup.start(self.config.backend, spec.device) if real else backend_setup.Setup(None)
        try:
            keys = self.source.warm_up(calls, spec)
        finally:
            setup.join()  # its seconds are the warm-up's
        after = self.cache.stats()
        loaded, compiled = after.loads - before.loads, after.compiles - before.compiles
        deferred = after.deferred - before.deferred
        if fresh or loaded or compiled or deferred:
            host = f", {deferred} left to the host's own kernel" if deferred else ""
            log.info("attnpolicy: warm set of %d graphs for %s h%dkv%dd%d (%s) ready in %.3f s (%s start: %d loaded "
                     "from the store, %d compiled%s)", len(keys), spec.dtype, spec.heads, spec.kv_heads,
                     spec.head_dim, spec.features.describe(), perf_counter() - start,
                     "cold" if compiled else "warm", loaded, compiled, host)
        self.keys.update(warm_set)
        return keys

    def resident(self, spec: TensorSpec) -> dict[GraphKey, None]:
        """The keys of the config's warm set for tensors of ``spec``, refused with a
        :class:`ConfigError` before anything compiles unless they stay resident with
        the warm sets of earlier specs: each graph within ``max_bytes``, all within
        ``max_graphs`` and ``max_bytes`` (a warm set planned for another spec may not)."""
        planner, cache = self.planner, self.cache
        keys = {planner.key_for(*warm_call(shape), spec): i for i, shape in enumerate(self.config.warmup)}
        earlier = [key for key in self.keys if key not in keys]
        sizes = {key: cache.size_of(key) for key in (*keys, *earlier)}
        limit, count = cache.max_bytes, cache.max_graphs
        for key, i in keys.items():
            if limit is not None and sizes[key] > limit:
                raise ConfigError(f"warmup.{i}: the graph {key} needs {sizes[key]} bytes for tensors of {spec}, "
                                  f"more than max_bytes={limit}: it can never be cached")
        held = f" and {len(earlier)} warmed for other specs" if earlier else ""
        if count is not None and len(sizes) > count:
            raise ConfigError(f"the warm set of {len(keys)} graphs for tensors of {spec}{held} exceeds "
                              f"max_graphs={count}: warm-up would evict its own graphs")
        total = sum(sizes.values())
        if limit is not None and total > limit:
            raise ConfigError(f"the warm set of {len(keys)} graphs for tensors of {spec}{held} needs {total} "
                              f"bytes, more than max_bytes={limit}: warm-up would evict its own graphs "
                              "(plan the warm set for this tensor spec, or raise max_bytes)")
        return dict.fromkeys(keys)


def _settled(background: Background[GraphKey, CallRequest], calls: Iterable[WarmCall]) -> Iterator[WarmCall]:
    """``calls`` (a warm-up's), each key pending in the worker switched in first (its
    future waited for): warm-up reuses a pending compile instead of building it twice."""
    for item in calls:
        background.settle(item[1])
        yield item
