"""Background compiles of whole-model graphs (``compile_mode="background"``).

A miss of a :class:`~attnpolicy.engine.runner.StaticModelRunner` (seen here
as a :class:`Runner`) does not block: its graph compiles in one worker thread while the batch runs on a resident graph
of the same mode with larger buckets (pad-up: a larger token bucket for ``CAUSAL`` and
``MASK``; for ``VARLEN`` a segment tuple of as many segments that dominates the key's
element-wise), else on the eager model. The worker loads a graph the runner's store
holds instead of compiling it. As in the attention-level dispatcher, a compile
requested in batch ``n`` enters the cache at the start of batch ``n + switch_after``,
waiting for the worker if it is not done (that wait is counted as stall), so what serves
a batch never depends on when a compile finishes."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Generic, Protocol, TypeVar

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import GraphCompileError
from attnpolicy.graphs.compile import CompiledGraph, release_graph


class RunnerKey(Hashable, Protocol):
    """A whole-model graph's key: its mode, padded rows, (VARLEN) segments and backend."""

    @property
    def mode(self) -> MaskMode: ...
    @property
    def tokens(self) -> int: ...
    @property
    def segments(self) -> tuple[int, ...]: ...
    @property
    def backend(self) -> str: ...


K = TypeVar("K", bound=RunnerKey)
K_co = TypeVar("K_co", bound=RunnerKey, covariant=True)
K_contra = TypeVar("K_contra", bound=RunnerKey, contravariant=True)


class RunnerBatch(Protocol[K_co]):
    """A batch placed in its graph: the graph's key and inputs."""

    @property
    def key(self) -> K_co: ...
    @property
    def inputs(self) -> tuple[Any, ...]: ...


B = TypeVar("B", bound=RunnerBatch[Any])


class Runner(Protocol[K_contra]):
    """What the background needs of its runner: the config, the graph cache, whether
    warm-up is over, and the runner's loads, builds, eager forward and strict-mode checks."""

    @property
    def config(self) -> AttnPolicyConfig: ...
    @property
    def cache(self) -> GraphCache[CompiledGraph]: ...
    @property
    def warm(self) -> bool: ...

    def holds(self, key: K_contra) -> bool:
        """Whether the runner's store holds ``key``'s graph."""
        ...

    def load(self, key: K_contra) -> CompiledGraph | None:
        """``key``'s graph from the store, else ``None`` (safe in the worker)."""
        ...

    def build(self, key: K_contra, inputs: tuple[Any, ...]) -> CompiledGraph:
        """Compile ``key``'s graph for ``inputs`` (safe in the worker)."""
        ...

    def forward(self, key: K_contra) -> Callable[..., Any]:
        """The eager forward of a batch of ``key``."""
        ...

    def strict(self, key: K_contra, *, done: bool = False) -> None:
        """Apply strict mode to a compile of ``key`` after warm-up."""
        ...

    def loaded_after_warm_up(self, key: K_contra) -> None:
        """Count ``key``'s graph loaded from the store after warm-up."""
        ...


@dataclass(frozen=True, slots=True)
class ModelBackgroundStats:
    """Background compiles requested, switched in and failed; batches served padded up
    to a larger graph and served eagerly; seconds the worker compiled and batches waited;
    of those switched in, the graphs the worker ``loaded`` from the store."""

    requested: int = 0
    switched: int = 0
    failed: int = 0
    padded_up: int = 0
    eager_served: int = 0
    compile_seconds: float = 0.0
    stall_seconds: float = 0.0
    loaded: int = 0


def dominates(other: RunnerKey, key: RunnerKey) -> bool:
    """Whether ``other``'s graph can serve ``key``'s batch: same mode and backend, at
    least as many rows (``VARLEN``: as many segments, each at least as long)."""
    if other.mode is not key.mode or other.backend != key.backend or other == key:
        return False
    if key.mode is MaskMode.VARLEN:
        return len(other.segments) == len(key.segments) and all(
            a >= b for a, b in zip(other.segments, key.segments))
    return other.tokens >= key.tokens


class ModelBackground(Generic[K]):
    """The worker and pending compiles of one runner (batches numbered by :meth:`tick`)."""

    def __init__(self, runner: Runner[K]) -> None:
        self.runner = runner
        self.batch = 0
        #: key -> (its build: graph, seconds, loaded; the batch it switches at; requested
        #: after warm-up as a load from the store)
        self.pending: dict[K, tuple[Future[tuple[CompiledGraph, float, bool]], int, bool]] = {}
        self._counts = dict.fromkeys(("requested", "switched", "failed", "padded_up", "eager_served", "loaded"), 0)
        self._seconds = self._stall = 0.0
        self._executor: ThreadPoolExecutor | None = None

    def tick(self) -> None:
        """Start a batch: every compile due now switches in, in request order."""
        self.batch += 1
        for key, (_, due, _) in list(self.pending.items()):
            if due <= self.batch:
                self._switch_in(key)

    def serve(self, batch: B, place: Callable[[K], B]) -> tuple[B, Callable[..., Any]]:
        """The placed batch and the callable that run a miss of ``batch.key`` now:
        the smallest dominating resident graph (pinned), else the eager forward; the
        exact graph is requested from the worker unless pending."""
        runner, key = self.runner, batch.key
        if key not in self.pending:
            # after warm-up: a stored graph loads in the worker (no compile), any other is a violation
            after = runner.warm and runner.config.strict != "off"
            held = after and runner.holds(key)
            if after and not held:
                runner.strict(key)
            self._request(batch, held)
        resident = runner.cache.keys()  # a snapshot (the cache is not iterable)
        larger = [k for k in resident if isinstance(k, type(key)) and dominates(k, key)]
        if larger:
            big = min(larger, key=lambda k: (k.tokens, k.segments))
            placed = place(big)
            self._counts["padded_up"] += 1
            return placed, runner.cache.get_or_compile(big, _absent, pin=True)
        self._counts["eager_served"] += 1
        return batch, runner.forward(key)

    def _request(self, batch: RunnerBatch[K], held: bool) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnpolicy-model-compile")
            weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
        future = self._executor.submit(_timed, self.runner, batch.key, batch.inputs)
        self.pending[batch.key] = (future, self.batch + self.runner.config.switch_after, held)
        self._counts["requested"] += 1

    def _switch_in(self, key: K) -> None:
        """Insert ``key``'s graph into the cache, waiting for the worker; a failed compile
        raises (``on_compile_error="raise"``) or is counted and requested again at the
        next miss."""
        future, _, held = self.pending.pop(key)
        start = perf_counter()
        error = future.exception()
        self._stall += perf_counter() - start
        cache = self.runner.cache
        if error is not None:
            self._counts["failed"] += 1

            def fail() -> Any:
                raise error
            try:
                cache.get_or_compile(key, fail, seconds=0.0)
            except GraphCompileError:
                if self.runner.config.on_compile_error == "raise":
                    raise
            return
        graph, seconds, loaded = future.result()
        if loaded:
            self._counts["loaded"] += 1
        else:
            self._seconds += seconds
        self._counts["switched"] += 1
        if held:  # requested after warm-up as a load
            if loaded:
                self.runner.loaded_after_warm_up(key)
            else:  # the stored artifact was not valid: the worker compiled it
                self.runner.strict(key, done=True)
        if cache.get_or_compile(key, lambda: graph, seconds=seconds,
                                load=(lambda: graph) if loaded else None) is not graph:
            release_graph(graph)

    def stats(self) -> ModelBackgroundStats:
        return ModelBackgroundStats(**self._counts, compile_seconds=self._seconds, stall_seconds=self._stall)

    def close(self) -> None:
        """Stop the worker (waiting for its compile) and drop the pending compiles."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for future, _, _ in self.pending.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                release_graph(future.result()[0])
        self.pending.clear()


def _absent() -> CompiledGraph:
    raise AssertionError("a resident graph left the cache between its lookup and its use")


def _timed(runner: Runner[K], key: K, inputs: tuple[Any, ...]) -> tuple[CompiledGraph, float, bool]:
    """In the worker: ``key``'s graph loaded from the runner's store, else built; its
    seconds; whether it was loaded."""
    start = perf_counter()
    graph = runner.load(key)
    loaded = graph is not None
    if graph is None:
        graph = runner.build(key, inputs)
    return graph, perf_counter() - start, loaded
