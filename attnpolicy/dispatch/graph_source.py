"""Where a batch's graphs come from: the bounded graph cache, the builder that
compiles a miss, the strict mode after warm-up, the pins that hold a batch's graphs
until it has run, and the stalls synchronous compiles cost."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from operator import is_
from time import perf_counter
from typing import Any, cast

import torch

from attnpolicy.cache.code_identity import graph_code
from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore, source_hash
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch.batch_plan import Planned, WarmCall
from attnpolicy.dispatch.stats import Counters
from attnpolicy.errors import ConfigError, GraphCompileError, KernelError, StrictModeError
from attnpolicy.graphs import aot
from attnpolicy.graphs.compile import CompiledGraph, compile_graph, compile_lock, release_graph
from attnpolicy.graphs.execute import GraphFn, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels import attention
from attnpolicy.kernels.flex import BlockMaskCache, build_block_mask, flex_graph
from attnpolicy.plugins.kernels import kernel_code
from attnpolicy.plugins.observers import Observers

#: Builds the graph of a key: ``builder(call, key, spec) -> callable``. The default
#: compiles with ``torch.compile``; the simulator substitutes a cost-model stub.
Builder = Callable[[Call, GraphKey, TensorSpec], GraphFn]
#: Fetched graphs: what runs each call, and the cache values they came from
#: (``None`` for a graph that is not the cache's: uncompiled, pad-up).
Fetched = tuple[list[tuple[Call, GraphFn]], tuple[Any, ...]]

_ONE_ROW = BatchLayout.from_lens([1])


class GraphSource:
    """The graphs of planned calls, from ``cache``, built by ``builder`` on a miss.

    ``host_varlen``: the host runs VARLEN batches on a kernel of its own. The keys of
    such a batch (:meth:`touch`), of one warmed (:meth:`warm_up`) and the VARLEN keys
    of a warm set enter the cache *deferred*
    (:meth:`GraphCache.reserve <attnpolicy.cache.graph_cache.GraphCache.reserve>`):
    counted and placed as graphs, none built; a graph is built (or loaded) only when a
    batch that runs it fetches it. FlexAttention is refused (the host feeds MASK
    graphs keys of its own cache).

    With ``config.store_dir`` (and the default builder) a miss of a stored graph
    (any but flex, backend not ``"none"``) loads it from the :class:`DiskStore`
    (counted as a load), or compiles it ahead of time and saves it there."""

    def __init__(self, config: AttnPolicyConfig, cache: GraphCache[Any], counters: Counters,
                 block_masks: BlockMaskCache, *, builder: Builder | None = None,
                 compile_counter: Callable[[Any], None] | None = None, host_varlen: bool = False) -> None:
        self.config = config
        self.cache = cache
        self.counters = counters
        self.block_masks = block_masks
        self.custom_builder = builder
        self._builder = builder or self._compile
        self._compile_counter = compile_counter
        self._host_varlen = host_varlen
        self.warm = False  # after warm-up: a compile is a strict-mode violation
        self.pinned: list[GraphKey] = []
        self.stall = 0.0  # seconds the batch being fetched stalled so far
        self.stalls: list[float] = []
        self.stall_seconds = 0.0
        self.store = (DiskStore(config.store_dir, config.max_disk_bytes)
                      if config.store_dir is not None and builder is None else None)

    # -- one batch ----------------------------------------------------------------------
    def end(self) -> None:
        """Record the stall of the batch just fetched, if it stalled."""
        if self.stall:
            self.stalls.append(self.stall)
            self.stall_seconds += self.stall

    def fetch(self, calls: Planned, keys: tuple[GraphKey, ...], spec: TensorSpec,
              known: tuple[Any, ...] = ()) -> Fetched | None:
        """The graphs of ``calls``, pinned: the cached ones under one lock (``keys``:
        every call's, when all are compiled), each other call through :meth:`graph`.
        ``None`` when every graph is the cache's ``known`` one (the caller has them)."""
        if len(calls) == 1:  # one call: straight from the cache, as any miss
            call, key = calls[0]
            graph, value = self.graph(call, key, spec, pin=True)
            if known and value is known[0] and value is not None:
                return None
            return [(call, graph)], (value,)
        out: list[tuple[Call, GraphFn]] = []
        values: list[Any] = []
        i = 0
        if keys:
            i = self.cache.hit_many(keys, pin=True, values=values)
            self.pinned.extend(keys[:i])
            if i == len(keys) and len(known) == i and all(map(is_, values, known)):
                return None
            out = [(call, runnable(g)) for (call, _), g in zip(calls, values)]
        for call, key in calls[i:]:
            graph, value = self.graph(call, key, spec, pin=True)
            out.append((call, graph))
            values.append(value)
        return out, tuple(values)

    def touch(self, keys: list[GraphKey | None]) -> None:
        """Request ``keys`` from the cache as :meth:`fetch` would (hits under one lock;
        ``None``: an uncompiled call), for a batch the host runs itself: nothing is
        built, returned or pinned; a miss enters the cache deferred."""
        cache, n, i = self.cache, len(keys), 0
        while (j := cache.hit_many(keys, i)) < n:  # None is never cached
            key = keys[j]
            if key is None:  # longer than the largest bucket: runs uncompiled
                self.counters.overflow += 1
            else:
                cache.reserve(key)
            i = j + 1

    def release(self) -> None:
        """Unpin the graphs of the batch last fetched (it has run)."""
        if self.pinned:
            pinned, self.pinned = self.pinned, []
            self.cache.unpin(pinned)

    # -- one graph ----------------------------------------------------------------------
    def graph(self, call: Call, key: GraphKey, spec: TensorSpec, pin: bool = False) -> tuple[GraphFn, Any]:
        """What runs ``call`` and the cache value it is (``None`` when it runs
        uncompiled: over the largest bucket, or its compile failed under
        ``on_compile_error='eager'``; both counted)."""
        if not call.compiled:  # longer than the largest bucket, on_overflow="eager"
            self.counters.overflow += 1
            return self.uncompiled(call, spec, key.impl), None
        load: Callable[[], Any] | None = partial(self._timed_load, call, key, spec) if self.stored(key) else None
        seconds: float | None = None
        loaded: Any = None
        try:
            if self.warm and self.config.strict != "off" and not self.cache.has_graph(key):
                loaded, seconds = after_warm_up(key, load, self.strict, self.loaded_after_warm_up)
                load = None if loaded is None else lambda: loaded
            graph = self.cache.get_or_compile(key, partial(self._timed_build, call, key, spec), pin=pin,
                                              seconds=seconds, load=load)
        except GraphCompileError as exc:
            count_violation(self.counters, exc)
            if self.config.on_compile_error == "raise":
                raise
            self.counters.compile_error_fallbacks += 1
            return self.uncompiled(call, spec, key.impl), None
        if loaded is not None and graph is not loaded:  # cached meanwhile by another user of a shared cache
            release(key, loaded)
        if pin:
            self.pinned.append(key)
        return runnable(graph), graph

    def uncompiled(self, call: Call, spec: TensorSpec, impl: str) -> GraphFn:
        if impl == "flex":
            feats = spec.features
            return FlexGraph(flex_graph(spec.scale, feats.softcap, feats.sinks), self.block_masks, feats.window)
        return graph_fn(call, impl, spec.scale, self.config.partition_len, spec.features)

    def strict(self, key: GraphKey, *, done: bool = False) -> None:
        """A compile after warm-up: counted, then warned or raised (``strict``; ``done``:
        the worker has compiled it already, a stored graph it could not load: warned)."""
        self.counters.strict_violations += 1
        message = f"graph {key} compiled after warm-up (strict={self.config.strict!r})"
        if self.config.strict == "raise" and not done:
            raise StrictModeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def loaded_after_warm_up(self, key: GraphKey) -> None:
        """A load from the store after warm-up (no compile: ``strict`` allows it): counted,
        the first one warned about."""
        c = self.counters
        c.loaded_after_warmup += 1
        if c.loaded_after_warmup == 1:
            warn_loaded(key, self.config.strict)

    def holds(self, key: GraphKey) -> bool:
        """Whether the store holds an artifact of ``key`` now (not verified: a load may
        still fail and compile)."""
        return self.store is not None and self.stored(key) and self.store.holds(self.identity(key))

    def warm_up(self, calls: Iterable[WarmCall], spec: TensorSpec) -> list[GraphKey]:
        """Fetch (compile) the graph of every ``(call, key, listed, mode)``, then turn
        strict mode on; returns the keys of the listed ones. The warm-up's own compiles
        are no violations. Under ``host_varlen`` nothing the host's kernel runs is built:
        a VARLEN key of the warm set, every call of a layout planned in VARLEN (a host
        step, as ``prepare`` makes it); their keys enter the cache deferred."""
        keys: dict[GraphKey, None] = {}
        warm, self.warm = self.warm, False
        try:
            for call, key, listed, mode in calls:
                if mode is MaskMode.VARLEN and self._host_varlen:  # a host step's: requested only
                    if call.compiled:
                        self.cache.reserve(key)
                elif self.host_runs(call, key):
                    self.cache.reserve(key)
                else:
                    self.graph(call, key, spec)
                if listed:
                    keys[key] = None
        except BaseException:
            self.warm = warm
            raise
        self.warm = True
        return list(keys)

    def host_runs(self, call: Call, key: GraphKey) -> bool:
        """Whether a warm set's ``call`` of ``key`` is the host's to run (``host_varlen``, a
        compiled VARLEN call): its key enters the cache deferred, its graph is not built."""
        return self._host_varlen and key.kind is CallKind.VARLEN and call.compiled

    # -- building -----------------------------------------------------------------------
    def _timed_build(self, call: Call, key: GraphKey, spec: TensorSpec) -> Any:
        """A synchronous build: its wall seconds stall the batch being fetched."""
        start = perf_counter()
        try:
            return self._builder(call, key, spec)
        finally:
            self.stall += perf_counter() - start

    def _timed_load(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | None:
        """The graph of ``key`` from the store (``None``: not there or not valid); its
        wall seconds stall the batch being fetched, as a build's do."""
        start = perf_counter()
        try:
            return self.load(key)
        finally:
            self.stall += perf_counter() - start

    def load(self, key: GraphKey) -> CompiledGraph | None:
        """The graph of stored ``key`` from the store (``None``: not there or not valid);
        no dispatcher state touched: also runs in the background worker."""
        assert self.store is not None  # only stored keys are loaded
        with compile_lock():  # taken before the store's file lock, as by every load and save
            loaded = self.store.load(self.identity(key), aot.load_graph, str(key))
        return None if loaded is None else _aot_graph(loaded, key.backend)

    def stored(self, key: GraphKey) -> bool:
        """Whether the graph of ``key`` goes through the store: a store is configured, the
        graph is compiled ahead of time (not flex, a backend) and is not the host's lazy
        VARLEN graph."""
        return self._storable(key) and kernel_hash(key.impl) is not None

    def _storable(self, key: GraphKey) -> bool:
        """Whether the graph of ``key`` would go through the store if its kernel's code
        has a stable identity."""
        return (self.store is not None and key.impl != "flex" and key.backend != "none"
                and not (self._host_varlen and key.kind is CallKind.VARLEN))

    def identity(self, key: GraphKey) -> ArtifactIdentity:
        """What makes the stored artifact of ``key`` valid (see docs/store.md)."""
        ident = identity(self.config, key)
        assert ident is not None  # only stored keys have an identity
        return ident

    def _compile(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        graph = self.build(call, key, spec)
        lazy = self._host_varlen and key.kind is CallKind.VARLEN
        if isinstance(graph, CompiledGraph) and not graph.direct and not lazy:
            self.counters.direct_call_fallbacks += 1
        return graph

    def build(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        """Compile the graph of ``key`` (no dispatcher state touched: also runs in the
        background worker)."""
        counter = self._compile_counter
        feats = spec.features
        if key.impl == "flex":
            if self._host_varlen:
                raise ConfigError("kernel 'flex' does not run inside vLLM yet: configure sdpa, eager or flash "
                                  "for mask")
            ins = (*(t[None] for t in example_inputs(call, spec)[:3]),
                   build_block_mask(_ONE_ROW, call.q_bucket, call.kv_bucket, spec.device, feats.window),
                   *example_inputs(call, spec)[4:])
            graph = compile_graph(flex_graph(spec.scale, feats.softcap, feats.sinks), key.backend, counter=counter,
                                  example_inputs=ins)
            # flex graphs take a BlockMask: called through Dynamo
            return FlexGraph(graph, self.block_masks, feats.window)
        fn = graph_fn(call, key.impl, spec.scale, self.config.partition_len, feats)
        assert not isinstance(fn, FlexGraph)  # flex is compiled above
        if self.store is not None and self._storable(key):
            code, why = code_hash_of(key.impl)
            if code is not None:  # compiled ahead of time, saved for the next miss
                with compile_lock():
                    compiled = aot.aot_compile_graph(fn, key.backend, example_inputs(call, spec))
                    self.store.save(self.identity(key), partial(aot.save_graph, compiled), suffix=aot.SUFFIX)
                return _aot_graph(compiled, key.backend)
            self.store.refuse(f"kernel {key.impl!r}", why)
        if self._host_varlen and key.kind is CallKind.VARLEN:  # the host's kernel runs it: lazy
            return compile_graph(fn, key.backend, counter=counter)
        return compile_graph(fn, key.backend, counter=counter, example_inputs=example_inputs(call, spec))


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
    """The one warning of the first load from the store after warm-up (of a dispatcher
    or a model runner; the later ones are counted)."""
    warnings.warn(f"graph {key} loaded from the store after warm-up (strict={strict!r} allows loads: they compile "
                  "nothing); further loads after warm-up are counted in stats().loaded_after_warmup, not warned "
                  "about", RuntimeWarning, stacklevel=5)


def kernel_hash(impl: str) -> str | None:
    """The ``code_hash`` of graphs of kernel ``impl``, or ``None`` when its code has no
    stable identity (its graphs are compiled, not stored): :func:`code_hash_of`."""
    return code_hash_of(impl)[0]


def code_hash_of(impl: str) -> tuple[str | None, str]:
    """``(code_hash, "")`` of graphs of kernel ``impl``: attnpolicy's graph code
    (:func:`~attnpolicy.cache.code_identity.graph_code`) and, for a plugin kernel, its
    own (:func:`~attnpolicy.plugins.kernels.kernel_code`); ``(None, why)`` when the
    plugin kernel's has no stable identity."""
    try:
        return source_hash(graph_code(), *([] if impl in attention.BUILTIN_IMPLS else [kernel_code(impl)])), ""
    except ConfigError as e:
        return None, str(e)


def _aot_graph(compiled: Any, backend: str) -> CompiledGraph:
    """A graph compiled ahead of time (or loaded), as the cache holds graphs: called
    directly (it checks no guards); releasing it drops the reference."""
    graph = CompiledGraph(compiled, None, backend)
    graph.direct = True
    return graph


def identity(config: AttnPolicyConfig, key: GraphKey) -> ArtifactIdentity | None:
    """What makes the stored artifact of ``key`` valid (see docs/store.md); ``None`` for
    a kernel with no source to hash (its graphs are not stored)."""
    code = kernel_hash(key.impl)
    if code is None:
        return None
    return ArtifactIdentity.for_graph(key, mechanism=aot.MECHANISM, code_hash=code,
                                      config={"partition_len": config.partition_len})


def make_cache(config: AttnPolicyConfig, cost_model: Any, observers: Observers) -> GraphCache[Any]:
    """The graph cache ``config`` describes, sized by graph footprints, reporting to
    ``observers``. ``eviction="cost"`` ranks graphs by *modelled* compile seconds, so
    that every tensor-parallel rank evicts the same graphs (measured seconds differ);
    with a ``store_dir``, a graph whose artifact is in the store by its modelled load
    seconds instead (what bringing it back costs)."""
    compile_cost, options = eviction_of(config, cost_model)
    return GraphCache.from_config(config, sizeof=graph_bytes, compile_cost=compile_cost, eviction_options=options,
                                  on_compile=observers.on_compile, on_evict=observers.on_evict, release=release)


def eviction_of(config: AttnPolicyConfig, cost_model: Any
                ) -> tuple[Callable[[Any, float], float] | None, dict[str, Any] | None]:
    """The cache's ``compile_cost`` and ``eviction_options`` for ``config``: under
    ``eviction="cost"`` the modelled compile seconds and, with a ``store_dir``, the
    modelled reload seconds of graphs in the store; ``(None, None)`` otherwise."""
    if config.eviction != "cost":
        return None, None
    from attnpolicy.graphs.costmodel import CostModel

    model = cost_model or CostModel.default()
    options = None
    if config.store_dir is not None:
        model.require_store("of eviction 'cost' with a store_dir")
        store = DiskStore(config.store_dir, config.max_disk_bytes)
        options = {"reload": partial(_reload_seconds, store, config, model)}
    return cast(Callable[[Any, float], float], model.compile_cost), options


def _reload_seconds(store: DiskStore, config: AttnPolicyConfig, model: Any, key: Any) -> float | None:
    """The modelled load seconds of ``key`` when its artifact is in ``store``, else ``None``."""
    if not isinstance(key, GraphKey) or not model.stored(key):
        return None
    ident = identity(config, key)
    return model.load_seconds(key) if ident is not None and store.holds(ident) else None


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


def runnable(graph: Any) -> GraphFn:
    """What runs a cached graph: a compiled graph's backend callable (guard-free)."""
    return cast(GraphFn, graph.call if type(graph) is CompiledGraph else graph)


def release(key: GraphKey, graph: Any) -> None:
    """Free what a graph of the cache holds (its compiled code)."""
    inner = graph.graph if isinstance(graph, FlexGraph) else graph
    if isinstance(inner, CompiledGraph):
        release_graph(inner)


def example_inputs(call: Call, spec: TensorSpec) -> tuple[torch.Tensor, ...]:
    """Zero tensors of a call's static shapes and strides (heads-first views of packed
    token-major tensors, as ``graph_inputs`` makes them; then the sink logits when the
    spec has sinks): what the graph is compiled for."""
    dtype = getattr(torch, spec.dtype)
    dev = torch.device(spec.device)
    q = torch.zeros(call.q_bucket, spec.heads, spec.head_dim, dtype=dtype, device=dev).transpose(0, 1)
    k, v = (torch.zeros(call.kv_bucket, spec.kv_heads, spec.head_dim, dtype=dtype, device=dev).transpose(0, 1)
            for _ in range(2))  # distinct objects: Dynamo guards on aliasing
    sinks = (torch.zeros(spec.heads, dtype=dtype, device=dev),) if spec.features.sinks else ()
    if call.kind is CallKind.MASK:
        return q, k, v, torch.ones(call.q_bucket, call.kv_bucket, dtype=torch.bool, device=dev), *sinks
    if call.kind is CallKind.VARLEN:
        return q, k, v, torch.tensor([call.q_bucket, call.kv_bucket], device=dev), *sinks
    return q, k, v, *sinks
