"""Calibrate a cost model on this machine (:func:`calibrate`): an attention call's
:class:`~attnpolicy.graphs.costmodel.CostModel` or a whole model's
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`. Both levels build
each graph of their grid (its compile timed), then time its runs in ``repeats`` rounds
through one loop (:func:`_measure`), on real lengths of three quarters of each bucket.

Attention level: every sample runs through the real machinery: a :class:`~attnpolicy.dispatch.Dispatcher`
decides, plans and compiles the graph of one key (``compile_graph`` with the chosen
backend, timed by the graph cache), then its call is timed through
:func:`attnpolicy.graphs.execute.execute` on real tensors, so the timed calls pay a
typical padding. The first compile in the process is timed
too: what it pays over a later compile of its key is the model's ``warmup_seconds``.
Each MASK shape's dense mask build is timed plain and under a sliding window
(:func:`window`): ``mask_build`` and ``mask_build_window``.
With ``store`` a few shapes per call kind (:func:`store_shapes`) are compiled ahead of
time into a fresh :class:`~attnpolicy.cache.disk_store.DiskStore` by a dispatcher
configured with it, then loaded back by fresh dispatchers: the load seconds and the
bytes on disk of each are the ``store_load`` and ``store_bytes`` samples.

Model level: every sample goes through the real :class:`~attnpolicy.engine.runner.StaticModelRunner`
of the SPEC's model: one graph per key of the grid (prefill graphs, then step graphs
over cached context) is built through the runner's graph cache (compile and first run,
timed), then batches of its key are run through
:meth:`~attnpolicy.engine.runner.StaticModelRunner.run` (placement, graph, scatter:
what a replay pays per batch), and the build's RSS delta and static-shape estimate are
taken from the runner's stats. Seconds are process CPU
seconds (``clock="cpu"``, stable on a loaded machine; a backend's compile workers in
other processes are not counted) or wall seconds (``clock="wall"``). The first compile
of the process is timed in a throwaway runner: what it pays over the same key's later
compile is ``warmup_seconds``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import Any, TypeVar, overload

import torch

from attnpolicy.bench.mode_timing import BENCH_TORCH_DTYPES, split_lengths
from attnpolicy.bench.settings import DEFAULT_SIZES, CalibrationSettings, ModelCalibrationSettings
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.engine.keys import ModelKey, contexts
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.compile import release_graph
from attnpolicy.graphs.costmodel import CostModel, Fit, Sample
from attnpolicy.graphs.execute import execute
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.kernels.masks import mask_for
from attnpolicy.modelling.whole_model_costs import (
    CALIBRATED_MODES,
    Mode,
    ModelCostModel,
    ModelDims,
    ModelFit,
    ModelSample,
    StepFits,
    StepSample,
)

#: The policy that plans each call kind for the calibration layouts below.
_POLICY: dict[CallKind, str] = {CallKind.CAUSAL: "dynamic", CallKind.MASK: "always-mask",
                                   CallKind.VARLEN: "varlen", CallKind.ROWS: "always-rows"}
#: The rows of the ROWS graphs timed: a rows sample is one row's seconds (the call's / this).
CALIBRATION_ROWS = 4
#: Hit-path dispatches averaged for the call overhead.
OVERHEAD_CALLS = 2000
MIN_REPEATS = 2
MAX_REPEATS = 10
MIN_TIMED_SECONDS = 0.02
#: A grid entry and a graph key of :func:`_measure`.
G = TypeVar("G")
T = TypeVar("T")


def window(kv_bucket: int) -> int:
    """The sliding window the windowed mask builds are timed with: a quarter of the keys."""
    return max(1, kv_bucket // 4)


def _real(bucket: int) -> int:
    """The real length timed in a bucket: three quarters of it."""
    return bucket - bucket // 4


def shapes(s: CalibrationSettings) -> list[tuple[CallKind, int, int]]:
    """The (call kind, q bucket, kv bucket) grid: ``sizes``, or pow2 sizes from 16 to
    ``max_len`` (every other size with ``quick``); square shapes for CAUSAL, MASK and ROWS,
    decode-like (q bucket 16) and chunk-like (q = kv/4, kv/2) shapes for MASK and VARLEN,
    and the first two for ROWS (graphs of :data:`CALIBRATION_ROWS` rows; its decode-like
    shape is one query row a row, q 1, as a rows decode runs)."""
    sizes = sorted(s.sizes or ())
    n = 16
    while not s.sizes and n <= s.max_len:
        sizes.append(n)
        n *= 2
    if s.quick and not s.sizes:
        sizes = sorted({*sizes[::2], sizes[-1]})
    grid: list[tuple[CallKind, int, int]] = []
    for n in sizes:
        grid += [(CallKind.CAUSAL, n, n), (CallKind.MASK, n, n), (CallKind.ROWS, n, n)]
    for n in sizes:
        if n >= 64:
            grid += [(CallKind.MASK, 16, n), (CallKind.VARLEN, 16, n), (CallKind.ROWS, 1, n),
                     (CallKind.MASK, n // 4, n), (CallKind.VARLEN, n // 4, n), (CallKind.ROWS, n // 4, n)]
        if n >= 32:
            grid.append((CallKind.VARLEN, n // 2, n))
    return list(dict.fromkeys(grid))


def _layout(kind: CallKind, q_bucket: int, kv_bucket: int) -> BatchLayout:
    """A layout whose single planned call has this call kind and buckets (pow2, min 16)."""
    decode = q_bucket == (1 if kind is CallKind.ROWS else 16) and kv_bucket > 16  # a rows decode's q is 1
    rq, rkv = (1 if decode else _real(q_bucket)), _real(kv_bucket)
    if kind is CallKind.CAUSAL:
        return BatchLayout.from_lens([rq])
    if kind is CallKind.VARLEN:
        return BatchLayout.from_lens([rq], [rkv])
    if kind is CallKind.ROWS:  # every row alike: the call's seconds are its rows' times one row's
        return BatchLayout.from_lens([rq] * CALIBRATION_ROWS, None if rq == rkv else [rkv] * CALIBRATION_ROWS)
    n = min(4, rq)
    q_lens = split_lengths(rq, n)
    return BatchLayout.from_lens(q_lens, None if rq == rkv else split_lengths(rkv, n))


def _run_seconds(fn: Callable[[], object]) -> list[float]:
    """The seconds of :data:`MIN_REPEATS` or more runs (up to :data:`MAX_REPEATS`
    while they take under :data:`MIN_TIMED_SECONDS` together)."""
    times: list[float] = []
    while len(times) < MIN_REPEATS or (sum(times) < MIN_TIMED_SECONDS and len(times) < MAX_REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def warm_up(backend: str) -> float:
    """Compile and call one tiny graph with ``backend`` (a fresh dispatcher, nothing
    kept): the process's one-off compile start-up is paid now. Returns its seconds
    (the full compile when this is the process's first with ``backend``)."""
    layout = BatchLayout.from_lens([8])
    q = torch.zeros(8, 1, 8)
    with Dispatcher(AttnPolicyConfig(policy="dynamic", backend=backend, max_graphs=1)) as dispatcher:
        start = time.perf_counter()
        with torch.inference_mode():
            dispatcher.attend(q, q.clone(), q.clone(), layout)
        return time.perf_counter() - start


@overload
def calibrate(s: CalibrationSettings, progress: Callable[[str], None] | None = None) -> CostModel: ...
@overload
def calibrate(s: ModelCalibrationSettings, progress: Callable[[str], None] | None = None) -> ModelCostModel: ...
def calibrate(s: CalibrationSettings | ModelCalibrationSettings, progress: Callable[[str], None] | None = None
              ) -> CostModel | ModelCostModel:
    """Calibrate the level ``s`` is the settings of: the attention calls (:func:`_attention`)
    or a whole model's graphs (:func:`_whole_model`)."""
    return _whole_model(s, progress) if isinstance(s, ModelCalibrationSettings) else _attention(s, progress)


def _attention(s: CalibrationSettings, progress: Callable[[str], None] | None) -> CostModel:
    """Measure every shape of :func:`shapes` and fit a :class:`CostModel`.

    First one tiny graph is compiled (:func:`warm_up`), then each shape's graph (one
    compile sample per key) and its call run once (its mask cached), then
    :func:`_measure` times every shape; a call's sample is its fastest or mean run over
    all rounds (``statistic``). ``warmup_seconds`` is what the tiny graph's compile
    took over a later compile of its key (0 when the process had compiled with this
    backend before: nothing left to pay). ``progress(label)`` is called once per shape
    compiled and once per round: ``len(shapes(s)) + repeats`` times in all."""
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    spec = s.spec
    dtype = BENCH_TORCH_DTYPES[s.dtype]
    compiled: dict[GraphKey, float] = {}
    def on_compile(key: Hashable, seconds: float, nbytes: int) -> None:
        assert isinstance(key, GraphKey)
        compiled[key] = seconds

    def sizeof(key: Hashable) -> int:
        assert isinstance(key, GraphKey)
        return graph_bytes(key)

    cache: GraphCache[Any] = GraphCache(sizeof=sizeof, release=lambda key, graph: release_graph(graph),
                                        on_compile=on_compile)
    grid = shapes(s)
    max_seq_len = max(s.max_len, s.partition_len or 0, *(kv for _, _, kv in grid))
    dispatchers = {kind: Dispatcher(AttnPolicyConfig(
        policy=policy, backend=s.backend, attn_impl=s.impl, partition_len=s.partition_len,
        max_seq_len=max_seq_len), cache=cache) for kind, policy in _POLICY.items()}
    gen = torch.Generator().manual_seed(0)

    def build(shape: tuple[CallKind, int, int]) -> tuple[GraphKey, float, list[Callable[[], list[float]]]]:
        """The shape's graph compiled, its call run once; timers: the call, and MASK's mask builds."""
        kind, qb, kvb = shape
        layout = _layout(kind, qb, kvb)
        q = torch.randn(layout.q_tokens, s.heads, s.head_dim, generator=gen).to(dtype)
        k = torch.randn(layout.kv_tokens, s.kv_heads, s.head_dim, generator=gen).to(dtype)
        graphs = list(dispatchers[kind].prepare(layout, spec))  # kept: timed after later batches
        (key,) = dispatchers[kind].graph_keys_for(layout, spec)
        run = partial(execute, q, k, torch.randn_like(k), layout, graphs, dispatchers[kind].masks)
        run()  # caches its mask
        builds = [partial(mask_for(layout, w).materialize, qb, kvb) for w in (None, window(kvb))
                  ] if kind is CallKind.MASK else []
        return key, compiled[key], [partial(_run_seconds, fn) for fn in (run, *builds)]

    first = warm_up(s.backend) if s.backend != "none" else 0.0
    try:
        with torch.inference_mode():
            measured = _measure(grid, build, s.repeats, progress)
            overhead = _call_overhead(dispatchers[CallKind.CAUSAL], spec)
    finally:
        cache.clear()
    pick = min if s.statistic == "min" else statistics.fmean
    samples = [Sample(what="compile", kind=kind, rows=key.q_len, cols=key.kv_len, seconds=compile_s)
               for (kind, *_), (key, compile_s, _) in zip(grid, measured)]
    for (kind, *_), (key, _, (run_s, *build_s)) in zip(grid, measured):
        samples.append(Sample(what="run", kind=kind, rows=key.q_len, cols=key.kv_len,
                              seconds=pick(run_s) / key.rows))  # a ROWS graph's: per row
        for what, seconds in zip(("mask_build", "mask_build_window"), build_s):
            samples.append(Sample(what=what, rows=key.q_len, cols=key.kv_len, seconds=pick(seconds)))
    compile_fits = {kind: _fit(samples, "compile", kind) for kind in CallKind}
    tiers: dict[str, Any] = {}
    if s.store and s.backend != "none":
        stored = calibrate_store(s, progress)
        samples += stored
        tiers = {field: {kind: _fit(stored, field, kind) for kind in CallKind}
                 for field in ("store_load", "store_bytes")}
    return CostModel(
        **tiers,
        kernel_seconds=_kernel_seconds(s) if s.kernels else {},
        dtype=s.dtype, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, impl=s.impl,
        partition_len=s.partition_len if s.impl == "flash" else None, backend=s.backend,
        threads=torch.get_num_threads(), torch_version=torch.__version__,
        run={kind: _fit(samples, "run", kind) for kind in CallKind},
        compile=compile_fits, warmup_seconds=max(0.0, first - compile_fits[CallKind.CAUSAL](16, 16)),
        mask_build=_fit(samples, "mask_build", None), mask_build_window=_fit(samples, "mask_build_window", None),
        call_overhead_seconds=overhead, samples=tuple(samples))


def _measure(grid: Iterable[G], build: Callable[[G], tuple[T, float, Sequence[Callable[[], list[float]]]]],
             repeats: int, progress: Callable[[str], None] | None) -> list[tuple[T, float, list[list[float]]]]:
    """The one timing loop of both levels: ``build(entry)`` builds each entry's graph
    (``progress`` told its key) and gives its key, its compile seconds and its timers
    (each the seconds of one or more runs); then ``repeats`` rounds (``progress`` told
    after each) call every timer once, in order (rounds spread each graph's runs over
    the whole calibration). Per entry: its key, compile seconds and each timer's seconds."""
    built = []
    for entry in grid:
        built.append(build(entry))
        if progress:
            progress(f"compiled {built[-1][0]}")
    times: list[list[list[float]]] = [[[] for _ in timers] for *_, timers in built]
    for r in range(repeats):
        for seconds, (*_, timers) in zip(times, built):
            for timed, timer in zip(seconds, timers):
                timed += timer()
        if progress:
            progress(f"timing round {r + 1}/{repeats}")
    return [(key, compile_s, t) for (key, compile_s, _), t in zip(built, times)]


#: Shapes per call kind saved and loaded through a store by :func:`calibrate_store`.
STORE_SHAPES = 3


def store_shapes(s: CalibrationSettings) -> list[tuple[CallKind, int, int]]:
    """The shapes :func:`calibrate_store` measures: per call kind the smallest, a middle and
    the largest shape of :func:`shapes` (by cells)."""
    grid = shapes(s)
    out: list[tuple[CallKind, int, int]] = []
    for kind in CallKind:
        own = sorted((x for x in grid if x[0] is kind), key=lambda x: x[1] * x[2])
        picks = {0, len(own) // 2, len(own) - 1} if len(own) > STORE_SHAPES else set(range(len(own)))
        out += [own[i] for i in sorted(picks)]
    return out


def calibrate_store(s: CalibrationSettings, progress: Callable[[str], None] | None = None) -> list[Sample]:
    """``store_load`` and ``store_bytes`` samples of :func:`store_shapes`: each graph compiled
    ahead of time and saved by a dispatcher with a fresh store (its bytes on disk), then
    loaded ``repeats`` times by fresh dispatchers on that store (its fastest or mean
    load, ``statistic``). ``progress(label)`` once per shape."""
    spec = s.spec
    pick = min if s.statistic == "min" else statistics.fmean
    samples: list[Sample] = []
    for kind, qb, kvb in store_shapes(s):
        layout = _layout(kind, qb, kvb)
        with tempfile.TemporaryDirectory(prefix="attnpolicy-calibrate-") as root:
            config = AttnPolicyConfig(policy=_POLICY[kind], backend=s.backend, attn_impl=s.impl,
                                      partition_len=s.partition_len, max_seq_len=max(s.max_len, kvb),
                                      store_dir=root)
            with Dispatcher(config) as saver:
                (key,) = saver.graph_keys_for(layout, spec)
                saver.prepare(layout, spec)
                assert saver.source.store is not None  # store_dir is set
                on_disk = saver.source.store.stats().bytes
            seconds = []
            for _ in range(s.repeats):
                with Dispatcher(config) as loader:
                    loader.prepare(layout, spec)
                    stats = loader.cache.stats()
                    if stats.loads != 1:
                        raise RuntimeError(f"calibrating the store: {key} was not loaded back ({stats})")
                    seconds.append(stats.load_seconds)
        samples += [Sample(what="store_load", kind=kind, rows=key.q_len, cols=key.kv_len, seconds=pick(seconds)),
                    Sample(what="store_bytes", kind=kind, rows=key.q_len, cols=key.kv_len, seconds=on_disk)]
        if progress:
            progress(f"stored {key}")
    return samples


#: (total tokens, sequences) of the batch ``calibrate --kernels`` times each kernel on
#: (fewer tokens when ``max_len`` is smaller)
KERNEL_BATCH = (1024, 4)


def _kernel_seconds(s: CalibrationSettings) -> dict[str, dict[str, float]]:
    """Median seconds of every registered kernel per call kind on :data:`KERNEL_BATCH`,
    at most ``max_len`` tokens."""
    from attnpolicy.bench.kernel_timing import bench_kernels

    total, seqs = KERNEL_BATCH
    rows = bench_kernels(min(total, s.max_len), seqs, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                         repeats=s.repeats, backend=s.backend)
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.family != "loop":
            out.setdefault(r.family, {})[r.impl] = r.median_ms / 1e3
    return out


def _fit(samples: list[Sample], what: str, kind: CallKind | None) -> Fit:
    return Fit.to_samples([(x.rows, x.cols, max(x.seconds, 1e-9)) for x in samples
                           if x.what == what and x.kind == kind])


def _call_overhead(dispatcher: Dispatcher, spec: TensorSpec) -> float:
    """Seconds per call of ``prepare`` on a cache hit: decision, plan, cache lookup."""
    layout = BatchLayout.from_lens([12])
    dispatcher.prepare(layout, spec)
    start = time.perf_counter()
    for _ in range(OVERHEAD_CALLS):
        dispatcher.prepare(layout, spec)
    return (time.perf_counter() - start) / OVERHEAD_CALLS


def clock_of(name: str) -> Callable[[], float]:
    """The clock a model cost model's seconds are in: process CPU or wall."""
    return time.process_time if name == "cpu" else time.perf_counter


def graph_grid(s: ModelCalibrationSettings) -> list[tuple[MaskMode, tuple[int, ...], tuple[int, ...]]]:
    """The (mode, rows, context) per sequence of every calibrated whole-model graph.
    Prefill graphs (no context), per size: one CAUSAL sequence, a MASK batch of up to
    four sequences, a VARLEN sequence and (from 32) a VARLEN pair of the size and its
    half, ROWS one row and two rows (the size and its half). Then with ``steps`` the step
    graphs, per size a context ``c`` of three quarters of it and a chunk of ``r`` rows,
    three quarters of twice the size (a bucket above a decode's): CAUSAL one decode and
    one chunk over ``c``; MASK one decode, four decodes, and a chunk beside a decode;
    VARLEN two decodes (over ``c`` and ``c/2``), eight decodes (a VARLEN graph unrolls its
    sequences: its compile grows with their number) and a chunk beside a decode; ROWS
    one, four and eight decodes and two chunks (a rows forward holds one phase). Entries whose graph is one
    already in the grid are timed once."""
    sizes = sorted(s.sizes or (DEFAULT_SIZES[:2] if s.quick else DEFAULT_SIZES))
    out: list[tuple[MaskMode, tuple[int, ...], tuple[int, ...]]] = []
    for n in sizes:
        r = _real(n)
        parts = min(4, r)
        out += [(MaskMode.CAUSAL, (r,), (0,)), (MaskMode.MASK, tuple(split_lengths(r, parts)), (0,) * parts),
                (MaskMode.VARLEN, (r,), (0,)), (MaskMode.ROWS, (r,), (0,)), (MaskMode.ROWS, (r, _real(n // 2)), (0, 0))]
        if n >= 32:
            out.append((MaskMode.VARLEN, (r, _real(n // 2)), (0, 0)))
    for n in sizes if s.steps else ():
        c, r = _real(n), _real(2 * n)
        out += [(MaskMode.CAUSAL, (1,), (c,)), (MaskMode.CAUSAL, (r,), (c,)),
                (MaskMode.MASK, (1,), (c,)), (MaskMode.MASK, (1,) * 4, (c,) * 4), (MaskMode.MASK, (r, 1), (c, c)),
                (MaskMode.VARLEN, (1, 1), (c, c // 2)), (MaskMode.VARLEN, (1,) * 8, (c,) * 8),
                (MaskMode.VARLEN, (r, 1), (c, c)), (MaskMode.ROWS, (1,), (c,)), (MaskMode.ROWS, (1,) * 4, (c,) * 4),
                (MaskMode.ROWS, (1,) * 8, (c,) * 8), (MaskMode.ROWS, (r, _real(n)), (c, c))]
    return out


def runner_config(s: ModelCalibrationSettings, max_len: int, max_batch: int = 0) -> AttnPolicyConfig:
    """The runner config of a calibration: pow2 buckets up to ``max_len`` (a sequence)
    and ``max_batch`` (a MASK graph's packed rows or context), unbounded cache."""
    return AttnPolicyConfig(policy="dynamic", backend=s.backend, buckets=Buckets(), max_seq_len=max_len,
                            max_batch_tokens=max(2 * max_len, 2 * max_batch, 64))


def _whole_model(s: ModelCalibrationSettings, progress: Callable[[str], None] | None) -> ModelCostModel:
    """Build and time every graph of :func:`graph_grid` through a runner and fit a
    :class:`ModelCostModel`: each graph is placed and fetched (compile and first run,
    timed; a step's context from a cache of zeros), then :func:`_measure` times its
    batches through :meth:`~attnpolicy.engine.runner.StaticModelRunner.run` (a step
    over a fresh cache holding its context: the gather, the graph and the write-back of
    its new rows, as a serving step pays); a graph's sample is its median run.
    ``progress(label)`` is called once per graph and once per timing round."""
    torch.set_num_threads(s.threads)
    model, described = load_model(s.spec)
    clock = clock_of(s.clock)
    grid = [(mode, BatchLayout.from_lens(list(rows), [q + c for q, c in zip(rows, context)]))
            for mode, rows, context in graph_grid(s)]
    config = runner_config(s, 2 * max(max(layout.kv_lens) for _, layout in grid),
                           max([layout.kv_tokens for _, layout in grid if layout.has_context], default=0))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def inputs(layout: BatchLayout) -> tuple[torch.Tensor, KVCache | None, range | None]:
        """Random token ids of ``layout``, and a step's cache holding its context and its slots."""
        ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
        if not layout.has_context:
            return ids, None, None
        return ids, KVCache.holding(model, contexts(layout), max(layout.kv_lens)), range(layout.num_seqs)

    first_mode, first_layout = grid[0]
    throwaway = StaticModelRunner(model, config)
    start = clock()
    throwaway.run(torch.zeros(first_layout.q_tokens, dtype=torch.long), first_layout, first_mode)
    first = clock() - start
    throwaway.close()

    runner = StaticModelRunner(model, config)
    unique: dict[ModelKey, tuple[MaskMode, BatchLayout]] = {}
    for mode, layout in grid:
        (key,) = runner.keys_for(layout, mode, kv=layout.has_context)  # one forward: one phase, few rows
        unique.setdefault(key, (mode, layout))

    def build(entry: tuple[ModelKey, tuple[MaskMode, BatchLayout]]) -> tuple[ModelKey, float,
                                                                               list[Callable[[], list[float]]]]:
        key, (mode, layout) = entry
        ids, kv, slots = inputs(layout)
        batch = runner.prepare(ids, layout, mode, kv=kv, slots=slots)
        start = clock()
        runner.graph_for(batch)
        return key, clock() - start, [partial(timed_run, mode, layout)]

    def timed_run(mode: MaskMode, layout: BatchLayout) -> list[float]:
        ids, kv, slots = inputs(layout)
        start = clock()
        runner.run(ids, layout, mode, kv=kv, slots=slots)
        return [clock() - start]

    try:
        measured = _measure(unique.items(), build, s.repeats, progress)
        memory = {m.key: m for m in runner.stats().memory}
    finally:
        runner.close()
    samples, steps = [], []
    for key, compile_s, (run_s,) in measured:
        figures = {"mode": key.mode.value, "compile_seconds": compile_s, "run_seconds": statistics.median(run_s),
                   "rss_bytes": memory[str(key)].rss_bytes, "estimate_bytes": memory[str(key)].estimate_bytes}
        if key.kv:
            steps.append(StepSample(tokens=key.tokens, context=key.context, segments=key.segments, **figures))
        else:
            samples.append(ModelSample(segments=tuple(t for t, _ in key.segments), **figures))
    fits = _mode_fits(samples, s.backend)
    first_key = samples[0].key(s.backend)
    return ModelCostModel(
        spec=described, model_type=model.config.model_type,
        dims=ModelDims.of(model.config, next(model.parameters()).element_size()), backend=s.backend,
        threads=torch.get_num_threads(), clock=s.clock, torch_version=torch.__version__, **fits,
        warmup_seconds=max(0.0, first - fits["compile"][first_key.mode.value](first_key)), samples=tuple(samples),
        steps=StepFits(**_mode_fits(steps, s.backend), samples=tuple(steps)) if steps else None)


def _mode_fits(samples: Sequence[ModelSample] | Sequence[StepSample], backend: str
               ) -> dict[str, dict[Mode, ModelFit]]:
    """Per mode, the compile, run and RSS fits over the ``samples`` of that mode."""
    values: dict[str, Callable[[Any], float]] = {"compile": lambda x: x.compile_seconds,
                                                 "run": lambda x: x.run_seconds, "rss": lambda x: max(x.rss_bytes, 1)}
    return {what: {m: ModelFit.to_samples([(x.key(backend), float(value(x))) for x in samples if x.mode == m])
                   for m in CALIBRATED_MODES} for what, value in values.items()}
