"""Switching a running dispatcher to a new config (a re-plan) without a stall.

:meth:`Dispatcher.switch_to <attnpolicy.dispatch.dispatcher.Dispatcher.switch_to>`
checks the new config against the running one before any work: only the fields of
:data:`SWITCHABLE` may differ, under ``on_overflow="raise"`` its buckets must serve
every length the running ones serve (up to ``max_seq_len`` for a sequence,
``max_batch_tokens`` for a MASK call's rows, when its policy can run MASK: see
:attr:`~attnpolicy.policies.guard.Guard.modes`), its policy and eviction must resolve, and its warm
set must stay resident for every tensor spec the dispatcher serves (the checks of
start-up); each failure is a :class:`~attnpolicy.errors.ConfigError` naming the field
and value, and the dispatcher is left as it was. Then the new warm set's graphs not
cached yet (the *switch set*) are built on a worker thread of the switch's own (loaded
from the store when it holds them, as a background compile is), while the running
config keeps serving. The graphs a host runs on its own kernel (``host_varlen``: the
VARLEN ones) are no part of it: as at warm-up, their keys enter the cache deferred when
the switch applies (those cached stay as they are, deferred or built).

At the first batch boundary (the start of a ``prepare`` without a decision) at which
every graph of the switch set is built, the switch is applied at once, before that
batch is decided: the cache ranks victims by the new eviction strategy (the cached
graphs moved over in the old strategy's victim order), the built graphs enter it (room
made by evicting graphs outside the new warm set, the next victim first), and the new
policy, buckets and warm set serve from that batch on. The other graphs of the old
config stay cached until eviction takes them. A graph of the new warm set that was
cached at the request but has been evicted since is built too before the switch
applies. Whether the switch set is built is
checked without waiting: no batch waits on a switch's compile. The batch a switch
applies at depends on how fast its graphs build, so ranks that must take the same
decisions (tensor parallelism) should not switch this way.
:meth:`Dispatcher.finish_switch <attnpolicy.dispatch.dispatcher.Dispatcher.finish_switch>`
waits for the pending switch's builds and applies it at once (a replay's end: a run
does not end with its switch's outcome depending on how fast the builds ran).

A request while a switch is pending replaces it (the newer plan fits the more recent
traffic): builds both need are kept, the others are dropped and released once done;
a request for the running config only drops the pending switch. A graph of the switch
set that fails to build drops the switch (counted in ``failed``, logged); under
``on_compile_error="raise"`` the batch boundary that finds it raises the
:class:`~attnpolicy.errors.GraphCompileError`, the running config unchanged.

A switch sees its dispatcher as a :class:`SwitchOwner`: it reads the running config,
cache, graph source, counters and served specs, and installs what it built with one
call, :meth:`SwitchOwner.adopt` (which also drops the old config's steps).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, KeysView
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from attnpolicy.cache.eviction_registry import make_eviction
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.dispatch.background import Background, Built, Worker, discard
from attnpolicy.dispatch.batch_plan import BatchPlanner
from attnpolicy.dispatch.call_graphs import CallRequest, CallSource, eviction_of
from attnpolicy.dispatch.graph_source import count_violation
from attnpolicy.dispatch.stats import Counters
from attnpolicy.dispatch.warm_set import WarmSet
from attnpolicy.errors import ConfigError, GraphCompileError, PolicyError
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.plugins.observers import Observers
from attnpolicy.policies.guard import Guard

log = logging.getLogger("attnpolicy.dispatch")

#: The fields a switch may change; every other one must equal the running config's.
SWITCHABLE = ("policy", "policy_options", "buckets", "eviction", "warmup", "strict", "on_illegal", "fallback_mode")


class SwitchOwner(Protocol):
    """What a switch needs of the dispatcher it switches: what it reads to check and build
    the new config, and :meth:`adopt` to install it."""

    @property
    def config(self) -> AttnPolicyConfig: ...
    @property
    def guard(self) -> Guard: ...
    @property
    def planner(self) -> BatchPlanner: ...
    @property
    def cache(self) -> GraphCache[Any]: ...
    @property
    def source(self) -> CallSource: ...
    @property
    def background(self) -> Background[GraphKey, CallRequest] | None: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def observers(self) -> Observers: ...
    @property
    def cost_model(self) -> Any: ...

    def served_specs(self) -> set[TensorSpec]:
        """The tensor specs warmed or attended so far."""
        ...

    def preview(self, layout: BatchLayout, spec: TensorSpec) -> Decision:
        """The decision ``layout`` would get now, with no side effect."""
        ...

    def adopt(self, config: AttnPolicyConfig, guard: Guard, planner: BatchPlanner, warm_set: WarmSet) -> None:
        """Serve ``config`` with ``guard``, ``planner`` and ``warm_set`` from the next batch on."""
        ...


@dataclass
class _Target:
    """A pending switch: the new config with its guard, planner and warm sets, every
    key of its warm set (with a call and spec), and the builds of those not cached."""

    config: AttnPolicyConfig
    guard: Guard
    planner: BatchPlanner
    warm_set: WarmSet
    calls: dict[GraphKey, tuple[Call, TensorSpec]]
    builds: dict[GraphKey, Future[Built]]


class Switcher:
    """The pending switch of one dispatcher, its worker and the builds it dropped."""

    def __init__(self) -> None:
        self.target: _Target | None = None
        #: a switch is pending or dropped builds wait to be released: check at each batch
        self.busy = False
        self._worker: Worker[GraphKey, CallRequest] | None = None
        self._dropped: list[tuple[GraphKey, Future[Built]]] = []

    def request(self, d: SwitchOwner, config: AttnPolicyConfig,
                specs: Iterable[TensorSpec] | None = None) -> tuple[GraphKey, ...]:
        """Check ``config`` and start building its switch set (module docstring);
        returns the keys being built. ``specs``: the tensor specs to build the new warm
        set for (default: every spec the dispatcher has warmed or attended)."""
        if not isinstance(config, AttnPolicyConfig):
            raise ConfigError(f"switch_to: config must be an AttnPolicyConfig, got {type(config).__name__}")
        running = d.config
        for name in type(running).model_fields:
            new, old = getattr(config, name), getattr(running, name)
            if name not in SWITCHABLE and new != old:
                raise ConfigError(f"switch_to: {name}={new!r} differs from the running config's {old!r}; a switch "
                                  f"changes only {', '.join(SWITCHABLE)}")
        pending = self.target
        if pending is not None and config == pending.config:
            return tuple(pending.builds)
        if config == running:
            if pending is not None:
                self._drop(pending)
                d.counters.switch_replaced += 1
            return ()
        try:
            guard = Guard.for_policy(config.policy, config.policy_options, on_illegal=config.on_illegal,
                                     fallback=MaskMode(config.fallback_mode), observers=d.observers)
        except PolicyError as exc:
            raise ConfigError(f"switch_to: policy={config.policy!r} with policy_options="
                              f"{config.policy_options!r}: {exc}") from exc
        # a MASK call's packed rows bucket under max_batch_tokens: only a config that can run MASK needs them
        limits = ("max_seq_len", "max_batch_tokens") if MaskMode.MASK in guard.modes else ("max_seq_len",)
        for name in limits if running.on_overflow == "raise" else ():
            limit = getattr(running, name)
            old, new = running.buckets.largest(limit), config.buckets.largest(limit)
            if new < old:
                raise ConfigError(f"switch_to: buckets={config.buckets.describe()} serve lengths up to {new} of "
                                  f"{name} {limit}, the running config's {running.buckets.describe()} up to {old}: "
                                  "batches that run now would overflow (on_overflow='raise')")
        try:
            make_eviction(config.eviction)
        except ConfigError as exc:
            raise ConfigError(f"switch_to: eviction={config.eviction!r}: {exc}") from exc
        served = sorted(set(specs) if specs is not None else d.served_specs(), key=repr)
        if config.warmup and not served:
            raise ConfigError(f"switch_to: warmup holds {len(config.warmup)} graphs but the dispatcher has served "
                              "no tensor spec yet: pass specs=[...] to build them for")
        planner = BatchPlanner(config, d.planner.kernels)
        warm_set = WarmSet(config, planner, d.cache, d.source, d.background)
        calls: dict[GraphKey, tuple[Call, TensorSpec]] = {}
        for spec in served:
            warm_set.keys.update(warm_set.resident(spec))  # refused before anything builds
            for call, key, _, _ in planner.warm_calls((), spec, d.preview, warm_set.warmed):
                calls.setdefault(key, (call, spec))
        # checked: from here on nothing raises
        builds: dict[GraphKey, Future[Built]] = {}
        if pending is not None:
            for key, future in pending.builds.items():
                if key in calls:
                    builds[key] = future
                else:
                    self._dropped.append((key, future))
            d.counters.switch_replaced += 1
        for key, (call, spec) in calls.items():
            if key not in builds and key not in d.cache and not d.source.host_runs(call, key):
                builds[key] = self.worker(d).submit(key, (call, spec))
        self.target = _Target(config, guard, planner, warm_set, calls, builds)
        self.busy = True
        d.counters.switch_requested += 1
        return tuple(builds)

    @property
    def config(self) -> AttnPolicyConfig | None:
        """The config of the pending switch (``None``: none pending)."""
        return None if self.target is None else self.target.config

    def worker(self, d: SwitchOwner) -> Worker[GraphKey, CallRequest]:
        if self._worker is None:
            self._worker = Worker(d.source)
        return self._worker

    def boundary(self, d: SwitchOwner) -> None:
        """At the start of a batch: apply the pending switch if its switch set is built,
        else count the batch as served during the switch; release dropped builds done."""
        if self._dropped:
            done = [(key, f) for key, f in self._dropped if f.done()]
            for key, future in done:
                _settle(d, key, future)
            self._dropped = [item for item in self._dropped if item not in done]
        target = self.target
        if target is None:
            self.busy = bool(self._dropped)
            return
        if all(f.done() for f in target.builds.values()) and self._ready(d, target):
            self._apply(d, target)
        elif self.target is target:  # not dropped by a failed build
            d.counters.switch_batches += 1

    def finish(self, d: SwitchOwner) -> bool:
        """Wait for the pending switch's builds and apply it now, as the next batch
        boundary would (the end of a replay, whose figures must not depend on how fast
        the builds ran); returns whether a switch applied. A failed build drops it as
        at a boundary (raising under ``on_compile_error="raise"``)."""
        target = self.target
        while target is not None and self.target is target:
            if self._ready(d, target):
                self._apply(d, target)
                return True
        return False

    def _ready(self, d: SwitchOwner, target: _Target) -> bool:
        """Whether ``target``'s switch set is built (waiting for its builds): a failed
        build drops the switch; a warm graph cached at the request and evicted since is
        submitted, to be built too before the switch applies."""
        for key, future in target.builds.items():
            error = future.exception()
            if error is not None:
                self._failed(d, target, key, error)
                return False
        evicted = [(key, (call, spec)) for key, (call, spec) in target.calls.items()
                   if key not in target.builds and key not in d.cache and not d.source.host_runs(call, key)]
        for key, (call, spec) in evicted:
            target.builds[key] = self.worker(d).submit(key, (call, spec))
        return not evicted

    def _apply(self, d: SwitchOwner, target: _Target) -> None:
        self.target, self.busy = None, bool(self._dropped)
        cache, config, c = d.cache, target.config, d.counters
        old = d.config
        cache.reorder(config.eviction, *eviction_of(config, d.cost_model))
        keep = target.calls.keys()
        built_here = loaded = 0
        for key, future in target.builds.items():
            if key in cache:  # compiled meanwhile by the running config
                _settle(d, key, future)
                continue
            built = future.result()
            _make_room(cache, key, keep)
            d.source.insert(key, built.graph, built.seconds, built.loaded)
            built_here += 1
            loaded += built.loaded
        deferred = 0
        for key, (call, _) in target.calls.items():  # the host's graphs: entered deferred, as at warm-up
            if key not in cache and d.source.host_runs(call, key):
                _make_room(cache, key, keep)
                cache.reserve(key)
                deferred += 1
        c.switch_loaded += loaded
        c.switch_compiled += built_here - loaded
        d.adopt(config, target.guard, target.planner, target.warm_set)
        c.switches += 1
        host = f", {deferred} left to the host's own kernel" if deferred else ""
        log.info("attnpolicy: switched from policy %s, buckets %s, eviction %s to policy %s, buckets %s, eviction "
                 "%s (%d warm graphs; %d compiled and %d loaded from the store in the background%s)",
                 old.policy, old.buckets.describe(), old.eviction, config.policy, config.buckets.describe(),
                 config.eviction, len(target.calls), built_here - loaded, loaded, host)

    def _failed(self, d: SwitchOwner, target: _Target, key: GraphKey, error: BaseException) -> None:
        """Drop the switch whose graph ``key`` failed to build (see the module docstring);
        the failure is counted in the cache's ``compile_failures``."""
        _settle(d, key, target.builds.pop(key))
        self._drop(target)
        c = d.counters
        c.switch_failed += 1
        count_violation(c, error)
        log.warning("attnpolicy: the switch to policy %s, buckets %s was dropped: building its graph %s failed: "
                    "%s: %s", target.config.policy, target.config.buckets.describe(), key, type(error).__name__,
                    error)
        if d.config.on_compile_error == "raise":
            raise GraphCompileError(f"switch_to: building the graph {key} of the switch set failed: "
                                    f"{type(error).__name__}: {error}") from error

    def _drop(self, target: _Target) -> None:
        self._dropped.extend(target.builds.items())
        self.target = None
        self.busy = bool(self._dropped)

    def close(self, d: SwitchOwner) -> None:
        """Stop the worker (waiting for its build), drop the pending switch and release
        every build not inserted (counted)."""
        if self._worker is not None:
            self._worker.close()
        if self.target is not None:
            self._drop(self.target)
        for key, future in self._dropped:
            _settle(d, key, future)
        self._dropped, self.busy = [], False


def _settle(d: SwitchOwner, key: GraphKey, future: Future[Built]) -> None:
    """Release a build of the switch worker that never enters the cache, counted once: a
    compile in ``switch.discarded``, a failure in the cache's ``compile_failures`` (in
    ``switch.discarded`` when the running config has cached ``key`` meanwhile); a build
    cancelled before it ran, or a load, compiled nothing."""
    if future.cancel():
        return
    error = future.exception()  # waits for a build in flight
    if error is not None:
        try:
            d.source.failed(key, error)
        except GraphCompileError:
            return
        d.counters.switch_discarded += 1
        return
    if not future.result().loaded:
        d.counters.switch_discarded += 1
    discard(d.source, key, future)


def _make_room(cache: GraphCache[Any], key: GraphKey, keep: KeysView[GraphKey]) -> None:
    """Evict graphs outside ``keep``, in ``cache.keys()`` order, until ``key``'s graph
    fits without the cache evicting one of ``keep``."""
    limit, count = cache.max_bytes, cache.max_graphs
    held = cache.stats().bytes if limit is not None else 0
    need = cache.size_of(key)
    for victim in [k for k in cache.keys() if k not in keep]:  # noqa: SIM118 (a snapshot, not a dict's keys)
        if (count is None or len(cache) < count) and (limit is None or held + need <= limit):
            return
        held -= cache.size_of(victim)
        cache.evict(victim)
