"""The Dispatcher: layout → policy (guarded) → planned calls → cached graphs → output."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import cachetools
import torch

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.errors import (
    BucketOverflowError,
    ConfigError,
    GraphCompileError,
    StrictModeError,
)
from attnpolicy.graphs.compile import CompiledGraph, compile_graph, release_graph
from attnpolicy.graphs.execute import GraphFn, check_inputs, execute, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.graphs.plan import plan_calls
from attnpolicy.kernels.flex import BlockMaskCache, build_block_mask, flex_graph
from attnpolicy.plugins.kernels import (
    FAMILIES,
    KernelInfo,
    get_kernel,
    impls_for,
    why_unfit,
)
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard

#: Planned (call, key) tuples remembered per (layout, mode, spec); also the bound of
#: the prepared-batch memo (cleared when full).
PLAN_CACHE_SIZE = 4096

Planned = tuple[tuple[Call, GraphKey | None], ...]
#: Builds the graph of a key: ``builder(call, key, spec) -> callable``. The default
#: compiles with ``torch.compile``; the simulator substitutes a cost-model stub.
Builder = Callable[[Call, GraphKey, TensorSpec], GraphFn]


class Dispatcher:
    """Runs attention the way ``config`` says, through a bounded graph cache.

    ``attend(q, k, v, layout)`` takes packed ``q[q_tokens, Hq, D]`` and
    ``k, v[kv_tokens, Hkv, D]`` (see :mod:`attnpolicy.core.layout`) and returns
    ``[q_tokens, Hq, D]`` (padding rows zero). Decisions and graph keys are a pure
    function of the layout, the config and the sequence of earlier calls, so
    tensor-parallel ranks replaying the same batches agree. A Dispatcher is not
    thread-safe (its graph cache is): use one per thread, or lock around it.

    ``cache`` replaces the graph cache built from the config; ``compile_counter(gm)``
    sees every backend compile; ``builder`` replaces compilation (simulation).
    """

    def __init__(self, config: AttnPolicyConfig | None = None, *, cost_model: Any = None,
                 cache: GraphCache | None = None,
                 compile_counter: Callable[[Any], None] | None = None,
                 builder: Builder | None = None) -> None:
        self.config = cfg = config or AttnPolicyConfig()
        hook = get_plugin_manager().hook
        self.guard = Guard.for_policy(cfg.policy, cfg.policy_options, on_illegal=cfg.on_illegal,
                                      fallback=MaskMode(cfg.fallback_mode))
        self.cache = cache if cache is not None else GraphCache.from_config(
            cfg, sizeof=graph_bytes, compile_cost=_modelled_cost(cfg, cost_model),
            on_compile=lambda key, s, n: hook.attnpolicy_on_compile(key=key, seconds=s, nbytes=n),
            on_evict=lambda key, n: hook.attnpolicy_on_evict(key=key, nbytes=n),
            release=_release)
        self._compile_counter = compile_counter
        self._builder = builder or self._compile
        self._largest = _largest_bucket(cfg, cfg.max_seq_len)
        self._largest_batch = _largest_bucket(cfg, cfg.max_batch_tokens)
        self._spec: TensorSpec | None = None
        self._plans: cachetools.LRUCache = cachetools.LRUCache(PLAN_CACHE_SIZE)
        self._batches: dict[tuple[BatchLayout, TensorSpec], _Prepared] = {}
        self._specs: dict[tuple[Any, ...], TensorSpec] = {}
        self._warm = False
        self.context = PolicyContext(config=cfg, is_cached=self.cache.__contains__,
                                     keys_for=self._keys_for, cost_model=cost_model)
        self._modes: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._kernels = _KernelChoice(cfg, cost_model)
        #: FlexAttention block masks per layout (bounded; see kernels/flex.py)
        self.block_masks = BlockMaskCache()

    # -- the hot path ------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
               scale: float | None = None) -> torch.Tensor:
        """Attention for ``layout``, computed in the mode the (guarded) policy chose."""
        check_inputs(q, k, v, layout)
        return execute(q, k, v, layout, self.prepare(layout, self._spec_of(q, k, scale)))

    def prepare(self, layout: BatchLayout, spec: TensorSpec) -> list[tuple[Call, GraphFn]]:
        """Decide, plan and fetch (or compile) the graphs for ``layout``: everything
        ``attend`` does except touching tensors. One call per graph invocation."""
        batch = self._prepared(layout, spec)
        out = [(call, self._graph(call, key, spec, layout)) for call, key in batch.planned]
        # counted once every graph is at hand: a batch that raised is not counted
        self._modes[batch.decision.mode.value] += 1
        c = self._counts
        c["batches"] += 1
        c["calls"] += batch.calls
        c["real_tokens"] += layout.total_tokens
        c["padded_tokens"] += batch.padded_tokens
        return out

    # -- prepared batches: the per-layout memo of the hot path ---------------------------
    def _prepared(self, layout: BatchLayout, spec: TensorSpec) -> _Prepared:
        """The decision and plan for ``layout``. A stateless policy's decision (see
        :attr:`Guard.stateless`) is reused per (layout, spec) and replayed to the
        decision hook; any other policy is asked every time, as is a decision the
        guard overrode (its fallback is counted per batch). Graphs are not memoised:
        ``_graph`` fetches them from the cache for every call, so hits, recency and
        evictions stay exact."""
        self._spec = spec
        memo_key = (layout, spec)
        batch = self._batches.get(memo_key)
        if batch is not None:
            self.guard.replay(layout, batch.decision)
            return batch
        fallbacks = self.guard.fallbacks
        decision = self.decide(layout)
        batch = _Prepared(decision, self._planned(layout, decision.mode, spec), layout)
        if self.guard.stateless and self.guard.fallbacks == fallbacks:
            if len(self._batches) >= PLAN_CACHE_SIZE:
                self._batches.clear()
            self._batches[memo_key] = batch
        return batch

    def _spec_of(self, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> TensorSpec:
        """``TensorSpec.of(q, k, scale)``, reused per distinct tensor properties."""
        key = (q.dtype, q.shape[1], q.shape[2], k.shape[1], scale, q.device)
        spec = self._specs.get(key)
        if spec is None:
            if len(self._specs) >= PLAN_CACHE_SIZE:
                self._specs.clear()
            spec = self._specs[key] = TensorSpec.of(q, k, scale)
        return spec

    def decide(self, layout: BatchLayout) -> Decision:
        """The decision that runs for ``layout`` (after the guard)."""
        return self.guard.decide(layout, self.context)

    def use_spec(self, spec: TensorSpec) -> TensorSpec:
        """Make ``spec`` the tensor spec policies see in ``keys_for`` (set by ``prepare``)."""
        self._spec = spec
        return spec

    # -- planning ----------------------------------------------------------------------
    def _overflow(self, n: int, largest: int, field: str) -> int:
        if self.config.on_overflow == "raise":
            raise BucketOverflowError(
                f"length {n} exceeds the largest bucket {largest} (buckets {self.config.buckets.describe()}, "
                f"{field}={getattr(self.config, field)}); set on_overflow='eager' to run it uncompiled")
        return n

    def _bucket(self, n: int) -> int:
        if n > self._largest:
            return self._overflow(n, self._largest, "max_seq_len")
        return self.config.bucket(n)

    def _batch_bucket(self, n: int) -> int:
        if n > self._largest_batch:
            return self._overflow(n, self._largest_batch, "max_batch_tokens")
        return self.config.batch_bucket(n)

    def _compiled(self, call: Call) -> bool:
        """False for a call longer than its largest bucket (run uncompiled, on_overflow='eager')."""
        limit = self._largest_batch if call.kind is MaskMode.MASK else self._largest
        return max(call.q_bucket, call.kv_bucket) <= limit

    def _planned(self, layout: BatchLayout, mode: MaskMode, spec: TensorSpec) -> Planned:
        plan_key = (layout, mode, spec)
        planned = self._plans.get(plan_key)
        if planned is None:
            cfg = self.config
            planned = tuple(
                (call, GraphKey.for_call(call, spec, self._kernels.impl(call, layout, spec), cfg.partition_len,
                                         cfg.backend)
                 if self._compiled(call) else None)
                for call in plan_calls(layout, mode, self._bucket, self._batch_bucket))
            self._plans[plan_key] = planned
        return planned

    def _keys_for(self, layout: BatchLayout, mode: MaskMode) -> tuple[GraphKey, ...]:
        if self._spec is None:
            return ()
        return tuple(key for _, key in self._planned(layout, mode, self._spec) if key is not None)

    def graph_keys_for(self, layout: BatchLayout, spec: TensorSpec | None = None) -> tuple[GraphKey, ...]:
        """The graph keys the current decision for ``layout`` would use. It asks the
        policy like a real batch does (the guard counts and reports the decision, and a
        stateful policy advances), so call it on every rank or on none."""
        if spec is not None:
            self.use_spec(spec)
        return self._keys_for(layout, self.decide(layout).mode)

    # -- graphs ------------------------------------------------------------------------
    def _uncompiled(self, call: Call, spec: TensorSpec, impl: str) -> GraphFn:
        if impl == "flex":
            return FlexGraph(flex_graph(spec.scale), self.block_masks)
        return graph_fn(call, impl, spec.scale, self.config.partition_len)

    def _graph(self, call: Call, key: GraphKey | None, spec: TensorSpec,
               layout: BatchLayout | None = None) -> GraphFn:
        if key is None:  # longer than the largest bucket, on_overflow="eager"
            self._counts["overflow"] += 1
            impl = (self.config.attn_impl or "sdpa") if layout is None else self._kernels.impl(call, layout, spec)
            return self._uncompiled(call, spec, impl)
        if self._warm and self.config.strict != "off" and key not in self.cache:
            self._strict(key)
        try:
            graph = self.cache.get_or_compile(key, lambda: self._builder(call, key, spec))
        except GraphCompileError:
            if self.config.on_compile_error == "raise":
                raise
            self._counts["compile_error_fallbacks"] += 1
            return self._uncompiled(call, spec, key.impl)
        # a compiled graph runs through the callable its backend produced (guard-free)
        return graph.call if type(graph) is CompiledGraph else graph

    def _compile(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        if key.impl == "flex":
            ins = (*(t[None] for t in example_inputs(call, spec)[:3]),
                   build_block_mask(_ONE_ROW, call.q_bucket, call.kv_bucket, spec.device))
            graph = compile_graph(flex_graph(spec.scale), key.backend, counter=self._compile_counter,
                                  example_inputs=ins)
            return FlexGraph(graph, self.block_masks)  # flex graphs take a BlockMask: called through Dynamo
        fn = graph_fn(call, key.impl, spec.scale, self.config.partition_len)
        assert not isinstance(fn, FlexGraph)  # flex is compiled above
        graph = compile_graph(fn, key.backend, counter=self._compile_counter,
                              example_inputs=example_inputs(call, spec))
        if not graph.direct:
            self._counts["direct_call_fallbacks"] += 1
        return graph

    def _strict(self, key: GraphKey) -> None:
        self._counts["strict_violations"] += 1
        message = f"graph {key} compiled after warm-up (strict={self.config.strict!r})"
        if self.config.strict == "raise":
            raise StrictModeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def warmup(self, layouts: Iterable[BatchLayout], spec: TensorSpec) -> list[GraphKey]:
        """Compile the graphs the policy would use for ``layouts`` (no attention runs),
        then count any later compile as a strict-mode violation. Returns the keys."""
        self.use_spec(spec)
        keys: dict[GraphKey, None] = {}
        for layout in layouts:
            for call, key in self._planned(layout, self.decide(layout).mode, spec):
                self._graph(call, key, spec)  # with the same overflow and compile-error rules
                if key is not None:
                    keys[key] = None
        self._warm = True
        return list(keys)

    # -- observation -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of this dispatcher and its cache (see docs/cache.md)."""
        c = self._counts
        real, padded = c["real_tokens"], c["padded_tokens"]
        return {
            "batches": c["batches"],
            "calls": c["calls"],
            "modes": {m.value: self._modes[m.value] for m in MaskMode},
            "guard_fallbacks": self.guard.fallbacks,
            "overflow": c["overflow"],
            "compile_error_fallbacks": c["compile_error_fallbacks"],
            "strict_violations": c["strict_violations"],
            "direct_call_fallbacks": c["direct_call_fallbacks"],
            "padding": {"real_tokens": real, "padded_tokens": padded,
                        "waste": padded / real if real else 0.0},
            "cache": self.cache.stats(),
            "block_masks": {"entries": len(self.block_masks), "bytes": self.block_masks.nbytes,
                            "max_entries": self.block_masks.max_entries, "builds": self.block_masks.builds},
        }


class _Prepared:
    """A batch's decision and planned (call, key) pairs, with its per-batch counts."""

    __slots__ = ("calls", "decision", "padded_tokens", "planned")

    def __init__(self, decision: Decision, planned: Planned, layout: BatchLayout) -> None:
        self.decision = decision
        self.planned = planned
        self.calls = len(planned)
        self.padded_tokens = sum(call.q_bucket for call, _ in planned) - layout.total_tokens


def _modelled_cost(cfg: AttnPolicyConfig, cost_model: Any) -> Callable[[GraphKey, float], float] | None:
    """For ``eviction="cost"``: rank graphs by *modelled* compile seconds, so that
    every tensor-parallel rank evicts the same graphs (measured seconds differ)."""
    if cfg.eviction != "cost":
        return None
    from attnpolicy.graphs.costmodel import CostModel

    return (cost_model or CostModel.default()).compile_cost


def _release(key: GraphKey, graph: CompiledGraph | FlexGraph) -> None:
    inner = graph.graph if isinstance(graph, FlexGraph) else graph
    if isinstance(inner, CompiledGraph):
        release_graph(inner)


_ONE_ROW = BatchLayout.from_lens([1])


class _KernelChoice:
    """Which registered implementation runs each call: the config's choice per family
    (``kernels``, else ``attn_impl``), checked against the implementation's
    capabilities; ``auto`` takes the fastest fit the cost model measured (``calibrate``),
    else the first fit in registration order."""

    def __init__(self, cfg: AttnPolicyConfig, cost_model: Any) -> None:
        self._choice = {f: cfg.kernels.get(f, cfg.attn_impl or "sdpa") for f in FAMILIES}
        self._compiled = cfg.backend != "none"
        self._measured: dict[str, dict[str, float]] = getattr(cost_model, "kernel_seconds", None) or {}

    def impl(self, call: Call, layout: BatchLayout, spec: TensorSpec) -> str:
        family = call.kind.value
        if call.kind is MaskMode.MASK:
            causal, context = layout.causal, layout.has_context
        else:
            causal, context = call.causal, call.kv_len > call.q_len
        gqa = spec.heads != spec.kv_heads

        def unfit(info: KernelInfo) -> str | None:
            return why_unfit(info, causal=causal, context=context, dtype=spec.dtype, gqa=gqa,
                             device=spec.device, compiled=self._compiled)

        choice = self._choice[family]
        if choice != "auto":
            why = unfit(get_kernel(family, choice))
            if why is not None:
                raise ConfigError(f"kernel {choice!r} cannot serve this {family} call ({layout.describe()}): "
                                  f"it does not support {why}")
            return choice
        measured = self._measured.get(family, {})
        fits = [info.name for info in impls_for(family) if unfit(info) is None]
        if not fits:
            raise ConfigError(f"no registered {family} kernel can serve this call ({layout.describe()}, "
                              f"{spec.dtype}, gqa={gqa}, device {spec.device})")
        return min(fits, key=lambda name: measured.get(name, float("inf")))


def _largest_bucket(cfg: AttnPolicyConfig, max_len: int) -> int:
    if cfg.buckets.kind == "exact":
        return max_len
    return cfg.buckets.sizes_up_to(max_len)[-1]


def example_inputs(call: Call, spec: TensorSpec) -> tuple[torch.Tensor, ...]:
    """Zero tensors of a call's static shapes and strides (heads-first views of packed
    token-major tensors, as ``graph_inputs`` makes them): what the graph is compiled for."""
    dtype = getattr(torch, spec.dtype)
    dev = torch.device(spec.device)
    q = torch.zeros(call.q_bucket, spec.heads, spec.head_dim, dtype=dtype, device=dev).transpose(0, 1)
    k, v = (torch.zeros(call.kv_bucket, spec.kv_heads, spec.head_dim, dtype=dtype, device=dev).transpose(0, 1)
            for _ in range(2))  # distinct objects: Dynamo guards on aliasing
    if call.kind is MaskMode.MASK:
        return q, k, v, torch.ones(call.q_bucket, call.kv_bucket, dtype=torch.bool, device=dev)
    if call.kind is MaskMode.VARLEN:
        return q, k, v, torch.tensor([call.q_bucket, call.kv_bucket], device=dev)
    return q, k, v
