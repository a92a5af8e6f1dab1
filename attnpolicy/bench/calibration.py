"""Calibrate a cost model on this machine: an attention call's
:class:`~attnpolicy.graphs.costmodel.CostModel` (:func:`calibrate`) or a whole model's
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` (:func:`calibrate_model`).

Attention level: every sample runs through the real machinery: a :class:`~attnpolicy.dispatch.Dispatcher`
decides, plans and compiles the graph of one key (``compile_graph`` with the chosen
backend, timed by the graph cache), then its call is timed through
:func:`attnpolicy.graphs.execute.execute` on real tensors. Real lengths are three quarters of each bucket,
so the timed calls pay a typical padding. The first compile in the process is timed
too: what it pays over a later compile of its key is the model's ``warmup_seconds``.
Each MASK shape's dense mask build is timed plain and under a sliding window
(:func:`window`): ``mask_build`` and ``mask_build_window``.
With ``store`` a few shapes per call kind (:func:`store_shapes`) are compiled ahead of
time into a fresh :class:`~attnpolicy.cache.disk_store.DiskStore` by a dispatcher
configured with it, then loaded back by fresh dispatchers: the load seconds and the
bytes on disk of each are the ``store_load`` and ``store_bytes`` samples.

Model level: every sample goes through the real :class:`~attnpolicy.engine.runner.StaticModelRunner`
of the SPEC's model: one graph per (mode, segment buckets) of the grid is built
through the runner's graph cache (compile and first run, timed), then batches of
its key are run through :meth:`~attnpolicy.engine.runner.StaticModelRunner.run`
(placement, graph, scatter: what a replay pays per batch), and the build's RSS delta
and static-shape estimate are taken from the runner's stats. Seconds are process CPU
seconds (``clock="cpu"``, stable on a loaded machine; a backend's compile workers in
other processes are not counted) or wall seconds (``clock="wall"``). The first compile
of the process is timed in a throwaway runner: what it pays over the same key's later
compile is ``warmup_seconds``.

Both levels time real lengths of three quarters of each bucket, in ``repeats`` rounds
(:func:`_rounds`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from attnpolicy.bench.mode_timing import BENCH_TORCH_DTYPES, split_lengths
from attnpolicy.bench.settings import DEFAULT_SIZES, CalibrationSettings, ModelCalibrationSettings
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.engine.keys import ModelKey
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
    MODEL_COST_MODES,
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
                                   CallKind.VARLEN: "varlen"}
#: Hit-path dispatches averaged for the call overhead.
OVERHEAD_CALLS = 2000
MIN_REPEATS = 2
MAX_REPEATS = 10
MIN_TIMED_SECONDS = 0.02


def window(kv_bucket: int) -> int:
    """The sliding window the windowed mask builds are timed with: a quarter of the keys."""
    return max(1, kv_bucket // 4)


def _real(bucket: int) -> int:
    """The real length timed in a bucket: three quarters of it."""
    return bucket - bucket // 4


def _rounds(repeats: int, progress: Callable[[str], None] | None) -> Iterator[int]:
    """The timing rounds 0 .. ``repeats`` - 1, ``progress`` told after each."""
    for r in range(repeats):
        yield r
        if progress:
            progress(f"timing round {r + 1}/{repeats}")


def shapes(s: CalibrationSettings) -> list[tuple[CallKind, int, int]]:
    """The (call kind, q bucket, kv bucket) grid: ``sizes``, or pow2 sizes from 16 to
    ``max_len`` (every other size with ``quick``); square shapes for CAUSAL and MASK,
    decode-like (q bucket 16) and chunk-like (q = kv/4, kv/2) shapes for MASK and VARLEN."""
    sizes = sorted(s.sizes or ())
    n = 16
    while not s.sizes and n <= s.max_len:
        sizes.append(n)
        n *= 2
    if s.quick and not s.sizes:
        sizes = sorted({*sizes[::2], sizes[-1]})
    grid: list[tuple[CallKind, int, int]] = []
    for n in sizes:
        grid += [(CallKind.CAUSAL, n, n), (CallKind.MASK, n, n)]
    for n in sizes:
        if n >= 64:
            grid += [(CallKind.MASK, 16, n), (CallKind.VARLEN, 16, n),
                     (CallKind.MASK, n // 4, n), (CallKind.VARLEN, n // 4, n)]
        if n >= 32:
            grid.append((CallKind.VARLEN, n // 2, n))
    return list(dict.fromkeys(grid))


def _layout(kind: CallKind, q_bucket: int, kv_bucket: int) -> BatchLayout:
    """A layout whose single planned call has this call kind and buckets (pow2, min 16)."""
    rq, rkv = (1 if q_bucket == 16 and kv_bucket > 16 else _real(q_bucket)), _real(kv_bucket)
    if kind is CallKind.CAUSAL:
        return BatchLayout.from_lens([rq])
    if kind is CallKind.VARLEN:
        return BatchLayout.from_lens([rq], [rkv])
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


def calibrate(s: CalibrationSettings, progress: Callable[[str], None] | None = None) -> CostModel:
    """Measure every shape of :func:`shapes` and fit a :class:`CostModel`.

    First one tiny graph is compiled (:func:`warm_up`), then each shape's graph (one
    compile sample per key), then ``repeats`` rounds time every shape; a call's
    sample is its fastest or mean run over all rounds (``statistic``; rounds spread
    each shape's runs over the whole calibration). ``warmup_seconds`` is what the
    tiny graph's compile took over a later compile of its key (0 when the process
    had compiled with this backend before: nothing left to pay). ``progress(label)``
    is called once per shape compiled and once per round: ``len(shapes(s)) + repeats``
    times in all."""
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
    samples: list[Sample] = []

    def tensors(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(layout.q_tokens, s.heads, s.head_dim, generator=gen).to(dtype)
        k = torch.randn(layout.kv_tokens, s.kv_heads, s.head_dim, generator=gen).to(dtype)
        return q, k, torch.randn_like(k)

    first = warm_up(s.backend) if s.backend != "none" else 0.0
    try:
        with torch.inference_mode():
            runs: list[tuple[CallKind, GraphKey, Callable[[], object], tuple[Callable[[], object], ...]]] = []
            for kind, qb, kvb in grid:
                layout = _layout(kind, qb, kvb)
                tensors_ = tensors(layout)
                graphs = list(dispatchers[kind].prepare(layout, spec))  # kept: timed after later batches
                (key,) = dispatchers[kind].graph_keys_for(layout, spec)
                samples.append(Sample(what="compile", kind=kind, rows=key.q_len, cols=key.kv_len,
                                      seconds=compiled[key]))
                build: tuple[Callable[[], object], ...] = ((partial(mask_for(layout).materialize, qb, kvb),
                          partial(mask_for(layout, window(kvb)).materialize, qb, kvb))
                         if kind is CallKind.MASK else ())
                runs.append((kind, key, partial(execute, *tensors_, layout, graphs, dispatchers[kind].masks), build))
                if progress:
                    progress(f"compiled {key}")
            timed: list[tuple[list[float], list[list[float]]]] = [([], [[] for _ in b]) for *_, b in runs]
            for r in _rounds(s.repeats, progress):
                for (run_s, build_s), (_, _, run, build) in zip(timed, runs):
                    run_s += _run_seconds(run)[r == 0:]  # the first run caches its mask
                    for seconds, fn in zip(build_s, build):
                        seconds += _run_seconds(fn)
            overhead = _call_overhead(dispatchers[CallKind.CAUSAL], spec)
    finally:
        cache.clear()
    pick = min if s.statistic == "min" else statistics.fmean
    for (kind, key, *_), (run_s, build_s) in zip(runs, timed):
        samples.append(Sample(what="run", kind=kind, rows=key.q_len, cols=key.kv_len, seconds=pick(run_s)))
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


def model_grid(s: ModelCalibrationSettings) -> list[tuple[MaskMode, tuple[int, ...]]]:
    """The (mode, real sequence lengths) of every calibrated graph: per size one CAUSAL
    sequence, a MASK batch of up to four sequences, a VARLEN sequence and (from 32) a
    VARLEN pair of the size and its half."""
    sizes = sorted(s.sizes or (DEFAULT_SIZES[:2] if s.quick else DEFAULT_SIZES))
    out: list[tuple[MaskMode, tuple[int, ...]]] = []
    for n in sizes:
        r = _real(n)
        parts = min(4, r)
        out += [(MaskMode.CAUSAL, (r,)),
                (MaskMode.MASK, tuple(r // parts + (i < r % parts) for i in range(parts))),
                (MaskMode.VARLEN, (r,))]
        if n >= 32:
            out.append((MaskMode.VARLEN, (r, _real(n // 2))))
    return out


def step_grid(s: ModelCalibrationSettings) -> list[tuple[MaskMode, tuple[int, ...], tuple[int, ...]]]:
    """The (mode, rows, context) per sequence of every calibrated step graph (none
    without ``steps``): per size a context ``c`` of three quarters of it and a chunk of
    ``r`` rows, three quarters of twice the size (a bucket above a decode's): CAUSAL
    one decode and one chunk over ``c``; MASK one decode, four decodes, and a chunk
    beside a decode; VARLEN two decodes (over ``c`` and ``c/2``), eight decodes (a
    VARLEN graph unrolls its sequences: its compile grows with their number) and a
    chunk beside a decode. Entries whose graph is one already in the grid are timed once."""
    if not s.steps:
        return []
    out: list[tuple[MaskMode, tuple[int, ...], tuple[int, ...]]] = []
    for n in sorted(s.sizes or (DEFAULT_SIZES[:2] if s.quick else DEFAULT_SIZES)):
        c, r = _real(n), _real(2 * n)
        out += [(MaskMode.CAUSAL, (1,), (c,)), (MaskMode.CAUSAL, (r,), (c,)),
                (MaskMode.MASK, (1,), (c,)), (MaskMode.MASK, (1,) * 4, (c,) * 4), (MaskMode.MASK, (r, 1), (c, c)),
                (MaskMode.VARLEN, (1, 1), (c, c // 2)), (MaskMode.VARLEN, (1,) * 8, (c,) * 8),
                (MaskMode.VARLEN, (r, 1), (c, c))]
    return out


def runner_config(s: ModelCalibrationSettings, max_len: int, max_batch: int = 0) -> AttnPolicyConfig:
    """The runner config of a calibration: pow2 buckets up to ``max_len`` (a sequence)
    and ``max_batch`` (a MASK graph's packed rows or context), unbounded cache."""
    return AttnPolicyConfig(policy="dynamic", backend=s.backend, buckets=Buckets(), max_seq_len=max_len,
                            max_batch_tokens=max(2 * max_len, 2 * max_batch, 64))


def calibrate_model(s: ModelCalibrationSettings, progress: Callable[[str], None] | None = None
                    ) -> ModelCostModel:
    """Build and time every graph of :func:`model_grid` and :func:`step_grid` and fit a
    :class:`ModelCostModel`. ``progress(label)`` is called once per graph and once per
    timing round (of each kind of graph)."""
    torch.set_num_threads(s.threads)
    model, described = load_model(s.spec)
    clock = clock_of(s.clock)
    graphs = model_grid(s)
    steps = step_grid(s)
    config = runner_config(s, max([max(lens) for _, lens in graphs] + [q + c for _, qs, cs in steps
                                                                       for q, c in zip(qs, cs)]) * 2,
                           max([sum(cs) + sum(qs) for _, qs, cs in steps], default=0))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    first_layout = BatchLayout.from_lens(list(graphs[0][1]))
    throwaway = StaticModelRunner(model, config)
    start = clock()
    throwaway.run(torch.zeros(first_layout.q_tokens, dtype=torch.long), first_layout, graphs[0][0])
    first = clock() - start
    throwaway.close()

    runner = StaticModelRunner(model, config)
    built = []
    try:
        for mode, lens in graphs:
            layout = BatchLayout.from_lens(list(lens))
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            batch = runner.prepare(ids, layout, mode)
            start = clock()
            runner.graph_for(batch)
            built.append((mode, layout, ids, batch.key, clock() - start))
            if progress:
                progress(f"compiled {batch.key}")
        times: list[list[float]] = [[] for _ in built]
        for _ in _rounds(s.repeats, progress):
            for seconds, (mode, layout, ids, _, _) in zip(times, built):
                start = clock()
                runner.run(ids, layout, mode)
                seconds.append(clock() - start)
        step_samples = _step_samples(runner, model, steps, s, clock, progress)
        memory = {m.key: m for m in runner.stats().memory}
    finally:
        runner.close()
    samples = tuple(
        ModelSample(mode=key.mode.value, segments=tuple(t for t, _ in key.segments), compile_seconds=compile_s,
                    run_seconds=statistics.median(run_s), rss_bytes=memory[str(key)].rss_bytes,
                    estimate_bytes=memory[str(key)].estimate_bytes)
        for (_, _, _, key, compile_s), run_s in zip(built, times))
    dims = ModelDims.of(model.config, next(model.parameters()).element_size())
    compile_fits = _model_fits(samples, s.backend, lambda x: x.compile_seconds)
    first_key = samples[0].key(s.backend)
    step_fits = None if not step_samples else StepFits(
        compile=_model_fits(step_samples, s.backend, lambda x: x.compile_seconds),
        run=_model_fits(step_samples, s.backend, lambda x: x.run_seconds),
        rss=_model_fits(step_samples, s.backend, lambda x: max(x.rss_bytes, 1)), samples=tuple(step_samples))
    return ModelCostModel(
        spec=described, model_type=model.config.model_type, dims=dims, backend=s.backend,
        threads=torch.get_num_threads(), clock=s.clock,
        torch_version=torch.__version__, compile=compile_fits,
        run=_model_fits(samples, s.backend, lambda x: x.run_seconds),
        rss=_model_fits(samples, s.backend, lambda x: max(x.rss_bytes, 1)),
        warmup_seconds=max(0.0, first - compile_fits[first_key.mode.value](first_key)), samples=samples,
        steps=step_fits)


def _step_samples(runner: StaticModelRunner, model: torch.nn.Module,
                  grid: Sequence[tuple[MaskMode, tuple[int, ...], tuple[int, ...]]], s: ModelCalibrationSettings,
                  clock: Callable[[], float], progress: Callable[[str], None] | None) -> list[StepSample]:
    """Build (:meth:`~attnpolicy.engine.runner.StaticModelRunner.warmup`: compile and
    first run, the context zeros) and time every step graph of ``grid`` through
    ``runner``: each timed step runs over a fresh cache holding its context (the
    gather, the graph and the write-back of its new rows, as a serving step pays)."""
    gen = torch.Generator().manual_seed(1)
    config: Any = model.config
    vocab = int(config.vocab_size)
    built = []
    seen: set[ModelKey] = set()
    for mode, rows, context in grid:
        layout = BatchLayout.from_lens(list(rows), [q + c for q, c in zip(rows, context)], causal=True)
        key = runner.key_for(layout, mode, kv=True)
        if key in seen:
            continue
        seen.add(key)
        start = clock()
        runner.warmup([(layout, mode)])
        built.append((mode, layout, context, key, clock() - start))
        if progress:
            progress(f"compiled {key}")
    times: list[list[float]] = [[] for _ in built]
    for _ in _rounds(s.repeats, progress):
        for seconds, (mode, layout, context, _, _) in zip(times, built):
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            kv = KVCache.holding(model, context, max(layout.kv_lens))
            start = clock()
            runner.run(ids, layout, mode, kv=kv, slots=range(layout.num_seqs))
            seconds.append(clock() - start)
    memory = {m.key: m for m in runner.stats().memory}
    return [StepSample(mode=key.mode.value, tokens=key.tokens, context=key.context, segments=key.segments,
                       compile_seconds=compile_s, run_seconds=statistics.median(run_s),
                       rss_bytes=memory[str(key)].rss_bytes, estimate_bytes=memory[str(key)].estimate_bytes)
            for (_, _, _, key, compile_s), run_s in zip(built, times)]


def _model_fits(samples: Sequence[ModelSample] | Sequence[StepSample], backend: str,
                value: Callable[[Any], float]) -> dict[Mode, ModelFit]:
    """Per mode, the fit of ``value`` over the ``samples`` of that mode."""
    return {m: ModelFit.to_samples([(x.key(backend), float(value(x))) for x in samples if x.mode == m])
            for m in MODEL_COST_MODES}
