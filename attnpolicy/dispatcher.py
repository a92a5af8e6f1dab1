"""The Dispatcher: layout → policy (guarded) → planned calls → cached graphs → output."""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from operator import eq, itemgetter
from time import perf_counter
from typing import Any, cast

import cachetools
import torch

from attnpolicy.cache.graph_cache import CacheStats, GraphCache
from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, GraphFamily, MaskMode
from attnpolicy.errors import (
    BucketOverflowError,
    GraphCompileError,
    StrictModeError,
)
from attnpolicy.graphs.compile import CompiledGraph, compile_graph, release_graph
from attnpolicy.graphs.execute import GraphFn, check_inputs, execute, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.kernel_choice import KernelChoice
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.graphs.plan import plan_calls
from attnpolicy.kernels.flex import BlockMaskCache, build_block_mask, flex_graph
from attnpolicy.kernels.masks import MaskCache, MaskCacheStats
from attnpolicy.plugins.observers import Observers
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard

#: Planned (call, key) tuples remembered per (layout, mode, spec); also the bound of
#: the prepared-batch memo (cleared when full).
PLAN_CACHE_SIZE = 4096

Planned = tuple[tuple[Call, GraphKey], ...]
#: One sequence's VARLEN-mode plan: its graph key (``None`` when the call runs
#: uncompiled), a call of the same key and its query bucket.
SeqPlan = tuple[GraphKey | None, Call, int]
#: Builds the graph of a key: ``builder(call, key, spec) -> callable``. The default
#: compiles with ``torch.compile``; the simulator substitutes a cost-model stub.
Builder = Callable[[Call, GraphKey, TensorSpec], GraphFn]


@dataclass(frozen=True, slots=True)
class PaddingStats:
    """Real query tokens and the rows graphs padded on top of them."""

    real_tokens: int
    padded_tokens: int
    waste: float


@dataclass(frozen=True, slots=True)
class BlockMaskStats:
    """The FlexAttention block masks a dispatcher keeps (one per layout, bounded)."""

    entries: int
    bytes: int
    max_entries: int
    builds: int


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
    their switch point, ``failed`` there, ``pending`` now; ``compile_seconds`` measured
    in the worker; ``pad_up_calls`` ran on a larger resident bucket, adding
    ``pad_up_tokens`` query rows of padding (also in ``padding``)."""

    compile_mode: str
    switch_after: int
    requested: int
    switched: int
    failed: int
    pending: int
    compile_seconds: float
    pad_up_calls: int
    pad_up_tokens: int


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """A snapshot of a :class:`Dispatcher`: its counters, its graph cache's and its
    mask cache's (see docs/cache.md). ``to_json()`` gives the dict of the JSON outputs."""

    batches: int
    calls: int
    modes: dict[str, int]
    guard_fallbacks: int
    overflow: int
    mask_fallbacks: int
    compile_error_fallbacks: int
    strict_violations: int
    direct_call_fallbacks: int
    observer_errors: dict[str, int]
    padding: PaddingStats
    plans: int
    masks: MaskCacheStats
    block_masks: BlockMaskStats
    cache: CacheStats
    stalls: StallStats
    background: BackgroundStats

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Dispatcher:
    """Runs attention the way ``config`` says, through a bounded graph cache.

    ``attend(q, k, v, layout)`` takes packed ``q[q_tokens, Hq, D]`` and
    ``k, v[kv_tokens, Hkv, D]`` (see :mod:`attnpolicy.core.layout`) and returns
    ``[q_tokens, Hq, D]`` (padding rows zero). Decisions and graph keys are a pure
    function of the layout, the config and the sequence of earlier calls, so
    tensor-parallel ranks replaying the same batches agree. A Dispatcher is not
    thread-safe (its graph cache is): use one per thread, or lock around it.

    Everything it keeps is its own and bounded: graphs (``max_graphs``,
    ``max_bytes``), dense masks (``max_mask_bytes``), small mask tensors and plans
    (:data:`~attnpolicy.kernels.masks.SMALL_CACHE_SIZE`, :data:`PLAN_CACHE_SIZE`
    entries), all in :meth:`stats`; the hot path's memos of prepared batches, graph
    keys, tensor specs, bucket sizes and per-sequence VARLEN plans hold references to
    those (at most :data:`PLAN_CACHE_SIZE` entries each, cleared when full); the stall
    statistics keep one float per batch that stalled (at most one per compile).
    Everything goes with the dispatcher. The graphs a batch uses are pinned from
    :meth:`prepare` until the batch has run (the end of :meth:`attend`, or the next
    :meth:`prepare`): evicting one then does not free it, so it never compiles again
    behind the cache's back.

    ``cache`` replaces the graph cache built from the config; ``compile_counter(gm)``
    sees every backend compile; ``builder`` replaces compilation (simulation).

    ``compile_mode="background"`` serves a miss without compiling in the batch when
    it can: the call runs on the smallest resident graph of the same kind with larger
    buckets (pad-up) when the cost model says the padding until the switch costs less
    than the compile, while the exact graph compiles in a worker thread (one, owned
    by the dispatcher: :meth:`close` shuts it down). The graph enters the cache
    exactly ``switch_after`` batches after it was requested, waiting for the compile
    if it is not done (a stall): decisions never depend on when a compile finishes.
    See docs/cache.md.

    The policy is built once, here: an unknown policy or eviction name, or
    ``policy_options`` the policy rejects, raise a clear error naming the field.
    Observer hooks are isolated (see :mod:`attnpolicy.plugins.observers`); the
    exceptions they raised are counted in ``stats().observer_errors``.
    """

    def __init__(self, config: AttnPolicyConfig | None = None, *, cost_model: Any = None,
                 cache: GraphCache[Any] | None = None,
                 compile_counter: Callable[[Any], None] | None = None,
                 builder: Builder | None = None) -> None:
        self.config = cfg = config or AttnPolicyConfig()
        self.observers = observers = Observers(get_plugin_manager())
        self.guard = Guard.for_policy(cfg.policy, cfg.policy_options, on_illegal=cfg.on_illegal,
                                      fallback=MaskMode(cfg.fallback_mode), observers=observers)
        self.cache = cache if cache is not None else GraphCache.from_config(
            cfg, sizeof=graph_bytes, compile_cost=_modelled_cost(cfg, cost_model),
            on_compile=observers.on_compile, on_evict=observers.on_evict, release=_release)
        self._cost_model = cost_model
        self._compile_counter = compile_counter
        self._builder = builder or self._compile
        self._largest = _largest_bucket(cfg, cfg.max_seq_len)
        self._largest_batch = _largest_bucket(cfg, cfg.max_batch_tokens)
        self._plans: cachetools.LRUCache[Any, Any] = cachetools.LRUCache(PLAN_CACHE_SIZE)
        self._contexts: dict[TensorSpec, PolicyContext] = {}
        self.masks = MaskCache(cfg.max_mask_bytes)
        self._pinned: list[GraphKey] = []
        self._batches: dict[tuple[BatchLayout, TensorSpec], _Prepared] = {}
        self._specs: dict[tuple[Any, ...], TensorSpec] = {}
        self._keys: dict[tuple[Any, ...], GraphKey] = {}
        self._seq_plans: dict[tuple[bool, TensorSpec], dict[tuple[bool, int, int], SeqPlan]] = {}
        self._buckets: dict[int, int] = {}
        self._warm = False
        self._warmed: set[TensorSpec] = set()  # specs the config's warm set was compiled for
        self._modes: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._kernels = KernelChoice(cfg.kernels, cfg.attn_impl or "sdpa", compiled=cfg.backend != "none",
                                     measured=getattr(cost_model, "kernel_seconds", None))
        #: FlexAttention block masks per layout (bounded; see kernels/flex.py)
        self.block_masks = BlockMaskCache()
        # background compiles (compile_mode="background")
        self._background = cfg.compile_mode == "background"
        self._custom_builder = builder
        self._step = 0
        self._pending: dict[GraphKey, _Pending] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._stall = 0.0
        self._stalls: list[float] = []
        #: wall seconds batches stalled on compiles so far (``stats().stalls.seconds``)
        self.stall_seconds = 0.0
        self._background_seconds = 0.0
        self._pad_model: Any = None

    # -- the hot path ------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
               scale: float | None = None) -> torch.Tensor:
        """Attention for ``layout``, computed in the mode the (guarded) policy chose."""
        check_inputs(q, k, v, layout, scale)
        graphs = self.prepare_step(layout, self._spec_of(q, k, scale))[1]
        try:
            return execute(q, k, v, layout, graphs, self.masks)
        finally:
            self.release_batch()

    def prepare(self, layout: BatchLayout, spec: TensorSpec) -> list[tuple[Call, GraphFn]]:
        """Decide, plan and fetch (or compile) the graphs for ``layout``: everything
        ``attend`` does except touching tensors. One call per graph invocation. The
        graphs stay pinned until :meth:`release_batch` or the next ``prepare``."""
        return self.prepare_step(layout, spec)[1]

    def prepare_step(self, layout: BatchLayout, spec: TensorSpec, *,
                     runs_varlen: bool = False) -> tuple[Decision, list[tuple[Call, GraphFn]]]:
        """:meth:`prepare`, also returning the decision that runs: the policy's, or
        VARLEN when its MASK call's mask is over ``max_mask_bytes`` (``on_overflow='eager'``).

        ``runs_varlen``: the caller runs a VARLEN decision on a kernel of its own (vLLM's
        paged kernel). Such a step is decided, counted and its graph keys fetched from
        the cache (hits, misses, recency, evictions) exactly as without it, but from a
        plan remembered per sequence shape; no graph is returned (the list is empty),
        so none is pinned. Under ``compile_mode="background"`` it takes the full path
        (misses are served by pad-up and background compiles, which need the calls)."""
        if self._pinned:
            self.release_batch()
        batch = self._batches.get((layout, spec))
        if batch is not None:  # _prepared's hit, inlined: the hot path
            self.guard.replay(layout, batch.decision)
        elif runs_varlen and not self._background:
            decision, reusable = self._decided(layout, spec)
            if decision.mode is MaskMode.VARLEN:
                return decision, self._fetch_varlen(layout, spec)
            batch = self._new_batch(layout, spec, decision, reusable)
        else:
            batch = self._new_batch(layout, spec, *self._decided(layout, spec))
        return self._fetch(layout, batch, spec)

    def graphs_for(self, layout: BatchLayout, decision: Decision, spec: TensorSpec, *,
                   runs_varlen: bool = False) -> list[tuple[Call, GraphFn]]:
        """Plan ``layout`` in an already taken ``decision`` (e.g. a layer with another
        tensor spec in the same step) and fetch its graphs, pinned with the batch's;
        counted as one batch. ``runs_varlen`` as for :meth:`prepare_step`."""
        if runs_varlen and not self._background and decision.mode is MaskMode.VARLEN:
            return self._fetch_varlen(layout, spec)
        return self._fetch(layout, _Prepared(decision, *self._planned(layout, decision.mode, spec), layout),
                           spec)[1]

    def _fetch(self, layout: BatchLayout, batch: _Prepared,
               spec: TensorSpec) -> tuple[Decision, list[tuple[Call, GraphFn]]]:
        self._step += 1
        self._stall = 0.0
        try:
            if self._background:
                if self._pending:
                    self._switch()
                out = [self._serve(call, key, spec, layout) for call, key in batch.planned]
            else:
                planned, graph = batch.planned, self._graph
                i, out = 0, []
                if batch.keys:  # several compiled calls: their hits under one lock
                    graphs: list[Any] = []
                    i = self.cache.hit_many(batch.keys, pin=True, values=graphs)
                    self._pinned.extend(batch.keys[:i])
                    out = [(call, _runnable(g)) for (call, _), g in zip(planned, graphs)]
                out += [(call, graph(call, key, spec, layout, True)) for call, key in planned[i:]]
        except BaseException:
            self.release_batch()
            raise
        if self._stall:
            self._end_stall()
        # counted once every graph is at hand: a batch that raised is not counted
        self._modes[batch.mode_name] += 1
        c = self._counts
        if batch.ran is not batch.decision:
            c["mask_fallbacks"] += 1
        c["batches"] += 1
        c["calls"] += batch.calls
        c["real_tokens"] += layout.total_tokens
        c["padded_tokens"] += batch.padded_tokens
        return batch.ran, out

    def _fetch_varlen(self, layout: BatchLayout, spec: TensorSpec) -> list[tuple[Call, GraphFn]]:
        """``_fetch`` of ``layout``'s VARLEN plan for a caller that runs it on its own
        kernel: the same cache requests in the same order (hits under one lock, each
        miss through ``_graph``), the same counts; no graph is returned or pinned."""
        self._step += 1
        self._stall = 0.0
        plans = self._varlen_plans(layout, spec)
        keys = list(map(itemgetter(0), plans))
        cache, n, i = self.cache, len(keys), 0
        while (j := cache.hit_many(keys, i)) < n:
            # a miss, or a call over the largest bucket: the call plan_calls makes, as _fetch does
            call = dataclasses.replace(plans[j][1], q_start=layout.q_starts[j], q_len=layout.q_lens[j],
                                       kv_start=layout.kv_starts[j], kv_len=layout.kv_lens[j])
            self._graph(call, self._key_for(call, layout, spec), spec, layout)
            i = j + 1
        self._end_stall()
        self._modes[MaskMode.VARLEN.value] += 1
        c = self._counts
        c["batches"] += 1
        c["calls"] += n
        c["real_tokens"] += layout.total_tokens
        c["padded_tokens"] += sum(map(itemgetter(2), plans)) - layout.total_tokens
        return []

    def _end_stall(self) -> None:
        """Record the stall of the batch just fetched, if it stalled."""
        if self._stall:
            self._stalls.append(self._stall)
            self.stall_seconds += self._stall

    def release_batch(self) -> None:
        """Unpin the graphs of the batch last prepared (it has run)."""
        if self._pinned:
            pinned, self._pinned = self._pinned, []
            self.cache.unpin(pinned)

    # -- prepared batches: the per-layout memo of the hot path ---------------------------
    def _decided(self, layout: BatchLayout, spec: TensorSpec) -> tuple[Decision, bool]:
        """A fresh decision for ``layout`` (lengths checked first), and whether it may be
        reused: a stateless policy's, not overridden by the guard."""
        self._check_lengths(layout)
        fallbacks = self.guard.fallbacks
        decision = self.decide(layout, spec)
        return decision, self.guard.stateless and self.guard.fallbacks == fallbacks

    def _new_batch(self, layout: BatchLayout, spec: TensorSpec, decision: Decision, reusable: bool) -> _Prepared:
        """The plan of ``decision`` for ``layout``, remembered per (layout, spec) when
        ``reusable``: a stateless policy's decision (see :attr:`Guard.stateless`) is then
        reused (:meth:`prepare_step` replays it to the decision hook); any other policy
        is asked every time, as is a decision the guard overrode (its fallback is counted
        per batch). Graphs are not memoised: ``_graph`` fetches them from the cache for
        every call, so hits, recency, pins and evictions stay exact."""
        batch = _Prepared(decision, *self._planned(layout, decision.mode, spec), layout)
        if reusable:
            if len(self._batches) >= PLAN_CACHE_SIZE:
                self._batches.clear()
            self._batches[(layout, spec)] = batch
        return batch

    def _spec_of(self, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> TensorSpec:
        """``TensorSpec.of(q, k, scale)``, reused per distinct tensor properties."""
        key = (q.dtype, q.shape[1], q.shape[2], k.shape[1], scale, q.device)
        spec = self._specs.get(key)
        if spec is None:
            if len(self._specs) >= PLAN_CACHE_SIZE:
                self._specs.clear()
            spec = self._specs[key] = TensorSpec.of(q, k, scale)
            if self.config.warmup and spec not in self._warmed:
                self.warmup(spec)
        return spec

    def decide(self, layout: BatchLayout, spec: TensorSpec) -> Decision:
        """The decision that runs for ``layout`` on tensors of ``spec`` (after the guard).
        A real decision: a stateful policy advances and ``attnpolicy_on_decision`` fires
        (``prepare`` calls it once per batch)."""
        return self.guard.decide(layout, self.context_for(spec))

    def context_for(self, spec: TensorSpec) -> PolicyContext:
        """The policy context of calls on tensors of ``spec`` (one kept per spec)."""
        ctx = self._contexts.get(spec)
        if ctx is None:
            def keys_for(layout: BatchLayout, mode: MaskMode) -> tuple[GraphKey, ...]:
                if mode is MaskMode.VARLEN:  # the per-sequence plans: no call is built
                    return tuple(key for key, _, _ in self._varlen_plans(layout, spec) if key is not None)
                return tuple(key for call, key in self._planned(layout, mode, spec)[1] if call.compiled)

            ctx = self._contexts[spec] = PolicyContext(
                config=self.config, spec=spec, is_cached=self.cache.__contains__, keys_for=keys_for,
                cost_model=self._cost_model)
        return ctx

    # -- planning ----------------------------------------------------------------------
    def _overflow(self, n: int, largest: int, field: str) -> int:
        if self.config.on_overflow == "raise":
            raise BucketOverflowError(
                f"length {n} exceeds the largest bucket {largest} (buckets {self.config.buckets.describe()}, "
                f"{field}={getattr(self.config, field)}); set on_overflow='eager' to run it uncompiled")
        return n

    def _check_lengths(self, layout: BatchLayout) -> None:
        """One rule for every policy: a sequence (cached context included) longer than
        the largest bucket of ``max_seq_len`` is an overflow, refused under
        ``on_overflow='raise'`` whatever mode the policy picks."""
        if layout.max_kv_len > self._largest:
            self._overflow(layout.max_kv_len, self._largest, "max_seq_len")

    def _mask_fits(self, call: Call, layout: BatchLayout) -> bool:
        """Whether a MASK call's dense mask is within ``max_mask_bytes`` (raises under
        ``on_overflow='raise'`` when not: nothing is allocated)."""
        nbytes, limit = call.q_bucket * call.kv_bucket, self.config.max_mask_bytes
        if nbytes <= limit:
            return True
        if self.config.on_overflow == "raise":
            raise BucketOverflowError(
                f"the MASK call of {layout.describe()} needs a {call.q_bucket} x {call.kv_bucket} mask "
                f"({nbytes} bytes), more than max_mask_bytes={limit}; raise max_mask_bytes, or set "
                "on_overflow='eager' to run such batches in VARLEN mode")
        return False

    def _bucket(self, n: int) -> int:
        if n > self._largest:
            return self._overflow(n, self._largest, "max_seq_len")
        return self.config.bucket(n)

    def _batch_bucket(self, n: int) -> int:
        if n > self._largest_batch:
            return self._overflow(n, self._largest_batch, "max_batch_tokens")
        return self.config.batch_bucket(n)

    def _fits(self, call: Call) -> Call:
        """``call``, marked uncompiled when it is longer than its largest bucket (it runs
        uncompiled, on_overflow='eager')."""
        limit = self._largest_batch if call.family is GraphFamily.MASK else self._largest
        if max(call.q_bucket, call.kv_bucket) <= limit:
            return call
        return dataclasses.replace(call, compiled=False)

    def _planned(self, layout: BatchLayout, mode: MaskMode, spec: TensorSpec) -> tuple[MaskMode, Planned]:
        """The mode that runs (VARLEN for a MASK call over ``max_mask_bytes`` under
        ``on_overflow='eager'``) and its planned calls."""
        plan_key = (layout, mode, spec)
        hit = self._plans.get(plan_key)
        if hit is not None:
            return cast(tuple[MaskMode, Planned], hit)
        calls = plan_calls(layout, mode, self._bucket, self._batch_bucket)
        if mode is MaskMode.MASK and not self._mask_fits(calls[0], layout):
            mode = MaskMode.VARLEN
            calls = plan_calls(layout, mode, self._bucket, self._batch_bucket)
        planned = tuple((call, self._key_for(call, layout, spec)) for call in map(self._fits, calls))
        self._plans[plan_key] = (mode, planned)
        return mode, planned

    def _varlen_plans(self, layout: BatchLayout, spec: TensorSpec) -> list[SeqPlan]:
        """``layout``'s VARLEN plan, sequence by sequence: a VARLEN call depends only on
        its sequence's family (``q_len == kv_len``) and buckets, so plans are remembered
        per (family, q bucket, kv bucket) and bucket sizes per length (decode steps,
        whose layouts never repeat, build no call); bounded like the plans."""
        memo = self._seq_plans.get((layout.causal, spec))
        if memo is None:
            memo = self._seq_plans[(layout.causal, spec)] = {}
        buckets = self._buckets
        q_buckets = list(map(buckets.get, layout.q_lens))
        kv_buckets = list(map(buckets.get, layout.kv_lens))
        if None in q_buckets or None in kv_buckets:
            if len(buckets) >= PLAN_CACHE_SIZE:
                buckets.clear()
            q_buckets = [buckets.get(n) or buckets.setdefault(n, self._bucket(n)) for n in layout.q_lens]
            kv_buckets = [buckets.get(n) or buckets.setdefault(n, self._bucket(n)) for n in layout.kv_lens]
        shapes = cast(list[tuple[bool, int, int]],  # no None left in the buckets
                      list(zip(map(eq, layout.q_lens, layout.kv_lens), q_buckets, kv_buckets)))
        plans = list(map(memo.get, shapes))
        if None in plans:
            for i, shape in enumerate(shapes):
                if plans[i] is None:
                    if len(memo) >= PLAN_CACHE_SIZE:
                        memo.clear()
                    plans[i] = memo[shape] = self._seq_plan(layout.q_lens[i], layout.kv_lens[i], layout.causal, spec)
        return plans  # type: ignore[return-value]  # no None left

    def _seq_plan(self, q_len: int, kv_len: int, causal: bool, spec: TensorSpec) -> SeqPlan:
        one = BatchLayout.from_lens([q_len], [kv_len], causal=causal)
        (call,) = map(self._fits, plan_calls(one, MaskMode.VARLEN, self._bucket, self._batch_bucket))
        return (self._key_for(call, one, spec) if call.compiled else None), call, call.q_bucket

    def _key_for(self, call: Call, layout: BatchLayout, spec: TensorSpec) -> GraphKey:
        """The graph key of ``call``: one instance per distinct key, remembered per call
        shape (bounded like the plans), so that planning a new layout builds no key
        twice and cache lookups of equal keys succeed on identity."""
        if call.family is GraphFamily.MASK:
            causal, context = layout.causal, layout.has_context
        else:
            causal, context = call.causal, call.kv_len > call.q_len
        memo = (call.family, call.q_bucket, call.kv_bucket, causal, context, spec)
        key = self._keys.get(memo)
        if key is None:
            if len(self._keys) >= PLAN_CACHE_SIZE:
                self._keys.clear()
            cfg = self.config
            key = self._keys[memo] = GraphKey.for_call(call, spec, self._kernels.impl(call, layout, spec),
                                                       cfg.partition_len, cfg.backend)
        return key

    def preview(self, layout: BatchLayout, spec: TensorSpec) -> Decision:
        """The decision a batch of ``layout`` on tensors of ``spec`` would get now, with
        no side effect: no policy state advances, no hook fires, nothing is counted
        (:meth:`Guard.preview <attnpolicy.policies.guard.Guard.preview>`)."""
        return self.guard.preview(layout, self.context_for(spec))

    def graph_keys_for(self, layout: BatchLayout, spec: TensorSpec) -> tuple[GraphKey, ...]:
        """The graph keys a batch of ``layout`` would use now (from :meth:`preview`: no
        side effect, so any rank may call it any number of times)."""
        return self.context_for(spec).keys_for(layout, self.preview(layout, spec).mode)

    # -- graphs ------------------------------------------------------------------------
    def _uncompiled(self, call: Call, spec: TensorSpec, impl: str) -> GraphFn:
        if impl == "flex":
            return FlexGraph(flex_graph(spec.scale), self.block_masks)
        return graph_fn(call, impl, spec.scale, self.config.partition_len)

    def _graph(self, call: Call, key: GraphKey, spec: TensorSpec, layout: BatchLayout | None = None,
               pin: bool = False) -> GraphFn:
        if not call.compiled:  # longer than the largest bucket, on_overflow="eager"
            self._counts["overflow"] += 1
            return self._uncompiled(call, spec, key.impl)
        if self._warm and self.config.strict != "off" and key not in self.cache:
            self._strict(key)
        try:
            graph = self.cache.get_or_compile(key, partial(self._timed_build, call, key, spec), pin=pin)
        except GraphCompileError:
            if self.config.on_compile_error == "raise":
                raise
            self._counts["compile_error_fallbacks"] += 1
            return self._uncompiled(call, spec, key.impl)
        if pin:
            self._pinned.append(key)
        return _runnable(graph)

    def _timed_build(self, call: Call, key: GraphKey, spec: TensorSpec) -> Any:
        """A synchronous build: its wall seconds stall the batch being prepared."""
        start = perf_counter()
        try:
            return self._builder(call, key, spec)
        finally:
            self._stall += perf_counter() - start

    def _compile(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        graph = self._build(call, key, spec)
        if isinstance(graph, CompiledGraph) and not graph.direct:
            self._counts["direct_call_fallbacks"] += 1
        return graph

    def _build(self, call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph | FlexGraph:
        """Compile the graph of ``key`` (no dispatcher state touched: also runs in the
        background worker)."""
        if key.impl == "flex":
            ins = (*(t[None] for t in example_inputs(call, spec)[:3]),
                   build_block_mask(_ONE_ROW, call.q_bucket, call.kv_bucket, spec.device))
            graph = compile_graph(flex_graph(spec.scale), key.backend, counter=self._compile_counter,
                                  example_inputs=ins)
            return FlexGraph(graph, self.block_masks)  # flex graphs take a BlockMask: called through Dynamo
        fn = graph_fn(call, key.impl, spec.scale, self.config.partition_len)
        assert not isinstance(fn, FlexGraph)  # flex is compiled above
        return compile_graph(fn, key.backend, counter=self._compile_counter,
                             example_inputs=example_inputs(call, spec))

    # -- background compiles and pad-up --------------------------------------------------
    def _serve(self, call: Call, key: GraphKey, spec: TensorSpec,
               layout: BatchLayout) -> tuple[Call, GraphFn]:
        """The call and graph that run ``call`` under ``compile_mode="background"``: the
        exact graph when resident; else a larger resident one (pad-up) while the exact
        one compiles in the background; else the exact one, compiled now (a stall)."""
        if not call.compiled or key in self.cache:
            return call, self._graph(call, key, spec, layout, pin=True)
        pending = self._pending.get(key)
        larger = self._pad_up(call, key)
        if larger is not None:
            if pending is None:
                if self._warm and self.config.strict != "off":
                    self._strict(key)
                self._request(call, key, spec)
            big = dataclasses.replace(call, q_bucket=larger.q_len, kv_bucket=larger.kv_len)
            graph = self._graph(big, larger, spec, layout, pin=True)
            self._counts["pad_up_calls"] += 1
            self._counts["pad_up_tokens"] += big.q_bucket - call.q_bucket
            self._counts["padded_tokens"] += big.q_bucket - call.q_bucket
            return big, graph
        if pending is not None and not self._switch_in(key, pending):
            return call, self._uncompiled(call, spec, key.impl)  # failed, on_compile_error="eager"
        return call, self._graph(call, key, spec, layout, pin=True)

    def _pad_up(self, call: Call, key: GraphKey) -> GraphKey | None:
        """The resident graph ``call`` may pad up to: of ``key``'s kind (family,
        causality, spec, impl, partition, backend) with buckets at least ``call``'s, the
        one the cost model runs fastest (ties: the smaller buckets), when its extra run
        seconds over ``switch_after`` calls are less than compiling ``key``. A pure
        function of the cache contents, the config and the cost model. FlexAttention
        graphs and MASK graphs whose mask would exceed ``max_mask_bytes`` never serve."""
        if key.impl == "flex":
            return None
        best: tuple[float, int, int] | None = None
        found: GraphKey | None = None
        resident = self.cache.keys()  # a snapshot (the cache is not iterable)
        for other in resident:
            if (not isinstance(other, GraphKey) or other.family is not key.family or other.causal != key.causal
                    or other.q_len < key.q_len or other.kv_len < key.kv_len or other.spec != key.spec
                    or other.impl != key.impl or other.partition_len != key.partition_len
                    or other.backend != key.backend or other == key):
                continue
            if key.family is GraphFamily.MASK and other.q_len * other.kv_len > self.config.max_mask_bytes:
                continue
            rank = (self._model().run_seconds(other), other.q_len, other.kv_len)
            if best is None or rank < best:
                best, found = rank, other
        if found is None or best is None:
            return None
        model = self._model()
        extra = (best[0] - model.run_seconds(key)) * self.config.switch_after
        return found if extra < model.compile_seconds(key) else None

    def _model(self) -> Any:
        """The cost model of pad-up decisions: the dispatcher's, else the built-in one."""
        if self._pad_model is None:
            from attnpolicy.graphs.costmodel import CostModel

            self._pad_model = self._cost_model or CostModel.default()
        return self._pad_model

    def _request(self, call: Call, key: GraphKey, spec: TensorSpec) -> None:
        """Start compiling ``key`` in the worker; it switches in ``switch_after`` batches."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnpolicy-compile")
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        builder = self._custom_builder or self._build
        future = self._executor.submit(_timed, builder, call, key, spec)
        self._pending[key] = _Pending(future, self._step + self.config.switch_after)
        self._counts["background_requested"] += 1

    def _switch(self) -> None:
        """Switch in every background graph due at this batch, in request order."""
        step = self._step
        for key, pending in list(self._pending.items()):
            if pending.due <= step:
                self._switch_in(key, pending)

    def _switch_in(self, key: GraphKey, pending: _Pending) -> bool:
        """Insert ``key``'s background graph into the cache, waiting for it if needed
        (the wait stalls this batch). A failed compile follows ``on_compile_error``:
        raises, or returns False (counted)."""
        del self._pending[key]
        start = perf_counter()
        error = pending.future.exception()  # blocks until the worker is done with it
        self._stall += perf_counter() - start
        if error is not None:
            self._counts["background_failed"] += 1

            def fail() -> Any:
                raise error
            try:
                self.cache.get_or_compile(key, fail, seconds=0.0)
            except GraphCompileError:
                if self.config.on_compile_error == "raise":
                    raise
                self._counts["compile_error_fallbacks"] += 1
                return False
        value, seconds = pending.future.result()
        self._background_seconds += seconds
        self._counts["background_switched"] += 1
        if isinstance(value, CompiledGraph) and not value.direct:
            self._counts["direct_call_fallbacks"] += 1
        try:
            kept = self.cache.get_or_compile(key, lambda: value, seconds=seconds)
        except BaseException:
            _release_any(key, value)
            raise
        if kept is not value:  # cached meanwhile by another user of a shared cache
            _release_any(key, value)
        return True

    def close(self) -> None:
        """Stop the background worker (waiting for the compile it runs) and drop the
        pending compiles. The dispatcher keeps working, compiling synchronously until a
        new miss starts a new worker. Also on ``with Dispatcher(...)`` exit."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for key, pending in self._pending.items():
            f = pending.future
            if f.done() and not f.cancelled() and f.exception() is None:
                _release_any(key, f.result()[0])
        self._pending.clear()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pending(self) -> tuple[tuple[GraphKey, int], ...]:
        """Background compiles not switched in yet: ``(key, batch it switches at)``,
        in request order (batches are numbered from 1 by :meth:`prepare`)."""
        return tuple((key, p.due) for key, p in self._pending.items())

    def _strict(self, key: GraphKey) -> None:
        self._counts["strict_violations"] += 1
        message = f"graph {key} compiled after warm-up (strict={self.config.strict!r})"
        if self.config.strict == "raise":
            raise StrictModeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def warmup(self, layouts: Iterable[BatchLayout] | TensorSpec,
               spec: TensorSpec | None = None) -> list[GraphKey]:
        """``warmup(spec)``: compile the config's warm set (``warmup``, e.g. from
        ``attnpolicy plan``) for tensors of ``spec``, once per spec.
        ``warmup(layouts, spec)``: that, and the graphs the policy would use for
        ``layouts`` (as :meth:`preview` decides them: no attention runs, no decision is
        counted). Either way any later compile then counts as a strict-mode violation
        (``strict``). Returns the keys warmed by this call.

        :meth:`attend` warms the config's warm set itself the first time it sees a
        spec; runtimes that call :meth:`prepare` call ``warmup(spec)`` at first use."""
        batches: Iterable[BatchLayout] = ()
        if isinstance(layouts, TensorSpec):
            spec = layouts
        else:
            batches = layouts
        if spec is None:
            raise TypeError("warmup needs the tensor spec of the graphs: warmup(spec) or warmup(layouts, spec)")
        keys: dict[GraphKey, None] = {}
        warm, self._warm = self._warm, False  # the warm-up's own compiles are no violations
        try:
            if spec not in self._warmed:
                for shape in self.config.warmup:
                    call, layout = _warm_call(shape)
                    key = self._key_for(call, layout, spec)
                    self._graph(call, key, spec)
                    keys[key] = None
                self._warmed.add(spec)
            for layout in batches:
                self._check_lengths(layout)
                for call, key in self._planned(layout, self.preview(layout, spec).mode, spec)[1]:
                    self._graph(call, key, spec)  # with the same overflow and compile-error rules
                    if call.compiled:
                        keys[key] = None
        except BaseException:
            self._warm = warm
            raise
        self._warm = True
        return list(keys)

    # -- observation -------------------------------------------------------------------
    def stats(self) -> DispatcherStats:
        """Counters of this dispatcher, its graph cache and its masks (see docs/cache.md)."""
        c = self._counts
        real, padded = c["real_tokens"], c["padded_tokens"]
        return DispatcherStats(
            batches=c["batches"],
            calls=c["calls"],
            modes={m.value: self._modes[m.value] for m in MaskMode},
            guard_fallbacks=self.guard.fallbacks,
            overflow=c["overflow"],
            mask_fallbacks=c["mask_fallbacks"],
            compile_error_fallbacks=c["compile_error_fallbacks"],
            strict_violations=c["strict_violations"],
            direct_call_fallbacks=c["direct_call_fallbacks"],
            observer_errors=dict(self.observers.errors),
            padding=PaddingStats(real, padded, padded / real if real else 0.0),
            plans=len(self._plans),
            masks=self.masks.stats(),
            block_masks=BlockMaskStats(len(self.block_masks), self.block_masks.nbytes,
                                       self.block_masks.max_entries, self.block_masks.builds),
            cache=self.cache.stats(),
            stalls=_stall_stats(c["batches"], self._stalls),
            background=BackgroundStats(
                self.config.compile_mode, self.config.switch_after, c["background_requested"],
                c["background_switched"], c["background_failed"], len(self._pending),
                self._background_seconds, c["pad_up_calls"], c["pad_up_tokens"]),
        )


def _runnable(graph: Any) -> GraphFn:
    """What runs a cached graph: a compiled graph's backend callable (guard-free)."""
    return cast(GraphFn, graph.call if type(graph) is CompiledGraph else graph)


class _Prepared:
    """A batch's decision, the mode that runs (VARLEN for a MASK call over
    ``max_mask_bytes``) and its planned (call, key) pairs, with its per-batch counts.
    ``keys``: the calls' graph keys when there are several and all are compiled
    (fetched together), else empty."""

    __slots__ = ("calls", "decision", "keys", "mode", "mode_name", "padded_tokens", "planned", "ran")

    def __init__(self, decision: Decision, mode: MaskMode, planned: Planned, layout: BatchLayout) -> None:
        self.decision = decision
        self.mode = mode
        self.mode_name = mode.value  # the stats key (an Enum's value is a Python property)
        self.planned = planned
        self.calls = len(planned)
        several = len(planned) > 1 and all(call.compiled for call, _ in planned)
        self.keys = tuple(key for _, key in planned) if several else ()
        self.padded_tokens = sum(call.q_bucket for call, _ in planned) - layout.total_tokens
        self.ran = decision if mode is decision.mode else Decision(
            mode, f"{decision.reason}; its mask exceeds max_mask_bytes: ran {mode.value}")


class _Pending:
    """A background compile: its future ``(graph, seconds)`` and the batch it switches at."""

    __slots__ = ("due", "future")

    def __init__(self, future: Future[tuple[Any, float]], due: int) -> None:
        self.future = future
        self.due = due


def _timed(builder: Builder, call: Call, key: GraphKey, spec: TensorSpec) -> tuple[Any, float]:
    start = perf_counter()
    graph = builder(call, key, spec)
    return graph, perf_counter() - start


def percentile(values: list[float], total: int, p: float) -> float:
    """The nearest-rank ``p`` percentile of ``total`` values: ``values`` (sorted) and
    ``total - len(values)`` zeros."""
    if total <= 0:
        return 0.0
    rank = max(1, math.ceil(p * total))
    zeros = total - len(values)
    return 0.0 if rank <= zeros else values[rank - zeros - 1]


def _stall_stats(batches: int, stalls: list[float]) -> StallStats:
    ordered = sorted(stalls)
    return StallStats(batches, len(stalls), math.fsum(stalls), percentile(ordered, batches, 0.5),
                      percentile(ordered, batches, 0.99), ordered[-1] if ordered else 0.0)


def _release_any(key: GraphKey, graph: Any) -> None:
    if isinstance(graph, CompiledGraph | FlexGraph):
        _release(key, graph)


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


def _warm_call(shape: WarmShape) -> tuple[Call, BatchLayout]:
    """A call of a warm-up shape, and a one-sequence layout of its causality and
    context (what a MASK key and the kernel choice read from the layout)."""
    q, kv = shape.q_bucket, shape.kv_bucket
    q_len = q - 1 if shape.context and q == kv else q  # context: more keys than queries
    call = Call(shape.family, 0, q_len, 0, kv, q, kv, shape.causal)
    layout = BatchLayout.from_lens([1], [2] if shape.context else None, causal=shape.causal)
    return call, layout


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
    if call.family is GraphFamily.MASK:
        return q, k, v, torch.ones(call.q_bucket, call.kv_bucket, dtype=torch.bool, device=dev)
    if call.family is GraphFamily.VARLEN:
        return q, k, v, torch.tensor([call.q_bucket, call.kv_bucket], device=dev)
    return q, k, v
