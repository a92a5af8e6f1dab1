"""GraphCache: compiled graphs by key, bounded by count and bytes, single-flight, observable.

See ``docs/cache.md`` for what each statistic means and how eviction works.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Generic, TypeVar, cast

from attnpolicy.cache.cache_types import Bounds, CacheStats, KeyCounters, KeyStats
from attnpolicy.cache.eviction_registry import make_eviction
from attnpolicy.core.bounded_order import BoundedOrder
from attnpolicy.core.names import Oversize
from attnpolicy.errors import AttnPolicyError, ConfigError, GraphCompileError, GraphTooLargeError

V = TypeVar("V")
__all__ = ["CacheStats", "GraphCache", "KeyStats"]


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    nbytes: int
    stats: KeyCounters


#: The value of a deferred entry (:meth:`GraphCache.reserve`): no graph built yet.
_UNBUILT: Any = object()


def _checked_bytes(name: str, key: Hashable, fn: Callable[[Hashable], int | None], optional: bool = False
                   ) -> int | None:
    """``fn(key)``, an int >= 0 (or ``None`` when ``optional``); else :class:`ConfigError`
    naming ``name``."""
    try:
        nbytes = fn(key)
    except Exception as exc:
        raise ConfigError(f"{name}({key}) raised {type(exc).__name__}: {exc}") from exc
    if nbytes is None and optional:
        return None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ConfigError(f"{name}({key}) returned {nbytes!r}; it must be an int >= 0"
                          + (" or None" if optional else ""))
    return nbytes


class GraphCache(Generic[V]):
    """Compiled graphs by key, never holding more than ``max_graphs`` graphs or ``max_bytes`` bytes.

    - ``eviction``: a registered strategy name (``lru``, ``lfu``, ``fifo``, ``cost``,
      ``belady`` or a plugin's), built with ``eviction_options`` as keyword options.
    - ``sizeof(key)``: a graph's bytes, known before building (default: 0), so that a
      graph larger than ``max_bytes`` is refused without compiling: ``oversize="raise"``
      raises :class:`GraphTooLargeError`, ``"uncached"`` builds it and returns it
      without caching (counted in ``uncached``).
    - ``measure(key, graph)``: the bytes a built (or loaded) graph holds on its device, as
      its compiler reports them, or ``None``; a figure replaces ``sizeof``'s estimate for
      the graph, in the bounds and statistics (a graph that alone exceeds ``max_bytes``
      then is released and refused, or served uncached, as ``oversize`` says). Not asked
      of deferred entries, which are placed before they are built.
    - ``compile_cost(key, measured_seconds)``: the compile seconds to record for a
      build (statistics, ``on_compile``, the ``cost`` eviction); default: the measured
      seconds. A simulation whose builds are stubs returns a modelled cost here.
    - ``on_compile(key, seconds, nbytes)``, ``on_evict(key, nbytes)`` observe;
      ``release(key, value)`` frees an evicted or cleared graph (e.g.
      :func:`attnpolicy.graphs.compile.release_graph`). Callbacks run in the requesting
      thread, outside the lock, after the cache state is updated.

    Pinning: ``get_or_compile(key, build, pin=True)`` pins the key until
    :meth:`unpin`. A pinned graph can still be evicted (the bounds on *cached* graphs
    always hold), but it is not released: it stays *held*, callable without a
    recompile, until its last pin goes. The Dispatcher pins the graphs of the batch it
    prepares until the batch has run; ``held_*`` statistics report that transient excess.

    Deferred entries: :meth:`reserve` requests a key whose graph the caller does not run
    (a host's own kernel runs it); a miss enters it unbuilt, counted and placed as its
    graph would be. The first ``get_or_compile`` of it (a hit) builds or loads it in place.

    Thread-safe. A key missing in several threads at once is built once (single
    flight); the other threads wait and count as hits and as waits. Builds run
    outside the lock, so other keys proceed. A failed build caches nothing and
    raises :class:`GraphCompileError` (also in the waiting threads); the next
    request builds again. A build that requests its own key (same thread) raises
    :class:`GraphCompileError` instead of waiting for itself.
    """

    def __init__(
        self,
        max_graphs: int | None = None,
        max_bytes: int | None = None,
        eviction: str = "lru",
        sizeof: Callable[[Hashable], int] | None = None,
        oversize: Oversize = "raise",
        on_compile: Callable[[Hashable, float, int], None] | None = None,
        on_evict: Callable[[Hashable, int], None] | None = None,
        release: Callable[[Hashable, V], None] | None = None,
        eviction_options: dict[str, Any] | None = None,
        compile_cost: Callable[[Hashable, float], float] | None = None,
        measure: Callable[[Hashable, V], int | None] | None = None,
    ) -> None:
        bounds = Bounds.of(max_graphs=max_graphs, max_bytes=max_bytes, oversize=oversize)
        for field, fn in (("sizeof", sizeof), ("on_compile", on_compile), ("on_evict", on_evict),
                          ("release", release), ("compile_cost", compile_cost), ("measure", measure)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{field} must be callable or None, got {fn!r}")
        self.max_graphs = bounds.max_graphs
        self.max_bytes = bounds.max_bytes
        self.eviction = eviction
        self.oversize = bounds.oversize
        #: the cached entries, within the bounds (the eviction rule every model of the cache runs too)
        self._core: BoundedOrder[Hashable, _Entry[V]] = BoundedOrder(
            make_eviction(eviction, eviction_options), max_graphs=bounds.max_graphs, max_bytes=bounds.max_bytes,
            ordered=True)
        self._sizeof: Callable[[Hashable], int] = sizeof or (lambda key: 0)
        self._on_compile = on_compile
        self._on_evict = on_evict
        self._release = release
        self._compile_cost = compile_cost
        self._measure = measure
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, tuple[Future[V], int]] = {}
        self._per_key: dict[Hashable, KeyCounters] = {}
        self._pins: dict[Hashable, int] = {}  # key -> pins (a plain dict: the hot path)
        self._held: list[tuple[Hashable, _Entry[V]]] = []
        self._unbuilt: dict[Hashable, _Entry[V]] = {}  # the cached deferred entries
        self._held_bytes = 0
        self._zero_counters()

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> GraphCache[V]:
        """A cache bounded as an :class:`~attnpolicy.config.AttnPolicyConfig` says
        (``max_graphs``, ``max_bytes``, ``eviction``, ``oversize``); ``options`` add or
        override constructor arguments."""
        bounds = {"max_graphs": config.max_graphs, "max_bytes": config.max_bytes,
                  "eviction": config.eviction, "oversize": config.oversize}
        return cls(**{**bounds, **options})

    def _zero_counters(self) -> None:
        self._hits = self._misses = self._evictions = self._refused = 0
        self._compiles = self._compile_failures = self._waits = self._uncached = 0
        self._compile_seconds = self._load_seconds = 0.0
        self._loads = self._deferred = self._deferred_built = 0
        self._core.reset_peaks()
        self._peak_held = len(self._held)
        self._peak_held_bytes = self._held_bytes

    # -- the hot path ---------------------------------------------------------------

    def get_or_compile(self, key: Hashable, build: Callable[[], V], *, pin: bool = False,
                       seconds: float | None = None, load: Callable[[], V | None] | None = None) -> V:
        """The graph for ``key``, calling ``build()`` (once, whatever the threads) on a
        miss. ``pin``: keep the returned graph unreleased until :meth:`unpin`.
        ``seconds``: the build's (or load's) measured seconds when it ran elsewhere
        (``build`` returns a graph compiled in the background); default: timed around it.
        ``load()``: tried first on a miss (a lower tier, e.g. a disk store); a graph it
        returns is counted in ``loads`` and ``load_seconds``, ``None`` means build.
        A deferred entry (:meth:`reserve`) is a hit whose graph is built (or loaded) now."""
        with self._lock:
            entry = self._core.get(key)
            if entry is None:
                claim = None
            elif entry.value is not _UNBUILT:
                self._hits += 1
                entry.stats.hits += 1
                if pin:
                    self._pin(key)
                return entry.value
            else:
                claim = self._claim(key, entry)
        if claim is None:
            return self._miss(key, build, pin, seconds, load)
        return self._settle(key, entry, *claim, build, pin, seconds, load)

    def reserve(self, key: Hashable) -> None:
        """Request ``key`` as :meth:`get_or_compile` would, for a caller that does not
        run its graph: a hit when it is cached (deferred or not) or being built; else a
        miss that enters it *deferred*, without building (counted in ``deferred``): sized,
        evicting and evicted (``on_evict`` included) as its graph would be. An oversize
        key is refused (raises) or counted ``uncached``, as its build would be."""
        error: BaseException | None = None
        try:  # outside the lock, as a build's (a reserved key is almost always a miss)
            nbytes, cached = self._size(key)
            cost = 0.0 if self._compile_cost is None else self._compile_cost(key, 0.0)
        except BaseException as exc:
            error = exc
        victims: list[tuple[Hashable, _Entry[V], bool]] = []
        with self._lock:
            stats = self._per_key.setdefault(key, KeyCounters())
            if self._core.get(key) is not None or key in self._inflight:  # cached or being built: a hit
                self._hits += 1
                stats.hits += 1
                return
            self._misses += 1
            stats.misses += 1
            if error is not None:
                self._refused += 1
            else:
                self._deferred += 1
                stats.bytes = nbytes
                if cached:
                    entry: _Entry[V] = _Entry(_UNBUILT, nbytes, stats)
                    self._insert(key, entry, cost, victims)
                    self._unbuilt[key] = entry
                else:
                    self._uncached += 1
        self._released(victims, evicted=True)
        if error is not None:
            raise error

    def _claim(self, key: Hashable, entry: _Entry[V]) -> tuple[Future[V], bool]:
        """A request of deferred ``key`` (a hit): the future of its build and whether this
        thread builds it (else it waits; counted in ``waits``). The builder pins it until
        done (see :meth:`_settle`), so that an eviction meanwhile holds the entry. Lock held."""
        inflight = self._inflight.get(key)
        if inflight is not None and inflight[1] == threading.get_ident():
            raise GraphCompileError(
                f"re-entrant build: building the graph for key {key} requested key {key} again "
                "in the same thread (a build must not request its own key)")
        self._hits += 1
        entry.stats.hits += 1
        if inflight is not None:
            self._waits += 1
            return inflight[0], False
        future: Future[V] = Future()
        self._inflight[key] = (future, threading.get_ident())
        self._deferred_built += 1
        self._pin(key)
        return future, True

    def hit_many(self, keys: Sequence[Hashable], start: int = 0, *, pin: bool = False,
                 values: list[V] | None = None) -> int:
        """``get_or_compile`` for ``keys[start:]``, in order, while they are cached, under
        one lock: each counts a hit, refreshes its recency and takes a pin (``pin``)
        exactly as ``get_or_compile(key, build, pin=pin)`` would, and its graph is
        appended to ``values`` (if given). Returns the index of the first key not cached
        (``len(keys)`` when all were; with ``values``, a deferred entry counts as not
        cached), for the caller to fetch with ``get_or_compile``."""
        core = self._core
        order = core.entries
        get = cast(Callable[[Hashable], _Entry[V]], core.get)  # asked only of held keys
        unbuilt = self._unbuilt if values is not None else {}
        with self._lock:
            stop = len(keys)
            for key in dict.fromkeys(keys[start:stop]):
                if key not in order or key in unbuilt:
                    stop = keys.index(key, start)
                    break
            hits = keys[start:stop]
            # LRU: a key's place depends only on its last touch; FIFO: touches change nothing
            touched = reversed(dict.fromkeys(reversed(hits))) if core.touch_once else hits
            entries = {key: get(key) for key in touched}  # each touch as get_or_compile's
            for key in hits:
                entries[key].stats.hits += 1
            self._hits += len(hits)
            if pin:
                for key in hits:
                    self._pin(key)
            if values is not None:
                values.extend(entries[key].value for key in hits)
        return stop

    def _pin(self, key: Hashable) -> None:
        pins = self._pins
        pins[key] = pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[Hashable]) -> None:
        """Drop one pin of each key (as pinned by ``get_or_compile``); graphs evicted
        while pinned are released when their last pin goes."""
        free: list[tuple[Hashable, _Entry[V]]] = []
        with self._lock:
            pins = self._pins
            for key in keys:
                left = pins[key] - 1
                if left > 0:
                    pins[key] = left
                else:
                    del pins[key]
            if self._held:
                free = [(k, e) for k, e in self._held if k not in pins]
                if free:
                    self._held = [(k, e) for k, e in self._held if k in pins]
                    self._held_bytes = sum(e.nbytes for _, e in self._held)
        if free:
            self._released(free, evicted=False)

    # -- misses ---------------------------------------------------------------------

    def _miss(self, key: Hashable, build: Callable[[], V], pin: bool, measured: float | None = None,
              load: Callable[[], V | None] | None = None) -> V:
        with self._lock:
            entry = self._core.get(key)  # cached by another thread since the hot path looked?
            if entry is not None and entry.value is not _UNBUILT:
                self._hits += 1
                entry.stats.hits += 1
                if pin:
                    self._pin(key)
                return entry.value
            if entry is not None:  # deferred
                future, owner = self._claim(key, entry)
            else:
                inflight = self._inflight.get(key)
                if inflight is not None and inflight[1] == threading.get_ident():
                    raise GraphCompileError(
                        f"re-entrant build: building the graph for key {key} requested key {key} again "
                        "in the same thread (a build must not request its own key)")
                stats = self._per_key.setdefault(key, KeyCounters())
                owner = inflight is None
                if inflight is None:
                    self._misses += 1
                    stats.misses += 1
                    future = Future()
                    self._inflight[key] = (future, threading.get_ident())
                else:
                    future = inflight[0]
                    self._hits += 1
                    self._waits += 1
                    stats.hits += 1
        return self._settle(key, entry, future, owner, build, pin, measured, load)

    def _settle(self, key: Hashable, entry: _Entry[V] | None, future: Future[V], owner: bool,
                build: Callable[[], V], pin: bool, measured: float | None, load: Callable[[], V | None] | None) -> V:
        """Build (or load) the graph of ``key`` when this thread owns ``future`` (into the
        deferred ``entry`` when given, then the build's pin dropped), else wait for it."""
        if owner:
            try:
                return self._compile(key, build, future, pin, measured, load, entry)
            finally:
                if entry is not None:
                    self.unpin((key,))  # an entry evicted meanwhile is released here
        value = self._wait(key, future)
        if pin:
            with self._lock:
                self._pin(key)
        return value

    def _wait(self, key: Hashable, future: Future[V]) -> V:
        exc = future.exception()  # blocks until the owner finishes
        if exc is None:
            return future.result()
        if isinstance(exc, AttnPolicyError):  # a fresh copy per thread, same message and cause
            raise type(exc)(*exc.args) from exc.__cause__
        raise GraphCompileError(
            f"building the graph for key {key} failed in another thread: {type(exc).__name__}: {exc}"
        ) from exc

    def size_of(self, key: Hashable) -> int:
        """The bytes ``key``'s graph counts against ``max_bytes`` (``sizeof(key)``,
        checked: a raising or bad ``sizeof`` raises :class:`ConfigError`)."""
        nbytes = _checked_bytes("sizeof", key, self._sizeof)
        assert nbytes is not None  # not optional: checked
        return nbytes

    def _size(self, key: Hashable, nbytes: int | None = None) -> tuple[int, bool]:
        """``(bytes, cached)`` of ``key``'s graph (of ``nbytes`` when given), or raise: a
        refusal before building."""
        nbytes = self.size_of(key) if nbytes is None else nbytes
        cached = self._core.fits(nbytes)
        if not cached and self.oversize == "raise":
            raise GraphTooLargeError(
                f"the graph for key {key} needs {nbytes} bytes, more than max_bytes={self.max_bytes}"
            )
        return nbytes, cached

    def _measured(self, key: Hashable, graph: V, future: Future[V], nbytes: int, cached: bool,
                  built: KeyCounters | None) -> tuple[int, bool]:
        """``(bytes, cached)`` of ``key``'s built (``built``: its counters) or loaded ``graph``
        as ``measure`` reports them (``nbytes``, ``cached`` when it reports none). A graph
        refused by its measured bytes is released and counted ``refused`` (a build also in
        ``compiles``: it ran), and the refusal raised."""
        if self._measure is None:
            return nbytes, cached
        measure = self._measure
        try:
            measured = _checked_bytes("measure", key, lambda k: measure(k, graph), optional=True)
            return (nbytes, cached) if measured is None else self._size(key, measured)
        except BaseException as exc:
            if built is not None:
                with self._lock:
                    self._compiles += 1
                    built.compiles += 1
            self._abandon(key, future, exc, refused=True)
            if self._release is not None:
                self._release(key, graph)
            raise

    def _abandon(self, key: Hashable, future: Future[V], exc: BaseException, *, refused: bool) -> None:
        """A miss that produced no graph: counted, waiters told, the key free again."""
        with self._lock:
            del self._inflight[key]
            if refused:
                self._refused += 1
            else:
                self._compile_failures += 1
        future.set_exception(exc)

    def _compile(self, key: Hashable, build: Callable[[], V], future: Future[V], pin: bool, measured: float | None,
                 load: Callable[[], V | None] | None, entry: _Entry[V] | None) -> V:
        stats = self._per_key[key]
        if entry is not None:  # deferred: sized and placed already
            nbytes, cached = entry.nbytes, True
        else:
            try:
                nbytes, cached = self._size(key)
            except BaseException as exc:
                self._abandon(key, future, exc, refused=True)
                raise
        loaded: V | None = None
        try:
            start = perf_counter()
            loaded = None if load is None else load()
            load_seconds = perf_counter() - start if measured is None else measured
            if loaded is None:
                start = perf_counter()
                value = build()
                built_seconds = perf_counter() - start
        except Exception as exc:
            error = GraphCompileError(f"building the graph for key {key} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._abandon(key, future, error, refused=False)
            raise error from exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: counted, not wrapped
            self._abandon(key, future, exc, refused=False)
            raise
        if entry is None:
            nbytes, cached = self._measured(key, value if loaded is None else loaded, future, nbytes, cached,
                                            stats if loaded is None else None)
        if loaded is not None:
            return self._loaded(key, loaded, load_seconds, future, stats, nbytes, cached, pin, entry)

        victims: list[tuple[Hashable, _Entry[V], bool]] = []
        inserted = False
        try:
            seconds = built_seconds if measured is None else measured
            if self._compile_cost is not None:
                seconds = self._compile_cost(key, seconds)
            with self._lock:
                del self._inflight[key]
                self._compiles += 1
                self._compile_seconds += seconds
                stats.compiles += 1
                stats.compile_seconds += seconds
                inserted = self._enter(key, value, nbytes, cached, stats, seconds, victims, pin, entry)
        except BaseException as exc:  # a failing eviction strategy or compile_cost: nothing leaks
            with self._lock:
                if self._inflight.get(key, (None, 0))[0] is future:  # compile_cost raised
                    del self._inflight[key]
                    self._compiles += 1  # the build ran: counted all the same
                    stats.compiles += 1
            future.set_exception(exc)
            self._released(victims, evicted=True)  # what already left the cache is still freed
            if not inserted and self._release is not None:
                self._release(key, value)
            raise
        future.set_result(value)
        self._released(victims, evicted=True)
        if self._on_compile is not None:
            self._on_compile(key, seconds, nbytes)
        return value

    def _loaded(self, key: Hashable, value: V, seconds: float, future: Future[V], stats: KeyCounters,
                nbytes: int, cached: bool, pin: bool, entry: _Entry[V] | None) -> V:
        """Account a miss that ``load()`` served: counted as a load, inserted as a build is
        (ranked for eviction by ``compile_cost`` as a build, so that ranks agree)."""
        victims: list[tuple[Hashable, _Entry[V], bool]] = []
        try:
            cost = seconds if self._compile_cost is None else self._compile_cost(key, seconds)
            with self._lock:
                del self._inflight[key]
                self._loads += 1
                self._load_seconds += seconds
                stats.loads += 1
                stats.load_seconds += seconds
                self._enter(key, value, nbytes, cached, stats, cost, victims, pin, entry)
        except BaseException as exc:  # a failing eviction strategy or compile_cost: nothing leaks
            with self._lock:
                self._inflight.pop(key, None)
            future.set_exception(exc)
            self._released(victims, evicted=True)
            raise
        future.set_result(value)
        self._released(victims, evicted=True)
        return value

    def _enter(self, key: Hashable, value: V, nbytes: int, cached: bool, stats: KeyCounters, seconds: float,
               victims: list[tuple[Hashable, _Entry[V], bool]], pin: bool, entry: _Entry[V] | None = None) -> bool:
        """A new graph into the cache (or counted ``uncached``; into the deferred
        ``entry`` when given), pinned if asked; returns whether it was inserted. Lock held."""
        stats.bytes = nbytes
        if entry is not None:
            entry.value = value
            if self._unbuilt.get(key) is entry:
                del self._unbuilt[key]
        elif cached:
            self._insert(key, _Entry(value, nbytes, stats), seconds, victims)
        else:
            self._uncached += 1
        if pin:
            self._pin(key)
        return cached

    def _remove(self, key: Hashable, entry: _Entry[V], victims: list[tuple[Hashable, _Entry[V], bool]]) -> None:
        """Account ``entry`` gone from the cache; a pinned one is held, not released. Lock held."""
        if self._unbuilt.get(key) is entry:
            del self._unbuilt[key]
        held = key in self._pins
        if held:
            self._held.append((key, entry))
            self._held_bytes += entry.nbytes
            self._peak_held = max(self._peak_held, len(self._held))
            self._peak_held_bytes = max(self._peak_held_bytes, self._held_bytes)
        victims.append((key, entry, held))

    def _insert(self, key: Hashable, entry: _Entry[V], seconds: float,
                victims: list[tuple[Hashable, _Entry[V], bool]]) -> None:
        """Evict (into ``victims``) until ``entry`` fits, then insert it (:meth:`BoundedOrder.admit`).
        Call with the lock held; the caller releases ``victims`` after the lock, even if this raises."""
        popped: list[tuple[Hashable, _Entry[V]]] = []
        try:
            self._core.admit(key, entry, entry.nbytes, seconds, popped)
        finally:  # a strategy that raised: what left the cache already is still accounted
            for victim_key, victim in popped:
                self._evictions += 1
                victim.stats.evictions += 1
                self._remove(victim_key, victim, victims)

    def _released(self, entries: Iterable[tuple[Hashable, _Entry[V]] | tuple[Hashable, _Entry[V], bool]],
                  *, evicted: bool) -> None:
        for key, entry, *held in entries:
            if self._release is not None and not (held and held[0]) and entry.value is not _UNBUILT:
                self._release(key, entry.value)
            if evicted and self._on_evict is not None:
                self._on_evict(key, entry.nbytes)

    # -- management -----------------------------------------------------------------

    def warmup(self, items: Iterable[tuple[Hashable, Callable[[], V]]]) -> None:
        """Build each ``(key, build)`` not cached yet, exactly as requests would (counted)."""
        for key, build in items:
            self.get_or_compile(key, build)

    def reorder(self, eviction: str, compile_cost: Callable[[Hashable, float], float] | None = None,
                eviction_options: dict[str, Any] | None = None) -> None:
        """Rank victims by strategy ``eviction`` from now on (``compile_cost`` and
        ``eviction_options`` as in the constructor): the cached graphs move over in the old strategy's victim order,
        so ``keys()`` lists the next victim first; none is evicted, their uses start over."""
        structure = make_eviction(eviction, eviction_options)

        def cost(key: Hashable, entry: _Entry[V]) -> float:
            spent = entry.stats.compile_seconds / max(entry.stats.compiles, 1)
            return spent if compile_cost is None else compile_cost(key, spent)

        with self._lock:
            self._core.reorder(structure, cost)
            self.eviction, self._compile_cost = eviction, compile_cost

    def evict(self, key: Hashable) -> bool:
        """Evict ``key`` now (counted as an eviction, released unless pinned, ``on_evict``
        fires). Returns whether it was cached."""
        victims: list[tuple[Hashable, _Entry[V], bool]] = []
        with self._lock:
            entry = self._core.remove(key)
            if entry is None:
                return False
            self._evictions += 1
            entry.stats.evictions += 1
            self._remove(key, entry, victims)
        self._released(victims, evicted=True)
        return True

    def clear(self) -> None:
        """Drop every graph, calling ``release`` for each (a pinned one when unpinned).
        Not counted as evictions and ``on_evict`` does not fire: clearing is an
        administrative reset, not pressure."""
        victims: list[tuple[Hashable, _Entry[V], bool]] = []
        with self._lock:
            for key, entry in self._core.clear():
                self._remove(key, entry, victims)
        self._released(victims, evicted=False)

    def reset_stats(self) -> None:
        """Zero every counter (per key too; a key's ``bytes`` stays) and reset the
        peaks to the current contents. Cached graphs stay."""
        with self._lock:
            self._zero_counters()
            for stats in self._per_key.values():
                stats.hits = stats.misses = stats.compiles = stats.evictions = stats.loads = 0
                stats.compile_seconds = stats.load_seconds = 0.0

    # -- inspection -----------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is cached now (deferred or not); no statistics or recency side effect."""
        with self._lock:
            return key in self._core

    def has_graph(self, key: Hashable) -> bool:
        """Whether ``key`` is cached now with its graph built (not deferred); no side effect."""
        with self._lock:
            return key in self._core and key not in self._unbuilt

    def __len__(self) -> int:
        with self._lock:
            return len(self._core)

    def keys(self) -> list[Hashable]:
        """A snapshot of the cached keys."""
        with self._lock:
            return list(self._core)

    def counters(self) -> dict[str, int]:
        """``hits``, ``misses``, ``evictions`` and ``graphs`` now: the figures of
        :meth:`stats` a per-step record needs, without building the per-key ones."""
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "evictions": self._evictions,
                    "graphs": len(self._core)}

    def stats(self) -> CacheStats:
        """A snapshot of the counters, the contents and per-key figures (see docs/cache.md)."""
        with self._lock:
            return CacheStats(
                hits=self._hits, misses=self._misses, evictions=self._evictions, compiles=self._compiles,
                compile_failures=self._compile_failures, compile_seconds=self._compile_seconds,
                waits=self._waits, uncached=self._uncached, refused=self._refused,
                graphs=len(self._core), bytes=self._core.nbytes, peak_graphs=self._core.peak_graphs,
                peak_bytes=self._core.peak_bytes, held_graphs=len(self._held), held_bytes=self._held_bytes,
                peak_held_graphs=self._peak_held, peak_held_bytes=self._peak_held_bytes,
                max_graphs=self.max_graphs, max_bytes=self.max_bytes, eviction=self.eviction,
                per_key={str(key): stats.snapshot() for key, stats in self._per_key.items()},
                loads=self._loads, load_seconds=self._load_seconds, deferred=self._deferred,
                deferred_built=self._deferred_built,
            )
