"""Background compiles (``compile_mode="background"``): a miss is served by a larger
resident graph (pad-up) while its own graph compiles in a worker thread, and enters
the cache exactly ``switch_after`` batches after it was requested. The
:class:`Worker` (one thread) loads a graph from the store when it is there instead
of compiling it."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any, NamedTuple

from attnpolicy.core.modes import CallKind
from attnpolicy.dispatch.batch_plan import Planned, WarmCall
from attnpolicy.dispatch.graph_source import Builder, Fetched, GraphSource, count_violation, release
from attnpolicy.errors import GraphCompileError
from attnpolicy.graphs.compile import CompiledGraph
from attnpolicy.graphs.execute import GraphFn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec


class Background:
    """The worker, the pending compiles and the pad-up rule of one dispatcher.

    Batches are numbered from 1 as :meth:`fetch` sees them; a compile requested in
    batch ``n`` switches in at the start of batch ``n + switch_after``, waiting for
    the worker if it is not done (the wait stalls that batch), so decisions never
    depend on when a compile finishes."""

    def __init__(self, source: GraphSource, cost_model: Any = None) -> None:
        self.source = source
        self.config = source.config
        self.counters = source.counters
        self.worker = Worker(source)
        self._cost_model = cost_model
        self._pad_model: Any = None
        self.batch = 0
        self.pending: dict[GraphKey, _Pending] = {}
        self.seconds = 0.0  # compile seconds measured in the worker

    def fetch(self, calls: Planned, spec: TensorSpec) -> Fetched:
        """The graphs of one batch's ``calls`` (pinned): first every compile due now
        switches in, in request order; then each call is served (see :meth:`serve`)."""
        self._next_batch()
        out = [self.serve(call, key, spec) for call, key in calls]
        return out, (None,) * len(out)

    def touch(self, keys: list[GraphKey | None]) -> None:
        """The keys of a batch the host runs itself, counted as a batch (the compiles due
        switch in first), then requested as :meth:`GraphSource.touch
        <attnpolicy.dispatch.graph_source.GraphSource.touch>` does: a miss enters the cache
        deferred; nothing is compiled in the worker."""
        self._next_batch()
        self.source.touch(keys)

    def _next_batch(self) -> None:
        """Start the next batch: every compile due now switches in, in request order."""
        self.batch += 1
        if self.pending:
            for key, pending in list(self.pending.items()):
                if pending.due <= self.batch:
                    self._switch_in(key, pending)

    def serve(self, call: Call, key: GraphKey, spec: TensorSpec) -> tuple[Call, GraphFn]:
        """The call and graph that run ``call``: the exact graph when built; else a
        larger built one (pad-up) while the exact one compiles in the background;
        else the exact one, compiled now (a stall). A deferred key is not built: it is
        served as a miss, its graph built into its deferred entry."""
        source = self.source
        if not call.compiled or source.cache.has_graph(key):
            return call, source.graph(call, key, spec, pin=True)[0]
        pending = self.pending.get(key)
        larger = self._pad_up(call, key)
        if larger is not None:
            if pending is None:
                # after warm-up: a stored graph loads in the worker (no compile), any other is a violation
                after = source.warm and self.config.strict != "off"
                held = after and source.holds(key)
                if after and not held:
                    source.strict(key)
                self._request(call, key, spec, held)
            big = dataclasses.replace(call, q_bucket=larger.q_len, kv_bucket=larger.kv_len)
            graph = source.graph(big, larger, spec, pin=True)[0]
            c = self.counters
            c.pad_up_calls += 1
            c.pad_up_tokens += big.q_bucket - call.q_bucket
            c.padded_tokens += big.q_bucket - call.q_bucket
            return big, graph
        if pending is not None and not self._switch_in(key, pending):
            return call, source.uncompiled(call, spec, key.impl)  # failed, on_compile_error="eager"
        return call, source.graph(call, key, spec, pin=True)[0]

    def settled(self, calls: Iterable[WarmCall]) -> Iterator[WarmCall]:
        """``calls`` (a warm-up's), each key pending in the worker switched in first (its
        future waited for): warm-up reuses a pending compile instead of building it twice."""
        for item in calls:
            key = item[1]
            pending = self.pending.get(key)
            if pending is not None:
                self._switch_in(key, pending)
            yield item

    def _pad_up(self, call: Call, key: GraphKey) -> GraphKey | None:
        """The resident graph ``call`` may pad up to: of ``key``'s call kind,
        causality, spec, impl, partition, backend) with buckets at least ``call``'s, the
        one the cost model runs fastest (ties: the smaller buckets), when its extra run
        seconds over ``switch_after`` calls are less than compiling ``key``. A pure
        function of the cache contents, the config and the cost model. FlexAttention
        graphs, MASK graphs whose mask would exceed ``max_mask_bytes`` and deferred
        entries (no graph built) never serve."""
        if key.impl == "flex":
            return None
        best: tuple[float, int, int] | None = None
        found: GraphKey | None = None
        model = self._model()
        cache = self.source.cache
        resident = cache.keys()  # a snapshot (the cache is not iterable)
        for other in resident:
            if (not isinstance(other, GraphKey) or other.kind is not key.kind or other.causal != key.causal
                    or other.q_len < key.q_len or other.kv_len < key.kv_len or other.spec != key.spec
                    or other.impl != key.impl or other.partition_len != key.partition_len
                    or other.backend != key.backend or other == key or not cache.has_graph(other)):
                continue
            if key.kind is CallKind.MASK and other.q_len * other.kv_len > self.config.max_mask_bytes:
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

    def _request(self, call: Call, key: GraphKey, spec: TensorSpec, held: bool = False) -> None:
        """Start compiling ``key`` in the worker; it switches in ``switch_after`` batches.
        ``held``: requested after warm-up as a load from the store (see :meth:`serve`)."""
        future = self.worker.submit(call, key, spec)
        self.pending[key] = _Pending(future, self.batch + self.config.switch_after, held)
        self.counters.background_requested += 1

    def _switch_in(self, key: GraphKey, pending: _Pending) -> bool:
        """Insert ``key``'s background graph into the cache, waiting for it if needed
        (the wait stalls this batch). A failed compile follows ``on_compile_error``:
        raises, or returns False (counted)."""
        del self.pending[key]
        source, c = self.source, self.counters
        start = perf_counter()
        error = pending.future.exception()  # blocks until the worker is done with it
        source.stall += perf_counter() - start
        if error is not None:
            c.background_failed += 1
            count_violation(c, error)
            try:
                failed(source, key, error)
            except GraphCompileError:
                if self.config.on_compile_error == "raise":
                    raise
                c.compile_error_fallbacks += 1
                return False
        built = pending.future.result()
        if built.loaded:
            c.background_loaded += 1
        else:
            self.seconds += built.seconds
        if pending.held:  # requested after warm-up as a load
            if built.loaded:
                source.loaded_after_warm_up(key)
            else:  # the stored artifact was not valid: the worker compiled it
                source.strict(key, done=True)
        c.background_switched += 1
        insert(source, key, built)
        return True

    def close(self) -> None:
        """Stop the worker (waiting for the compile it runs) and drop the pending
        compiles: those not started are cancelled, those that ran are released and
        counted in ``background_discarded`` (built, never switched in)."""
        self.worker.close()
        for key, pending in self.pending.items():
            if discard(key, pending.future):
                self.counters.background_discarded += 1
        self.pending.clear()


class Built(NamedTuple):
    """What the worker made of a key: the graph, its measured seconds, and whether it
    was loaded from the store (else compiled)."""

    graph: Any
    seconds: float
    loaded: bool


class Worker:
    """One dispatcher's compile thread (started at the first :meth:`submit`): builds
    one graph at a time with the source's builder, first trying the source's store
    for a stored key (the same load a synchronous miss does)."""

    def __init__(self, source: GraphSource) -> None:
        self.source = source
        self.builder: Builder = source.custom_builder or source.build
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, call: Call, key: GraphKey, spec: TensorSpec) -> Future[Built]:
        """Start building ``key`` (queued behind the builds before it)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnpolicy-compile")
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        return self._executor.submit(_timed, self.source, self.builder, call, key, spec)

    def close(self) -> None:
        """Stop the thread, waiting for the build it runs; queued builds are cancelled."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def insert(source: GraphSource, key: GraphKey, built: Built) -> None:
    """Put a graph the worker built into the source's cache, counted as a load or a
    compile with the worker's seconds (released if the key was cached meanwhile)."""
    value = built.graph
    if isinstance(value, CompiledGraph) and not value.direct:
        source.counters.direct_call_fallbacks += 1
    try:
        kept = source.cache.get_or_compile(key, lambda: value, seconds=built.seconds,
                                           load=(lambda: value) if built.loaded else None)
    except BaseException:
        _release_any(key, value)
        raise
    if kept is not value:  # cached meanwhile by another user of a shared cache
        _release_any(key, value)


def failed(source: GraphSource, key: GraphKey, error: BaseException) -> None:
    """Count the worker's failed build of ``key`` in the source's cache, as a miss whose
    build failed there (``compile_failures``): raises the cache's
    :class:`GraphCompileError`; returns only when ``key`` was cached meanwhile."""
    def fail() -> Any:
        raise error
    source.cache.get_or_compile(key, fail, seconds=0.0)


def discard(key: GraphKey, future: Future[Built]) -> bool:
    """Drop a build never inserted: cancelled if not started, else waited for and
    released. Returns whether it ran (built or failed)."""
    if future.cancel():
        return False
    if future.exception() is None:
        _release_any(key, future.result().graph)
    return True


class _Pending:
    """A background compile: its future ``(graph, seconds)``, the batch it switches at,
    and whether it was requested after warm-up as a load from the store."""

    __slots__ = ("due", "future", "held")

    def __init__(self, future: Future[Built], due: int, held: bool = False) -> None:
        self.future = future
        self.due = due
        self.held = held


def _timed(source: GraphSource, builder: Builder, call: Call, key: GraphKey, spec: TensorSpec) -> Built:
    """Load or build in the worker. A ``BaseException`` that is no ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) raised there is no
    request to stop the process (signals reach the main thread only): it becomes a
    compile error of its key, met where its graph is inserted."""
    start = perf_counter()
    try:
        loaded = source.load(key) if source.stored(key) else None
        if loaded is not None:
            return Built(loaded, perf_counter() - start, True)
        graph = builder(call, key, spec)
    except Exception:
        raise
    except BaseException as exc:
        raise RuntimeError(f"the builder raised {type(exc).__name__} in the background worker: {exc}") from exc
    return Built(graph, perf_counter() - start, False)


def _release_any(key: GraphKey, graph: Any) -> None:
    if isinstance(graph, CompiledGraph | FlexGraph):
        release(key, graph)
