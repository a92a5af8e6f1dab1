"""The attention-call graph family and its source: graphs of planned attention calls
(:class:`~attnpolicy.graphs.keys.GraphKey`), built by ``torch.compile`` (or a custom
builder), stored ahead of time, padded up to a larger resident bucket, run uncompiled
over the largest bucket or after a failed compile; and a batch's graphs fetched, pinned
until it has run, requested for a batch the host runs itself, warmed up."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from operator import is_
from typing import Any, cast

import torch

from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore, source_hash
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.code_identity import graph_code
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch.batch_plan import Planned, WarmCall
from attnpolicy.dispatch.graph_source import GraphSource, count_violation
from attnpolicy.dispatch.stats import Counters
from attnpolicy.errors import ConfigError, GraphCompileError
from attnpolicy.graphs import aot, plan_rules
from attnpolicy.graphs.compile import Capture, CompiledGraph, compile_graph, compile_lock, device_bytes, release_graph
from attnpolicy.graphs.execute import GraphFn, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels import attention
from attnpolicy.kernels.flex import BlockMaskCache, build_block_mask, flex_graph
from attnpolicy.plugins.compilers import resolve_compiler, why_unstored
from attnpolicy.plugins.kernels import kernel_code
from attnpolicy.plugins.observers import Observers

#: Builds the graph of a key: ``builder(call, key, spec) -> callable``. The default
#: compiles with ``torch.compile``; the simulator substitutes a cost-model stub.
Builder = Callable[[Call, GraphKey, TensorSpec], GraphFn]
#: What building an attention call's graph needs beyond its key.
CallRequest = tuple[Call, TensorSpec]
#: Fetched graphs: what runs each call, and the cache values they came from
#: (``None`` for a graph that is not the cache's: uncompiled, pad-up).
Fetched = tuple[list[tuple[Call, GraphFn]], tuple[Any, ...]]

_ONE_ROW = BatchLayout.from_lens([1])


class CallFamily:
    """The graphs of attention calls (:class:`~attnpolicy.dispatch.family.GraphFamily`).

    ``builder``: a custom builder (the simulator's), else :meth:`compile`, by the compiler
    ``config.backend`` names with ``config.backend_options``; with a custom builder
    nothing is stored. With ``config.store_dir`` a graph of any kernel but flex on a
    compiler that declares its artifacts storable, not the host's lazy VARLEN graph and
    whose kernel and compiler have a stable identity is compiled ahead of time and
    saved, and loaded on a miss; any other is compiled and not stored (one warning per
    kernel or compiler, counted in the store's ``unidentified`` or ``unstorable``).
    ``host_varlen``: the host runs VARLEN batches on a kernel of its own (their graphs
    compile lazily; FlexAttention is refused). Pad-up ranks candidates by ``cost_model``
    (default: the built-in one)."""

    eager_misses = False  # a background miss no resident graph serves compiles now

    def __init__(self, config: AttnPolicyConfig, block_masks: BlockMaskCache, *, builder: Builder | None = None,
                 compile_counter: Callable[[Any], None] | None = None, host_varlen: bool = False,
                 cost_model: Any = None) -> None:
        self.config = config
        self.block_masks = block_masks
        self.custom_builder = builder
        self.host_varlen = host_varlen
        self._compile_counter = compile_counter
        self._cost_model = cost_model
        self._pad_model: Any = None
        self._store = (DiskStore(config.store_dir, config.max_disk_bytes)
                       if config.store_dir is not None and builder is None else None)

    @property
    def store(self) -> DiskStore | None:
        return self._store

    def estimate_bytes(self, key: GraphKey) -> int:
        return graph_bytes(key)

    def rows(self, key: GraphKey) -> int:
        return key.rows * key.q_len

    def build(self, key: GraphKey, request: CallRequest) -> Any:
        """The graph of ``key`` from the custom builder, else :meth:`compile`."""
        call, spec = request
        return (self.custom_builder or self.compile)(call, key, spec)

    def identity(self, key: GraphKey) -> ArtifactIdentity | None:
        """What makes the stored artifact of ``key`` valid (see docs/store.md); ``None``
        when it is not stored (flex, backend ``"none"``, the host's lazy VARLEN graph, a
        kernel with no source to hash, a compiler that stores nothing)."""
        return identity(self.config, key) if self._storable(key) else None

    def _storable(self, key: GraphKey) -> bool:
        """Whether the graph of ``key`` is stored if its kernel's code has a stable identity."""
        return (key.impl != "flex" and key.backend != "none"
                and not (self.host_varlen and key.kind is CallKind.VARLEN))

    def _identity(self, key: GraphKey) -> ArtifactIdentity:
        ident = identity(self.config, key)
        assert ident is not None  # only stored keys have an identity
        return ident

    def lazy(self, key: GraphKey) -> bool:
        """Whether ``key``'s graph is the host's VARLEN one, compiled at its first call."""
        return self.host_varlen and key.kind is CallKind.VARLEN

    def load(self, key: GraphKey) -> CompiledGraph | None:
        """The graph of stored ``key`` from the store (``None``: not there or not valid)."""
        store = self._store
        assert store is not None  # only stored keys are loaded
        with compile_lock():  # taken before the store's file lock, as by every load and save
            loaded = store.load(self._identity(key), aot.load_graph, str(key))
        return None if loaded is None else _aot_graph(loaded, key.backend, None)

    def pad_up(self, key: GraphKey, resident: Sequence[GraphKey]) -> GraphKey | None:
        """The resident graph a call of ``key`` may pad up to: of its call kind,
        causality, spec, impl, partition, backend) with buckets at least ``key``'s, the
        one the cost model runs fastest (ties: the smaller buckets), when its extra run
        seconds over ``switch_after`` calls are less than compiling ``key``. FlexAttention
        graphs and MASK graphs whose mask would exceed ``max_mask_bytes`` never serve; a
        ROWS graph serves with at least ``key``'s rows, a mask-free one no call with context,
        and a ROWS call pads up only under a cost model that prices rows."""
        model = self._model()
        if key.impl == "flex" or not model.prices(key.kind):  # a model without a rows fit: no pad-up
            return None
        best: tuple[float, int, int] | None = None
        found: GraphKey | None = None
        for other in resident:
            if (not isinstance(other, GraphKey) or other.kind is not key.kind or other.causal != key.causal
                    or other.q_len < key.q_len or other.kv_len < key.kv_len or other.spec != key.spec
                    or other.impl != key.impl or other.partition_len != key.partition_len
                    or other.backend != key.backend or other == key or other.rows < key.rows
                    or (key.context and not other.context)):
                continue
            if key.kind is CallKind.MASK and plan_rules.mask_over(other.q_len, other.kv_len,
                                                                  self.config.max_mask_bytes):
                continue
            rank = (model.run_seconds(other), other.q_len, other.kv_len)
            if best is None or rank < best:
                best, found = rank, other
        if found is None or best is None:
            return None
        extra = (best[0] - model.run_seconds(key)) * self.config.switch_after
        return found if extra < model.compile_seconds(key) else None

    def _model(self) -> Any:
        """The cost model of pad-up decisions: the dispatcher's, else the built-in one."""
        if self._pad_model is None:
            from attnpolicy.graphs.costmodel import CostModel

            self._pad_model = self._cost_model or CostModel.default()
        return self._pad_model

    def eager(self, key: GraphKey, request: CallRequest) -> GraphFn:
        """What runs a call of ``key`` uncompiled."""
        call, spec = request
        if key.impl == "flex":
            feats = spec.features
            return FlexGraph(flex_graph(spec.scale, feats.softcap, feats.sinks), self.block_masks, feats.window)
        return graph_fn(call, key.impl, spec.scale, self.config.partition_len, spec.features)

    def release(self, key: GraphKey, graph: Any) -> None:
        release(key, graph)

    def compile(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        """Compile the graph of ``key`` (no dispatcher state touched: also runs in the
        background worker); ahead of time and saved when it is stored."""
        counter, options = self._compile_counter, self.config.backend_options
        feats = spec.features
        if key.impl == "flex":
            if self.host_varlen:
                raise ConfigError("kernel 'flex' does not run inside vLLM yet: configure sdpa, eager or flash "
                                  "for mask")
            ins = (*(t[None] for t in example_inputs(call, spec)[:3]),
                   build_block_mask(_ONE_ROW, call.q_bucket, call.kv_bucket, spec.device, feats.window),
                   *example_inputs(call, spec)[4:])
            graph = compile_graph(flex_graph(spec.scale, feats.softcap, feats.sinks), key.backend, options=options,
                                  counter=counter, example_inputs=ins)
            # flex graphs take a BlockMask: called through Dynamo
            return FlexGraph(graph, self.block_masks, feats.window)
        fn = graph_fn(call, key.impl, spec.scale, self.config.partition_len, feats)
        assert not isinstance(fn, FlexGraph)  # flex is compiled above
        store = self._store
        if store is not None and self._storable(key):
            stored = stored_identity(self.config, key)
            if not isinstance(stored, ArtifactIdentity):
                store.refuse(*stored)
            else:  # compiled ahead of time, saved for the next miss
                capture = Capture()
                with compile_lock():
                    compiled = aot.aot_compile_graph(fn, key.backend, example_inputs(call, spec), options=options,
                                                     counter=counter, capture=capture)
                    store.save(stored, partial(aot.save_graph, compiled), suffix=aot.SUFFIX)
                return _aot_graph(compiled, key.backend, capture)
        if self.lazy(key):  # the host's kernel runs it: lazy
            return compile_graph(fn, key.backend, options=options, counter=counter)
        return compile_graph(fn, key.backend, options=options, counter=counter,
                             example_inputs=example_inputs(call, spec))


class CallSource(GraphSource[GraphKey, CallRequest]):
    """The graphs of planned attention calls, from ``cache``, of ``family``.

    Under the family's ``host_varlen`` the keys of a VARLEN batch (:meth:`touch`), of one
    warmed (:meth:`warm_up`) and the VARLEN keys of a warm set enter the cache *deferred*
    (:meth:`GraphCache.reserve <attnpolicy.cache.graph_cache.GraphCache.reserve>`):
    counted and placed as graphs, none built; a graph is built (or loaded) only when a
    batch that runs it fetches it."""

    def __init__(self, cache: GraphCache[Any], counters: Counters, family: CallFamily) -> None:
        super().__init__(cache, counters, family, on_built=self._built)
        self.calls = family
        self.pinned: list[GraphKey] = []

    def _built(self, key: GraphKey, graph: Any) -> None:
        """Count a compiled graph of a compiler called directly (a built-in) that is called
        through Dynamo, the host's lazy VARLEN graphs aside."""
        if (isinstance(graph, CompiledGraph) and not graph.direct and graph.compiler is not None
                and graph.compiler.direct and not self.calls.lazy(key)):
            self.counters.direct_call_fallbacks += 1

    # -- one batch ----------------------------------------------------------------------
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

    def fetch_background(self, background: Any, calls: Planned, spec: TensorSpec) -> Fetched:
        """The graphs of one batch's ``calls`` (pinned) under background compiles
        (``background``: a :class:`~attnpolicy.dispatch.background.Background` of this
        source): first every compile due now switches in, in request order; then each
        built graph serves its call, a miss its pad-up (the call widened to its buckets)
        or its own graph compiled now."""
        background.next_batch()
        out: list[tuple[Call, GraphFn]] = []
        for call, key in calls:
            if call.compiled:
                served = background.route(key, (call, spec))
                if served is None:  # its compile failed, on_compile_error="eager"
                    out.append((call, self.calls.eager(key, (call, spec))))
                    continue
                if served != key:  # padded up
                    call = dataclasses.replace(call, q_bucket=served.q_len, kv_bucket=served.kv_len, rows=served.rows,
                                               context=call.context or served.context)
                    key = served
            out.append((call, self.graph(call, key, spec, pin=True)[0]))
        return out, (None,) * len(out)

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
            return self.calls.eager(key, (call, spec)), None
        try:
            graph = self.get(key, (call, spec), pin=pin)
        except GraphCompileError as exc:
            count_violation(self.counters, exc)
            if self.config.on_compile_error == "raise":
                raise
            self.counters.compile_error_fallbacks += 1
            return self.calls.eager(key, (call, spec)), None
        if pin:
            self.pinned.append(key)
        return runnable(graph), graph

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
                if mode is MaskMode.VARLEN and self.calls.host_varlen:  # a host step's: requested only
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
        return self.calls.lazy(key) and call.compiled


def code_hash_of(impl: str) -> tuple[str | None, str]:
    """``(code_hash, "")`` of graphs of kernel ``impl``: attnpolicy's graph code
    (:func:`~attnpolicy.core.code_identity.graph_code`) and, for a plugin kernel, its
    own (:func:`~attnpolicy.plugins.kernels.kernel_code`); ``(None, why)`` when the
    plugin kernel's has no stable identity."""
    try:
        return source_hash(graph_code(), *([] if impl in attention.BUILTIN_IMPLS else [kernel_code(impl)])), ""
    except ConfigError as e:
        return None, str(e)


def _aot_graph(compiled: Any, backend: str, capture: Capture | None) -> CompiledGraph:
    """A graph compiled ahead of time (``capture``: what its backend returned) or loaded
    (``None``), as the cache holds graphs: called directly (it checks no guards);
    releasing it is its compiler's ``release`` of what was captured, and the reference
    dropped."""
    graph = CompiledGraph(compiled, None, backend, capture=capture, compiler=resolve_compiler(backend))
    graph.direct = True
    return graph


def identity(config: AttnPolicyConfig, key: GraphKey) -> ArtifactIdentity | None:
    """What makes the stored artifact of ``key`` valid (see docs/store.md); ``None`` for
    a kernel with no source to hash or a compiler that stores nothing (its graphs are
    not stored)."""
    stored = stored_identity(config, key)
    return stored if isinstance(stored, ArtifactIdentity) else None


def stored_identity(config: AttnPolicyConfig, key: GraphKey) -> ArtifactIdentity | tuple[str, str, str]:
    """The identity of ``key``'s stored artifact, else ``(name, why, counter)``: what has no
    stable identity or stores nothing (the kernel's code, the compiler's code or options,
    a compiler that declares no reloadable artifacts), as the store's ``refuse`` takes it."""
    code, why = code_hash_of(key.impl)
    if code is None:
        return f"kernel {key.impl!r}", why, "unidentified"
    compiler, why, counter = why_unstored(resolve_compiler(key.backend), config.backend_options)
    if compiler is None:
        return f"compiler {key.backend!r}", why, counter
    return ArtifactIdentity.for_graph(key, mechanism=aot.MECHANISM, code_hash=code,
                                      config={"partition_len": config.partition_len}, compiler=compiler)


def make_cache(config: AttnPolicyConfig, cost_model: Any, observers: Observers) -> GraphCache[Any]:
    """The graph cache ``config`` describes, sized by graph footprints, reporting to
    ``observers``. ``eviction="cost"`` ranks graphs by *modelled* compile seconds, so
    that every tensor-parallel rank evicts the same graphs (measured seconds differ);
    with a ``store_dir``, a graph whose artifact is in the store by its modelled load
    seconds instead (what bringing it back costs)."""
    compile_cost, options = eviction_of(config, cost_model)
    return GraphCache.from_config(config, sizeof=graph_bytes, compile_cost=compile_cost, eviction_options=options,
                                  on_compile=observers.on_compile, on_evict=observers.on_evict, release=release,
                                  measure=measured_bytes)


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


def runnable(graph: Any) -> GraphFn:
    """What runs a cached graph: a compiled graph's backend callable (guard-free)."""
    return cast(GraphFn, graph.call if type(graph) is CompiledGraph else graph)


def release(key: GraphKey, graph: Any) -> None:
    """Free what a graph of the cache holds (its compiled code)."""
    inner = graph.graph if isinstance(graph, FlexGraph) else graph
    if isinstance(inner, CompiledGraph):
        release_graph(inner)


def measured_bytes(key: GraphKey, graph: Any) -> int | None:
    """The bytes a graph of the cache holds on its device, where its compiler reports them
    (:func:`~attnpolicy.graphs.compile.device_bytes`); ``None``: the computed ones stand."""
    inner = graph.graph if isinstance(graph, FlexGraph) else graph
    return device_bytes(inner) if isinstance(inner, CompiledGraph) else None


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
    if call.kind is CallKind.ROWS:  # gathered rows: [R, L, H, D] viewed heads first
        def rows(length: int, heads: int) -> torch.Tensor:
            return torch.zeros(call.rows, length, heads, spec.head_dim, dtype=dtype, device=dev).transpose(1, 2)
        lens = (torch.zeros(call.rows, dtype=torch.int64, device=dev) for _ in range(2))
        return (rows(call.q_bucket, spec.heads), rows(call.kv_bucket, spec.kv_heads),
                rows(call.kv_bucket, spec.kv_heads), *lens, *sinks)
    if call.kind is CallKind.MASK:
        return q, k, v, torch.ones(call.q_bucket, call.kv_bucket, dtype=torch.bool, device=dev), *sinks
    if call.kind is CallKind.VARLEN:
        return q, k, v, torch.tensor([call.q_bucket, call.kv_bucket], device=dev), *sinks
    return q, k, v, *sinks
