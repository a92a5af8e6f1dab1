"""The plan of one batch: in one call, the mode that runs, its calls, their graph
keys and buckets, with overflows and the MASK→VARLEN fallback applied.

:class:`BatchPlanner` owns everything a batch plan reads (the config's buckets and limits,
the kernel choice) and its memos; it never calls back into the dispatcher. The
calls come from :func:`~attnpolicy.graphs.calls.plan_calls`, the causality and
context of a key from :func:`~attnpolicy.graphs.kernel_choice.call_traits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator
from operator import eq
from typing import Any

from cachetools import LRUCache

from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, Decision, MaskMode
from attnpolicy.dispatch.memo import memo
from attnpolicy.errors import BucketOverflowError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.kernel_choice import KernelChoice, call_traits
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec

Planned = tuple[tuple[Call, GraphKey], ...]
#: One sequence's VARLEN-mode plan: its graph key (``None`` when the call runs
#: uncompiled) and its query bucket.
SeqPlan = tuple[GraphKey | None, int]
#: One call of a warm-up: its call and key, whether the key is listed (returned), and
#: the mode its layout's plan runs (``None``: a call of the config's warm set).
WarmCall = tuple[Call, GraphKey, bool, MaskMode | None]


class BatchPlan:
    """A batch's plan in one mode: ``mode`` (the one that runs: VARLEN for a MASK call
    whose mask is over ``max_mask_bytes``), its (call, key) pairs, ``keys`` (every
    call's key when all are compiled, else empty: fetched together), its number of
    graph invocations and the query rows its buckets pad."""

    __slots__ = ("calls", "keys", "mode", "n_calls", "padded_tokens")

    def __init__(self, mode: MaskMode, calls: Planned, keys: tuple[GraphKey, ...], n_calls: int,
                 padded_tokens: int) -> None:
        self.mode = mode
        self.calls = calls
        self.keys = keys
        self.n_calls = n_calls
        self.padded_tokens = padded_tokens

    @classmethod
    def of(cls, mode: MaskMode, calls: Planned, layout: BatchLayout) -> BatchPlan:
        keys = tuple(key for _, key in calls) if all(call.compiled for call, _ in calls) else ()
        return cls(mode, calls, keys, len(calls),
                   sum(call.rows * call.q_bucket for call, _ in calls) - layout.total_tokens)

    @classmethod
    def of_seqs(cls, seqs: list[SeqPlan], layout: BatchLayout) -> BatchPlan:
        """A VARLEN plan from its per-sequence plans, for a host that runs it (no calls)."""
        return cls(MaskMode.VARLEN, (), (), len(seqs), sum(q for _, q in seqs) - layout.total_tokens)


#: The config fields a batch plan reads: dispatchers whose configs agree on them (and on
#: the kernel choice) may share one :class:`BatchPlanner`.
BATCH_PLAN_FIELDS = ("buckets", "max_seq_len", "max_batch_tokens", "on_overflow", "max_mask_bytes", "partition_len",
                   "backend", "attn_impl", "kernels", "warmup", "row_buckets")


class BatchPlanner:
    """Plans batches for one config: ``plan(layout, mode, spec)`` is the whole plan,
    remembered per (layout, mode, spec); :meth:`seq_plans` plans VARLEN sequence by
    sequence for layouts that never repeat (decode steps).

    A plan never reads a graph cache, so dispatchers whose configs differ only outside
    :data:`BATCH_PLAN_FIELDS` (bounds, eviction, policy: a sweep's) may share one planner
    and its memos (:meth:`difference`), one thread at a time. ``derived`` is kept with it
    for policies: what a policy derives from plans and a cost model alone (never from
    a cache), shared by those dispatchers (see :class:`~attnpolicy.policies.base.PolicyContext`)."""

    def __init__(self, config: AttnPolicyConfig, kernels: KernelChoice) -> None:
        self.config = config
        self.kernels = kernels
        self.largest = config.buckets.largest(config.max_seq_len)
        self.largest_batch = config.buckets.largest(config.max_batch_tokens)
        self.plans: LRUCache[tuple[BatchLayout, MaskMode, TensorSpec], BatchPlan] = memo()
        #: call shape -> GraphKey: one instance per distinct key
        self._keys: LRUCache[tuple[object, ...], GraphKey] = memo()
        #: (causal, spec, own keys, q bucket, kv bucket) -> SeqPlan
        self._seqs: LRUCache[tuple[object, ...], SeqPlan] = memo()
        #: length -> bucket, for lengths up to the largest bucket (so at most that many)
        self._buckets: dict[int, int] = {}
        self.derived: dict[Hashable, Any] = {}

    def difference(self, config: AttnPolicyConfig, kernels: KernelChoice) -> str | None:
        """``None`` when a dispatcher of ``config`` choosing kernels by ``kernels`` plans
        exactly as this planner does, else the first field that differs, as
        ``name=value`` (``kernels`` for the kernel choice)."""
        for name in BATCH_PLAN_FIELDS:
            if getattr(config, name) != getattr(self.config, name):
                return f"{name}={getattr(config, name)!r}"
        return None if kernels.rules == self.kernels.rules else "kernels"

    def plan(self, layout: BatchLayout, mode: MaskMode, spec: TensorSpec) -> BatchPlan:
        """The plan of ``layout`` in ``mode`` on tensors of ``spec`` (raises
        :class:`BucketOverflowError` under ``on_overflow='raise'`` for a length over
        the largest bucket or a mask over ``max_mask_bytes``)."""
        plan_key = (layout, mode, spec)
        try:
            hit: BatchPlan = self.plans[plan_key]
            return hit
        except KeyError:
            pass
        cfg = self.config
        calls = plan_calls(layout, mode, self._length_bucket, self._batch_bucket, cfg.rows_bucket, cfg.row_buckets[-1])
        if mode is MaskMode.MASK and not self._mask_fits(calls[0], layout):
            mode = MaskMode.VARLEN
            calls = plan_calls(layout, mode, self._length_bucket, self._batch_bucket)
        planned = tuple((call, self.key_for(call, layout, spec)) for call in map(self._fits, calls))
        plan = self.plans[plan_key] = BatchPlan.of(mode, planned, layout)
        return plan

    def keys_for(self, layout: BatchLayout, mode: MaskMode, spec: TensorSpec) -> tuple[GraphKey, ...]:
        """The graph keys of ``layout``'s compiled calls in ``mode`` (VARLEN: from the
        per-sequence plans, building no call)."""
        if mode is MaskMode.VARLEN:
            return tuple(key for key, _ in self.seq_plans(layout, spec) if key is not None)
        return tuple(key for call, key in self.plan(layout, mode, spec).calls if call.compiled)

    def seq_plans(self, layout: BatchLayout, spec: TensorSpec) -> list[SeqPlan]:
        """``layout``'s VARLEN plan, sequence by sequence: a VARLEN call depends only on
        its sequence's kind (``q_len == kv_len``) and buckets, so plans are remembered
        per (kind, q bucket, kv bucket) and buckets per length."""
        buckets = self._buckets
        try:
            q_buckets = [buckets[n] for n in layout.q_lens]
            kv_buckets = [buckets[n] for n in layout.kv_lens]
        except KeyError:
            q_buckets, kv_buckets = list(map(self._length_bucket, layout.q_lens)), list(
                map(self._length_bucket, layout.kv_lens))
        seqs, causal, plans = self._seqs, layout.causal, []
        for i, shape in enumerate(zip(map(eq, layout.q_lens, layout.kv_lens), q_buckets, kv_buckets)):
            seq_key = (causal, spec, *shape)
            try:
                plans.append(seqs[seq_key])
            except KeyError:
                plan = seqs[seq_key] = self._seq_plan(layout.q_lens[i], layout.kv_lens[i], causal, spec)
                plans.append(plan)
        return plans

    def key_for(self, call: Call, layout: BatchLayout, spec: TensorSpec) -> GraphKey:
        """The graph key of ``call``: one instance per distinct key, remembered per call
        shape, so that planning a new layout builds no key twice and cache lookups of
        equal keys succeed on identity."""
        shape = (call.kind, call.q_bucket, call.kv_bucket, *call_traits(call, layout), spec, call.rows)
        try:
            key: GraphKey = self._keys[shape]
            return key
        except KeyError:
            cfg = self.config
            key = self._keys[shape] = GraphKey.for_call(call, spec, self.kernels.impl(call, layout, spec),
                                                        cfg.partition_len, cfg.backend)
            return key

    def warm_calls(self, layouts: Iterable[BatchLayout], spec: TensorSpec,
                   decide: Callable[[BatchLayout, TensorSpec], Decision],
                   warmed: set[TensorSpec]) -> Iterator[WarmCall]:
        """The calls of a warm-up, one at a time (see :data:`WarmCall`): the config's
        warm set unless ``spec`` is in ``warmed`` (the caller's specs warmed so far, which
        it joins once its warm set is given), then the plan of each layout in the mode
        ``decide`` (a preview, which reads the cache as it fills) gives it."""
        if spec not in warmed:
            for shape in self.config.warmup:
                call, layout = warm_call(shape)
                yield call, self.key_for(call, layout, spec), True, None
            warmed.add(spec)
        for layout in layouts:
            self.check_lengths(layout)
            plan = self.plan(layout, decide(layout, spec).mode, spec)
            for call, key in plan.calls:
                yield call, key, call.compiled, plan.mode  # with the same overflow and compile-error rules

    def check_lengths(self, layout: BatchLayout) -> None:
        """One rule for every policy: a sequence (cached context included) longer than
        the largest bucket of ``max_seq_len`` is an overflow, refused under
        ``on_overflow='raise'`` whatever mode the policy picks."""
        if layout.max_kv_len > self.largest:
            self._overflow(layout.max_kv_len, self.largest, "max_seq_len")

    # -- buckets and limits -------------------------------------------------------------
    def _overflow(self, n: int, largest: int, field: str) -> int:
        if self.config.on_overflow == "raise":
            raise BucketOverflowError(
                f"length {n} exceeds the largest bucket {largest} (buckets {self.config.buckets.describe()}, "
                f"{field}={getattr(self.config, field)}); set on_overflow='eager' to run it uncompiled")
        return n

    def _bucket(self, n: int) -> int:
        if n > self.largest:
            return self._overflow(n, self.largest, "max_seq_len")
        return self.config.bucket(n)

    def _length_bucket(self, n: int) -> int:
        try:
            return self._buckets[n]
        except KeyError:
            bucket = self._bucket(n)
            if n <= self.largest:  # longer ones overflow: not kept, so the memo stays bounded
                self._buckets[n] = bucket
            return bucket

    def _batch_bucket(self, n: int) -> int:
        if n > self.largest_batch:
            return self._overflow(n, self.largest_batch, "max_batch_tokens")
        return self.config.batch_bucket(n)

    def _mask_fits(self, call: Call, layout: BatchLayout) -> bool:
        """Whether a MASK call's dense mask is within ``max_mask_bytes`` (raises under
        ``on_overflow='raise'`` when not: nothing is allocated)."""
        limit = self.config.max_mask_bytes
        if not plan_rules.mask_over(call.q_bucket, call.kv_bucket, limit):
            return True
        if self.config.on_overflow == "raise":
            raise BucketOverflowError(
                f"the MASK call of {layout.describe()} needs a {call.q_bucket} x {call.kv_bucket} mask "
                f"({call.q_bucket * call.kv_bucket} bytes), more than max_mask_bytes={limit}; raise "
                "max_mask_bytes, or set on_overflow='eager' to run such batches in VARLEN mode")
        return False

    def _fits(self, call: Call) -> Call:
        """``call``, marked uncompiled when it is longer than its largest bucket (it runs
        uncompiled, on_overflow='eager')."""
        limit = self.largest_batch if call.kind is CallKind.MASK else self.largest
        if not plan_rules.uncompiled(call.q_bucket, call.kv_bucket, limit):
            return call
        return dataclasses.replace(call, compiled=False)

    def _seq_plan(self, q_len: int, kv_len: int, causal: bool, spec: TensorSpec) -> SeqPlan:
        one = BatchLayout.from_lens([q_len], [kv_len], causal=causal)
        (call,) = map(self._fits, plan_calls(one, MaskMode.VARLEN, self._bucket, self._batch_bucket))
        return (self.key_for(call, one, spec) if call.compiled else None), call.q_bucket


def warm_call(shape: WarmShape) -> tuple[Call, BatchLayout]:
    """A call of a warm-up shape, and a one-sequence layout of its causality and
    context (what a MASK key and the kernel choice read from the layout)."""
    q, kv = shape.q_bucket, shape.kv_bucket
    q_len = q - 1 if shape.context and q == kv else q  # context: more keys than queries
    call = Call(shape.kind, 0, q_len, 0, kv, q, kv, shape.causal, rows=shape.rows, context=shape.context)
    layout = BatchLayout.from_lens([1], [2] if shape.context else None, causal=shape.causal)
    return call, layout
