"""Where a dispatcher's or model runner's graphs come from, for any :class:`~attnpolicy.dispatch.family.GraphFamily`:
the bounded graph cache, the family's builder on a miss, the store it loads from, strict
mode after warm-up (and the loads after warm-up it allows), and the stalls synchronous
builds and loads cost."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from functools import partial
from time import perf_counter
from typing import Any, Generic

from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.dispatch.family import GraphFamily, K, R
from attnpolicy.dispatch.stats import Counters
from attnpolicy.errors import GraphCompileError, KernelError, StrictModeError


class GraphSource(Generic[K, R]):
    """The graphs of ``family``'s keys, from ``cache``, built by ``builder`` on a miss
    (default: the family's), loaded from the family's store when it holds them.

    ``on_built(key, graph)`` sees every graph this source built (synchronously or in the
    background worker) as it enters the cache, on the thread that inserts it. After
    :attr:`warm` is set, a compile is a strict-mode violation (``config.strict``) and a
    load from the store is counted (``loaded_after_warmup``); both in ``counters``."""

    def __init__(self, cache: GraphCache[Any], counters: Counters, family: GraphFamily[K, R], *,
                 builder: Callable[[K, R], Any] | None = None,
                 on_built: Callable[[K, Any], None] | None = None) -> None:
        self.cache = cache
        self.counters = counters
        self.family = family
        self.builder: Callable[[K, R], Any] = builder or family.build
        self._on_built = on_built
        self._count_lock = threading.Lock()  # strict counts may come from threads sharing a runner
        self.warm = False  # after warm-up: a compile is a strict-mode violation
        self.stall = 0.0  # seconds the batch being fetched stalled so far
        self.stalls: list[float] = []
        self.stall_seconds = 0.0

    @property
    def config(self) -> AttnPolicyConfig:
        """The family's config (set: the family builds under the new one)."""
        return self.family.config

    @config.setter
    def config(self, config: AttnPolicyConfig) -> None:
        self.family.config = config

    @property
    def store(self) -> DiskStore | None:
        return self.family.store

    def end(self) -> None:
        """Record the stall of the batch just fetched, if it stalled."""
        if self.stall:
            self.stalls.append(self.stall)
            self.stall_seconds += self.stall

    def get(self, key: K, request: R, *, pin: bool = False) -> Any:
        """The cached graph of ``key`` (``pin`` as ``GraphCache.get_or_compile``), loaded
        from the store or built from ``request`` on a miss (their seconds stall the batch);
        after warm-up a miss loads first and only a compile is a violation. A failed build
        raises :class:`~attnpolicy.errors.GraphCompileError`."""
        load: Callable[[], Any] | None = partial(self._timed_load, key) if self.stored(key) else None
        seconds: float | None = None
        loaded: Any = None
        if self.warm and self.config.strict != "off" and not self.cache.has_graph(key):
            loaded, seconds = after_warm_up(key, load, self.strict, self.loaded_after_warm_up)
            load = None if loaded is None else lambda: loaded
        graph = self.cache.get_or_compile(key, partial(self._timed_build, key, request), pin=pin,
                                          seconds=seconds, load=load)
        if loaded is not None and graph is not loaded:  # cached meanwhile by another user of a shared cache
            self.family.release(key, loaded)
        return graph

    def _timed_build(self, key: K, request: R) -> Any:
        """A synchronous build: its wall seconds stall the batch being fetched."""
        start = perf_counter()
        try:
            graph = self.builder(key, request)
        finally:
            self.stall += perf_counter() - start
        if self._on_built is not None:
            self._on_built(key, graph)
        return graph

    def _timed_load(self, key: K) -> Any:
        """The graph of ``key`` from the store (``None``: not there or not valid); its
        wall seconds stall the batch being fetched, as a build's do."""
        start = perf_counter()
        try:
            return self.family.load(key)
        finally:
            self.stall += perf_counter() - start

    # -- the store ----------------------------------------------------------------------
    def stored(self, key: K) -> bool:
        """Whether the graph of ``key`` goes through the store: one is configured and the
        family stores the key's graph."""
        return self.store is not None and self.family.identity(key) is not None

    def identity(self, key: K) -> ArtifactIdentity:
        """What makes the stored artifact of stored ``key`` valid (see docs/store.md)."""
        ident = self.family.identity(key)
        assert ident is not None  # only stored keys have an identity
        return ident

    def holds(self, key: K) -> bool:
        """Whether the store holds an artifact of ``key`` now (not verified: a load may
        still fail and compile)."""
        store = self.store
        return store is not None and self.stored(key) and store.holds(self.identity(key))

    def load(self, key: K) -> Any | None:
        """The graph of stored ``key`` from the store (``None``: not there or not valid);
        no serving state touched: also runs in the background worker."""
        return self.family.load(key)

    # -- strict mode --------------------------------------------------------------------
    def strict(self, key: K, *, done: bool = False) -> None:
        """A compile after warm-up: counted, then warned or raised (``strict``; ``done``:
        the worker has compiled it already, a stored graph it could not load: warned)."""
        with self._count_lock:
            self.counters.strict_violations += 1
        message = f"graph {key} compiled after warm-up (strict={self.config.strict!r})"
        if self.config.strict == "raise" and not done:
            raise StrictModeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def loaded_after_warm_up(self, key: K) -> None:
        """A load from the store after warm-up (no compile: ``strict`` allows it): counted,
        the first one warned about."""
        with self._count_lock:
            self.counters.loaded_after_warmup += 1
            first = self.counters.loaded_after_warmup == 1
        if first:
            warn_loaded(key, self.config.strict)

    # -- graphs the background worker made ---------------------------------------------
    def insert(self, key: K, graph: Any, seconds: float, loaded: bool) -> None:
        """Put a graph the worker built (or ``loaded``) into the cache, counted as a load
        or a compile of ``seconds`` (released if the key was cached meanwhile)."""
        if not loaded and self._on_built is not None:
            self._on_built(key, graph)
        try:
            kept = self.cache.get_or_compile(key, lambda: graph, seconds=seconds,
                                             load=(lambda: graph) if loaded else None)
        except BaseException:
            self.family.release(key, graph)
            raise
        if kept is not graph:  # cached meanwhile by another user of a shared cache
            self.family.release(key, graph)

    def failed(self, key: K, error: BaseException) -> None:
        """Count the worker's failed build of ``key`` in the cache, as a miss whose build
        failed there (``compile_failures``): raises the cache's :class:`GraphCompileError`;
        returns only when ``key`` was cached meanwhile."""
        def fail() -> Any:
            raise error
        self.cache.get_or_compile(key, fail, seconds=0.0)


def after_warm_up(key: Any, load: Callable[[], Any] | None, strict: Callable[[Any], None],
                  loaded: Callable[[Any], None]) -> tuple[Any, float | None]:
    """A miss of ``key`` after warm-up under strict "warn" or "raise": a load is no
    compile, so ``load`` is tried first (``loaded(key)`` counts it) and ``strict(key)``
    governs only a compile. Returns the graph loaded and the load's seconds (``None,
    None``: compile it)."""
    start = perf_counter()
    try:
        graph = None if load is None else load()
    except Exception as exc:  # what the cache makes of a raising load
        raise GraphCompileError(f"loading the graph for key {key} failed: {type(exc).__name__}: {exc}") from exc
    if graph is None:
        strict(key)
        return None, None
    loaded(key)
    return graph, perf_counter() - start


def warn_loaded(key: Any, strict: str) -> None:
    """The one warning of the first load from the store after warm-up (of any family;
    the later ones are counted)."""
    warnings.warn(f"graph {key} loaded from the store after warm-up (strict={strict!r} allows loads: they compile "
                  "nothing); further loads after warm-up are counted in stats().loaded_after_warmup, not warned "
                  "about", RuntimeWarning, stacklevel=5)


def count_violation(counters: Counters, error: BaseException) -> None:
    """Count a compile that failed on a plugin kernel's bad output (a
    :class:`KernelError` raised while tracing) in ``kernel_violations``."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # Dynamo re-raises it as its "observed" copy
    observed = getattr(dynamo, "observed_exception_map", {}).get(KernelError, KernelError)
    seen: BaseException | None = error
    while seen is not None:  # the compiler wraps it: follow the causes
        if isinstance(seen, KernelError | observed):
            counters.kernel_violations += 1
            return
        seen = seen.__cause__ or seen.__context__
