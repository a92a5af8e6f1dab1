"""The Dispatcher: layout → policy (guarded) → plan → cached graphs → Step → output."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from cachetools import LRUCache

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.dispatch.background import Background
from attnpolicy.dispatch.batch_plan import BatchPlanner
from attnpolicy.dispatch.call_graphs import Builder, CallFamily, CallRequest, CallSource, make_cache
from attnpolicy.dispatch.memo import memo
from attnpolicy.dispatch.stats import BlockMaskStats, Counters, DispatcherStats
from attnpolicy.dispatch.step import HostStep, Step, new_step
from attnpolicy.dispatch.switch import Switcher
from attnpolicy.dispatch.warm_set import WarmSet
from attnpolicy.errors import ConfigError, KernelError
from attnpolicy.graphs.execute import check_inputs, graph_sinks
from attnpolicy.graphs.kernel_choice import KernelChoice
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.kernels.flex import BlockMaskCache
from attnpolicy.kernels.mask_cache import MaskCache
from attnpolicy.plugins.compilers import own_count, resolve_compiler
from attnpolicy.plugins.observers import Observers
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard


class Dispatcher:
    """Runs attention the way ``config`` says, through a bounded graph cache.

    ``attend(q, k, v, layout)`` takes packed ``q[q_tokens, Hq, D]`` and
    ``k, v[kv_tokens, Hkv, D]`` (see :mod:`attnpolicy.core.layout`) and returns
    ``[q_tokens, Hq, D]`` (padding rows zero): it is ``prepare(layout, spec).run(q, k, v)``.
    Decisions and graph keys are a pure function of the layout, the config and the
    sequence of earlier calls, so tensor-parallel ranks replaying the same batches
    agree. Threads may share one: each call holds the dispatcher's lock, so one batch runs
    at a time (for attention in parallel, one dispatcher per thread, sharing a ``store_dir``);
    a batch a caller runs itself, from :meth:`prepare` to :meth:`release_batch`, is the
    caller's to keep to one thread.

    Everything it keeps is its own and bounded: graphs (``max_graphs``, ``max_bytes``),
    dense masks (``max_mask_bytes``), small mask tensors, and memos of plans, steps,
    keys and specs (:data:`~attnpolicy.dispatch.memo.MEMO_SIZE` each) and of buckets (one per
    length up to the largest bucket), all in
    :meth:`stats`; one float per batch that stalled. A batch's graphs are pinned from
    :meth:`prepare` until it has run (the end of :meth:`attend`, or the next
    :meth:`prepare`): evicting one then does not free it.

    ``cache`` replaces the graph cache built from the config; ``compile_counter(gm)``
    sees every backend compile (the ahead-of-time compiles of a ``store_dir`` too; the
    cache counts each build in ``compiles``, each load from the store in ``loads``), and
    ``stats().backend_compiles`` counts them; ``builder`` replaces compilation
    (simulation). The compiler is the one ``config.backend`` names
    (:mod:`~attnpolicy.plugins.compilers`): an unknown name raises :class:`ConfigError`
    here, before any work. ``planner``: plan with another dispatcher's
    planner and its memos (a sweep's dispatchers, which differ only in bounds, eviction
    or policy; see :class:`~attnpolicy.dispatch.batch_plan.BatchPlanner`): a config that would
    plan otherwise raises :class:`ConfigError` naming the field. ``host_varlen``: the
    host runs VARLEN batches on a kernel of its own (vLLM's paged kernel):
    :meth:`prepare` returns a :class:`~attnpolicy.dispatch.step.HostStep` for them,
    whose keys enter the graph cache deferred: a graph is built (or loaded) only when a
    batch that runs it is prepared. ``compile_mode="background"`` serves misses by
    pad-up while they compile in a worker (:mod:`~attnpolicy.dispatch.background`);
    :meth:`close` stops it. :meth:`switch_to` moves to a re-planned config without a
    stall (:mod:`~attnpolicy.dispatch.switch`).

    The policy is built here: an unknown policy or eviction name, or ``policy_options``
    the policy rejects, raise a clear error naming the field. Observer hooks are
    isolated; the exceptions they raised are counted in ``stats().observer_errors``.
    """

    def __init__(self, config: AttnPolicyConfig | None = None, *, cost_model: Any = None,
                 cache: GraphCache[Any] | None = None, compile_counter: Callable[[Any], None] | None = None,
                 builder: Builder | None = None, host_varlen: bool = False,
                 planner: BatchPlanner | None = None) -> None:
        self.config = cfg = config or AttnPolicyConfig()
        #: the compiler of the graphs (``None`` under a custom builder, which compiles nothing)
        self.compiler = None if builder is not None else resolve_compiler(cfg.backend)
        self.observers = observers = Observers(get_plugin_manager())
        self.guard = Guard.for_policy(cfg.policy, cfg.policy_options, on_illegal=cfg.on_illegal,
                                      fallback=MaskMode(cfg.fallback_mode), observers=observers)
        self.cache = cache if cache is not None else make_cache(cfg, cost_model, observers)
        self.counters = Counters()
        self.masks = MaskCache(cfg.max_mask_bytes)
        self.block_masks = BlockMaskCache()  # FlexAttention block masks per layout (bounded)
        kernels = KernelChoice(cfg.kernels, cfg.attn_impl or "sdpa", compiled=cfg.backend != "none",
                               measured=getattr(cost_model, "kernel_seconds", None))
        if planner is None:
            planner = BatchPlanner(cfg, kernels)
        elif (differs := planner.difference(cfg, kernels)) is not None:
            raise ConfigError(f"planner: a shared planner plans for another config ({differs} differs)")
        self.planner = planner
        self._own_compiles = None if self.compiler is None else own_count(self.compiler)
        family = CallFamily(cfg, self.block_masks, builder=builder, compile_counter=self.counters.backend_counter(
                                compile_counter), host_varlen=host_varlen, cost_model=cost_model)
        self.source = CallSource(self.cache, self.counters, family)
        self.background: Background[GraphKey, CallRequest] | None = (
            Background(self.source) if cfg.compile_mode == "background" else None)
        self.host_varlen = host_varlen
        self.warm_set = WarmSet(cfg, self.planner, self.cache, self.source, self.background)
        self.switcher = Switcher()
        self._cost_model = cost_model
        self._steps: LRUCache[tuple[BatchLayout, TensorSpec], Step] = memo()  # stateless policies' steps
        self._specs: LRUCache[tuple[object, ...], TensorSpec] = memo()  # by tensor properties
        self._contexts: LRUCache[TensorSpec, PolicyContext] = memo()  # the policy's, per spec
        self._decided: LRUCache[tuple[BatchLayout, TensorSpec, MaskMode], Step] = memo()  # other policies'
        self._last: Step | None = None  # the memoised step prepared last: the cheapest hit
        self._last_spec: tuple[tuple[object, ...], TensorSpec] | None = None
        self._batch: list[Step] = []  # the steps prepared since the last prepare without a decision
        self._lock = threading.RLock()  # held by every public call: one batch at a time

    # -- the front door -----------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
               scale: float | None = None, *, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for ``layout``, computed in the mode the (guarded) policy chose,
        under a sliding ``window``, a logit ``softcap`` and sink logits ``sinks[Hq]``
        if given (:mod:`attnpolicy.core.features`: they are part of the spec, so of
        every graph key). Every input is checked, or brought to the form its graphs were
        compiled for, before any work (see docs/reliability.md)."""
        check_inputs(q, k, v, layout, scale)
        if sinks is None:
            feats = PLAIN if window is None and softcap is None else Features(window, softcap)
        else:
            sinks = graph_sinks(sinks, q)
            feats = Features(window, softcap, True)
        with self._lock:
            step = self._prepare(layout, self._spec_of(q, k, scale, feats), None)
            try:
                return step.run(q, k, v, sinks, checked=True)
            finally:
                self.source.release()

    def prepare(self, layout: BatchLayout, spec: TensorSpec, decision: Decision | None = None) -> Step:
        """Decide, plan and fetch (or compile) the graphs of ``layout``: everything
        ``attend`` does except touching tensors, counted as one batch. The graphs stay
        pinned until :meth:`release_batch` or the next ``prepare``.

        ``decision``: plan ``layout`` in an already taken decision instead (e.g. a layer
        with another tensor spec in the same step): no policy is asked, and the graphs
        are pinned with those of the batch prepared before."""
        with self._lock:
            return self._prepare(layout, spec, decision)

    def _prepare(self, layout: BatchLayout, spec: TensorSpec, decision: Decision | None) -> Step:
        if decision is not None:
            step = self._step_of(layout, spec, decision)
            self._batch.append(step)
            return self._fetch(step)
        if self.source.pinned:
            self.source.release()
        if self.switcher.busy:  # a batch boundary: a built switch applies here
            self.switcher.boundary(self)
        last = self._last
        try:
            if last is not None and last.layout is layout and last.spec is spec:
                step = last
            else:
                step = self._last = self._steps[(layout, spec)]
        except KeyError:
            self.planner.check_lengths(layout)
            guard = self.guard
            fallbacks = guard.fallbacks
            decision = self.decide(layout, spec)
            if guard.stateless and guard.fallbacks == fallbacks:  # reusable: see Guard.stateless
                step = self._steps[(layout, spec)] = self._last = self._new_step(layout, spec, decision)
            else:  # asked every time: the step is reused while the answer is the same
                step = self._step_of(layout, spec, decision)
        else:
            self.guard.replay(layout, step.asked)
        batch = self._batch
        if len(batch) != 1 or batch[0] is not step:  # the steps before keep no graph
            for old in batch:
                if old is not step:
                    old.forget()
            self._batch = [step]
        return self._fetch(step)

    def release_batch(self) -> None:
        """Unpin the graphs of the batch last prepared (it has run)."""
        with self._lock:
            self.source.release()

    def _step_of(self, layout: BatchLayout, spec: TensorSpec, decision: Decision) -> Step:
        """The step of ``decision`` for ``layout``: the one kept for its mode, serving
        ``decision`` (a policy's reason may change from batch to batch), else a new one (kept)."""
        key = (layout, spec, decision.mode)
        step = self._decided.get(key)
        if step is None:
            step = self._decided[key] = self._new_step(layout, spec, decision)
        elif step.asked != decision:
            step.retake(decision)
        return step

    def _new_step(self, layout: BatchLayout, spec: TensorSpec, asked: Decision) -> Step:
        try:
            step = new_step(self.planner, layout, spec, asked, self.masks, host_varlen=self.host_varlen)
        except KernelError:  # a plugin kernel failed its probe when first chosen
            self.counters.kernel_violations += 1
            raise
        step.counters = self.counters
        return step

    def _fetch(self, step: Step) -> Step:
        """Fetch ``step``'s graphs (or request its keys, for a host step), then count it:
        a batch that raised is not counted."""
        source, spec = self.source, step.spec
        source.stall = 0.0
        try:
            if isinstance(step, HostStep):
                if self.background is not None:  # counted as a batch: the compiles due switch in first
                    self.background.next_batch()
                source.touch(step.keys)
            elif self.background is not None:
                step.use(*source.fetch_background(self.background, step.plan.calls, spec))
            else:
                fetched = source.fetch(step.plan.calls, step.plan.keys, spec, step.values)
                if fetched is not None:  # else every graph is the one the step holds
                    step.use(*fetched)
        except BaseException:
            source.release()
            raise
        if source.stall:
            source.end()
        self.counters.count(step)
        return step

    def _spec_of(self, q: torch.Tensor, k: torch.Tensor, scale: float | None,
                 features: Features = PLAIN) -> TensorSpec:
        """``TensorSpec.of(q, k, scale, features)``, reused per distinct tensor properties;
        the config's warm set is compiled the first time a spec is seen."""
        props = (q.dtype, q.shape[1], q.shape[2], k.shape[1], scale, q.device, features)
        last = self._last_spec
        if last is not None and last[0] == props:
            return last[1]
        try:
            spec: TensorSpec = self._specs[props]
            self._last_spec = (props, spec)
            return spec
        except KeyError:
            spec = TensorSpec.of(q, k, scale, features)
            if self.config.warmup and spec not in self.warm_set.warmed:
                self.warmup(spec)  # kept once warmed: a refused warm set is refused again
            self._specs[props] = spec
            self._last_spec = (props, spec)
            return spec

    # -- decisions ----------------------------------------------------------------------
    def decide(self, layout: BatchLayout, spec: TensorSpec) -> Decision:
        """The decision that runs for ``layout`` on tensors of ``spec`` (after the guard).
        A real decision: a stateful policy advances and ``attnpolicy_on_decision`` fires
        (``prepare`` calls it once per batch)."""
        with self._lock:
            return self.guard.decide(layout, self.context_for(spec))

    def preview(self, layout: BatchLayout, spec: TensorSpec) -> Decision:
        """The decision a batch of ``layout`` on tensors of ``spec`` would get now, with
        no side effect: no policy state advances, no hook fires, nothing is counted
        (:meth:`Guard.preview <attnpolicy.policies.guard.Guard.preview>`)."""
        with self._lock:
            return self.guard.preview(layout, self.context_for(spec))

    def context_for(self, spec: TensorSpec) -> PolicyContext:
        """The policy context of calls on tensors of ``spec`` (one kept per spec): its
        ``keys_for`` plans with the planner."""
        with self._lock:
            try:
                ctx: PolicyContext = self._contexts[spec]
                return ctx
            except KeyError:
                planner = self.planner

                def keys_for(layout: BatchLayout, mode: MaskMode) -> tuple[GraphKey, ...]:
                    return planner.keys_for(layout, mode, spec)

                ctx = self._contexts[spec] = PolicyContext(
                    config=self.config, spec=spec, is_cached=self.cache.__contains__, keys_for=keys_for,
                    cost_model=self._cost_model, derived=self.planner.derived)
                return ctx

    def graph_keys_for(self, layout: BatchLayout, spec: TensorSpec) -> tuple[GraphKey, ...]:
        """The graph keys a batch of ``layout`` would use now (from :meth:`preview`: no
        side effect, so any rank may call it any number of times)."""
        with self._lock:
            return self.context_for(spec).keys_for(layout, self.preview(layout, spec).mode)

    # -- warm-up and background compiles ------------------------------------------------
    def warmup(self, layouts: Iterable[BatchLayout] | TensorSpec,
               spec: TensorSpec | None = None) -> list[GraphKey]:
        """``warmup(spec)``: compile the config's warm set (``warmup``, e.g. from
        ``attnpolicy plan``) for tensors of ``spec``, once per spec.
        ``warmup(layouts, spec)``: that, and the graphs the policy would use for
        ``layouts`` (as :meth:`preview` decides them: no attention runs, no decision is
        counted), exactly the graphs preparing and running them would build: none for a
        step the host runs (``host_varlen``), whose keys enter the cache deferred. Either
        way any later compile then counts as a strict-mode violation (``strict``).
        Returns the keys warmed by this call. A warm set that cannot stay
        resident for ``spec`` raises :class:`ConfigError` before anything compiles.

        :meth:`attend` warms the config's warm set itself the first time it sees a
        spec; runtimes that call :meth:`prepare` call ``warmup(spec)`` at first use."""
        batches: Iterable[BatchLayout] = ()
        if isinstance(layouts, TensorSpec):
            spec = layouts
        elif spec is None:
            raise TypeError("warmup needs the tensor spec of the graphs: warmup(spec) or warmup(layouts, spec)")
        else:
            batches = layouts
        with self._lock:
            return self.warm_set.warm(batches, spec, self.preview)

    def switch_to(self, config: AttnPolicyConfig, specs: Iterable[TensorSpec] | None = None) -> tuple[GraphKey, ...]:
        """Switch to the re-planned ``config``, checked now, at the first batch once its warm set
        is built in the background for ``specs`` (default: those served); returns the keys being
        built. See :mod:`~attnpolicy.dispatch.switch`."""
        with self._lock:
            return self.switcher.request(self, config, specs)

    def finish_switch(self) -> bool:
        """Wait for the pending switch's graphs and apply it now, a batch boundary without a
        batch (the end of a replay; the graphs of the batch last prepared are released, as
        by the next :meth:`prepare`); returns whether one applied. See
        :mod:`~attnpolicy.dispatch.switch`."""
        with self._lock:
            if self.source.pinned:
                self.source.release()
            return self.switcher.finish(self)

    def adopt(self, config: AttnPolicyConfig, guard: Guard, planner: BatchPlanner, warm_set: WarmSet) -> None:
        """Serve ``config`` with ``guard`` (its fallback count carried over), ``planner`` and
        ``warm_set`` from the next batch on: the steps, plans and policy contexts of the old
        config go (what a switch calls once its graphs are cached)."""
        with self._lock:
            guard.fallbacks = self.guard.fallbacks  # the count stays the dispatcher's
            self.config = self.source.config = config
            self.guard, self.planner, self.warm_set = guard, planner, warm_set
            for step in self._batch:
                step.forget()
            self._batch, self._last = [], None
            self._steps.clear()
            self._decided.clear()
            self._contexts.clear()

    def served_specs(self) -> set[TensorSpec]:
        """The tensor specs warmed or attended so far (what a switch builds its warm set for)."""
        with self._lock:
            return {*self.warm_set.warmed, *self._specs.values()}

    @property
    def cost_model(self) -> Any:
        """The cost model given at construction (``None`` if none was)."""
        return self._cost_model

    def pending(self) -> tuple[tuple[GraphKey, int], ...]:
        """Background compiles not switched in yet: ``(key, batch it switches at)``, in request
        order (batches are numbered from 1 by :meth:`prepare`)."""
        with self._lock:
            return () if self.background is None else tuple((k, p.due) for k, p in self.background.pending.items())

    def close(self) -> None:
        """Stop the background worker (waiting for its compile), drop pending compiles;
        a new miss starts a new worker. Also on ``with Dispatcher(...)`` exit."""
        with self._lock:
            if self.background is not None:
                self.background.close()
            self.switcher.close(self)

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation --------------------------------------------------------------------
    @property
    def stall_seconds(self) -> float:
        """Wall seconds batches stalled on compiles so far (``stats().stalls.seconds``)."""
        return self.source.stall_seconds

    def stats(self) -> DispatcherStats:
        """Counters of this dispatcher, its graph cache and its masks (see docs/cache.md)."""
        with self._lock:
            return self._stats()

    def _stats(self) -> DispatcherStats:
        bg, blocks = self.background, self.block_masks
        return self.counters.snapshot(
            self.config, guard_fallbacks=self.guard.fallbacks, observer_errors=dict(self.observers.errors),
            plans=len(self.planner.plans), masks=self.masks.stats(),
            block_masks=BlockMaskStats.of(blocks),
            cache=self.cache.stats(), stalls=self.source.stalls,
            pending=len(bg.pending) if bg else 0, compile_seconds=bg.seconds if bg else 0.0,
            disk=None if self.source.store is None else self.source.store.stats(),
            switching=int(self.switcher.target is not None), compiler_compiles=self._compiler_compiles())

    def _compiler_compiles(self) -> int | None:
        """The compiles the compiler counted itself since this dispatcher was built (``None``
        where it counts none)."""
        before, compiler = self._own_compiles, self.compiler
        now = None if compiler is None or before is None else own_count(compiler)
        return None if now is None or before is None else now - before
