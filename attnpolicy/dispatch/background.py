"""Background compiles (``compile_mode="background"``) of any graph family: a miss is
served by a larger resident graph (the family's pad-up) or, for a family that
:attr:`~attnpolicy.dispatch.family.GraphFamily.eager_misses`, uncompiled, while its own
graph compiles in a worker thread; it enters the cache exactly ``switch_after`` batches
after it was requested. The :class:`Worker` (one thread) loads a graph from the store
when it is there instead of compiling it."""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Any, Generic, NamedTuple

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.dispatch.family import K, R
from attnpolicy.dispatch.graph_source import GraphSource, count_violation
from attnpolicy.dispatch.stats import BackgroundStats
from attnpolicy.errors import GraphCompileError

#: The worker thread's name prefix of the attention-call runtime.
COMPILE_THREAD = "attnpolicy-compile"


class Background(Generic[K, R]):
    """The worker, the pending compiles and the pad-up of one runtime's source.

    Batches are numbered from 1 as :meth:`next_batch` starts them; a compile requested
    in batch ``n`` switches in at the start of batch ``n + switch_after``, waiting for
    the worker if it is not done (the wait stalls that batch), so decisions never
    depend on when a compile finishes."""

    def __init__(self, source: GraphSource[K, R], *, thread_name: str = COMPILE_THREAD) -> None:
        self.source = source
        self.counters = source.counters
        self.worker: Worker[K, R] = Worker(source, thread_name)
        self.batch = 0
        self.pending: dict[K, _Pending] = {}
        self.seconds = 0.0  # compile seconds measured in the worker (of those switched in)
        self.waited = 0.0  # seconds batches waited for the worker at switch points

    @property
    def config(self) -> AttnPolicyConfig:
        return self.source.config

    def next_batch(self) -> None:
        """Start the next batch: every compile due now switches in, in request order."""
        self.batch += 1
        if self.pending:
            for key, pending in list(self.pending.items()):
                if pending.due <= self.batch:
                    self.switch_in(key, pending)

    def serve(self, key: K, request: R) -> K | None:
        """The key whose graph serves a miss of ``key`` (its graph not built) now: a larger
        resident one (pad-up) while ``key``'s compiles in the background; else, for a
        family that runs misses eagerly, ``None`` (run uncompiled) while it compiles;
        else ``key`` itself, to compile now (its pending compile switched in first:
        ``None`` when that failed under ``on_compile_error="eager"``)."""
        source, family, c = self.source, self.source.family, self.counters
        pending = self.pending.get(key)
        larger = self._pad_up(key)
        if larger is None and not family.eager_misses:
            if pending is not None and not self.switch_in(key, pending):
                return None
            return key
        if pending is None:
            # after warm-up: a stored graph loads in the worker (no compile), any other is a violation
            after = source.warm and self.config.strict != "off"
            held = after and source.holds(key)
            if after and not held:
                source.strict(key)
            self._request(key, request, held)
        if larger is None:
            c.background_eager += 1
            return None
        rows = family.rows(larger) - family.rows(key)
        c.pad_up_calls += 1
        c.pad_up_tokens += rows
        c.padded_tokens += rows
        return larger

    def route(self, key: K, request: R) -> K | None:
        """The key whose graph runs a batch's ``key`` now: ``key`` itself when its graph is
        built, else :meth:`serve`'s (a larger resident key: the batch is placed in it
        padded up; ``None``: it runs uncompiled)."""
        return key if self.source.cache.has_graph(key) else self.serve(key, request)

    def settle(self, key: K) -> None:
        """Switch ``key`` in now if it is pending (its future waited for): a warm-up reuses
        a pending compile instead of building it twice."""
        pending = self.pending.get(key)
        if pending is not None:
            self.switch_in(key, pending)

    def _pad_up(self, key: K) -> K | None:
        """The family's pad-up of ``key`` among the resident keys whose graphs are built
        (deferred entries, no graph built, never serve)."""
        cache = self.source.cache
        resident = [k for k in cache.keys() if k != key and cache.has_graph(k)]  # noqa: SIM118 (a snapshot)
        return self.source.family.pad_up(key, resident)  # type: ignore[arg-type]

    def _request(self, key: K, request: R, held: bool = False) -> None:
        """Start compiling ``key`` in the worker; it switches in ``switch_after`` batches.
        ``held``: requested after warm-up as a load from the store (see :meth:`serve`)."""
        future = self.worker.submit(key, request)
        self.pending[key] = _Pending(future, self.batch + self.config.switch_after, held)
        self.counters.background_requested += 1

    def switch_in(self, key: K, pending: _Pending) -> bool:
        """Insert ``key``'s background graph into the cache, waiting for it if needed
        (the wait stalls this batch). A failed compile follows ``on_compile_error``:
        raises, or returns False (counted)."""
        del self.pending[key]
        source, c = self.source, self.counters
        start = perf_counter()
        error = pending.future.exception()  # blocks until the worker is done with it
        waited = perf_counter() - start
        source.stall += waited
        self.waited += waited
        if error is not None:
            c.background_failed += 1
            count_violation(c, error)
            try:
                source.failed(key, error)
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
        source.insert(key, built.graph, built.seconds, built.loaded)
        return True

    def stats(self) -> BackgroundStats:
        """The background compiles, as every runtime reports them."""
        return self.counters.background(self.config, len(self.pending), self.seconds)

    def close(self) -> None:
        """Stop the worker (waiting for the compile it runs) and drop the pending
        compiles: those not started are cancelled, those that ran are released and
        counted in ``background_discarded`` (built, never switched in)."""
        self.worker.close()
        for key, pending in self.pending.items():
            if discard(self.source, key, pending.future):
                self.counters.background_discarded += 1
        self.pending.clear()


class Built(NamedTuple):
    """What the worker made of a key: the graph, its measured seconds, and whether it
    was loaded from the store (else compiled)."""

    graph: Any
    seconds: float
    loaded: bool


class Worker(Generic[K, R]):
    """One runtime's compile thread (started at the first :meth:`submit`, named
    ``thread_name``): builds one graph at a time with the source's builder, first trying
    the source's store for a stored key (the same load a synchronous miss does)."""

    def __init__(self, source: GraphSource[K, R], thread_name: str = COMPILE_THREAD) -> None:
        self.source = source
        self.thread_name = thread_name
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, key: K, request: R) -> Future[Built]:
        """Start building ``key`` (queued behind the builds before it)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.thread_name)
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        return self._executor.submit(_timed, self.source, key, request)

    def close(self) -> None:
        """Stop the thread, waiting for the build it runs; queued builds are cancelled."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def discard(source: GraphSource[Any, Any], key: Hashable, future: Future[Built]) -> bool:
    """Drop a build never inserted: cancelled if not started, else waited for and
    released. Returns whether it ran (built or failed)."""
    if future.cancel():
        return False
    if future.exception() is None:
        source.family.release(key, future.result().graph)
    return True


class _Pending:
    """A background compile: its future, the batch it switches at, and whether it was
    requested after warm-up as a load from the store."""

    __slots__ = ("due", "future", "held")

    def __init__(self, future: Future[Built], due: int, held: bool = False) -> None:
        self.future = future
        self.due = due
        self.held = held


def _timed(source: GraphSource[K, R], key: K, request: R) -> Built:
    """Load or build in the worker. A ``BaseException`` that is no ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) raised there is no
    request to stop the process (signals reach the main thread only): it becomes a
    compile error of its key, met where its graph is inserted."""
    start = perf_counter()
    try:
        loaded = source.load(key) if source.stored(key) else None
        if loaded is not None:
            return Built(loaded, perf_counter() - start, True)
        graph = source.builder(key, request)
    except Exception:
        raise
    except BaseException as exc:
        raise RuntimeError(f"the builder raised {type(exc).__name__} in the background worker: {exc}") from exc
    return Built(graph, perf_counter() - start, False)
