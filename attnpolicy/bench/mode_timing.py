"""Modes timed side by side (``attnpolicy bench``): one pipeline over the levels.

A level (:class:`BenchLevel`) names its shapes (:class:`BenchShape`: a total length L in
n sequences, split equally or spread, :func:`grid`) and prepares one run per mode it
compares at a shape (:func:`modes_for`, at both levels); the runs are interleaved
within each repeat so drift on a shared machine hits all alike (:func:`interleaved`).
Each (shape, mode) becomes one :class:`BenchRow` of the ms of each measure per round;
a shape's modes are put side by side in one :class:`Ratio` (:func:`ratios`). What the
levels really differ in:

* :class:`AttentionBench`: packed q/k/v through one uncompiled attention call per
  mode. MASK's time includes building its dense mask on the host (uncached), as a
  runtime without a mask cache pays it; the build is also measured on its own.
* :class:`WholeModelBench` (``bench --model``): the shape's sequences through a
  :class:`~attnpolicy.engine.runner.StaticModelRunner` in each mode: each mode's
  graph is compiled once (its compile seconds and memory measured by the runner),
  then the compiled graph and the same forward uncompiled (backend ``"none"``) are
  timed on the same inputs. Times are the graph call alone: the MASK graph's mask is
  an input built before timing, as a runtime that caches masks per layout pays it.

A new mode is one entry in :func:`modes_for`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import torch

from attnpolicy.bench.settings import BenchSettings, Split
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.execute import attend, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.kernels.masks import mask_for

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

BENCH_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: A median this many times its run's minimum is flagged as noisy.
NOISY = 2.0
#: The lengths of ``bench --model`` unless told otherwise.
MODEL_LENGTHS = (128, 512, 1024, 2048, 4096)

#: One timed round of one mode: ms per measure.
Sample = dict[str, float]
#: One mode's timed round at one shape, ready to call.
Run = Callable[[], Sample]


def split_lengths(total: int, n: int, split: Split = "equal") -> list[int]:
    """``n`` lengths summing to ``total``: as equal as possible, or ``spread``: sequence
    i (from 1) about i / (1 + ... + n) of the tokens beyond one each."""
    if split == "equal":
        base, extra = divmod(total, n)
        return [base + (i < extra) for i in range(n)]
    rest, whole = total - n, n * (n + 1)
    ends = [rest * k * (k + 1) // whole for k in range(n + 1)]  # the first k sequences' share
    return [1 + b - a for a, b in zip(ends, ends[1:])]


@dataclass(frozen=True)
class BenchShape:
    """One timed shape: ``seq_len`` tokens in ``num_seqs`` sequences split as ``split``."""

    seq_len: int
    num_seqs: int
    split: Split = "equal"

    def layout(self) -> BatchLayout:
        return BatchLayout.from_lens(split_lengths(self.seq_len, self.num_seqs, self.split))


def grid(lengths: Iterable[int], seqs: Iterable[int], splits: Sequence[Split]) -> list[BenchShape]:
    """Every (length, sequences, split) in that order; one sequence once, under the
    first of ``splits`` (every split of one sequence is the same)."""
    return [BenchShape(length, n, split) for length in lengths for n in seqs
            for split in (splits if n > 1 else splits[:1])]


@dataclass(frozen=True)
class BenchRow:
    """One (shape, mode): each measure's ms per timed round, and what the level knows
    of the mode's graph (``facts``: the whole model's compile seconds and memory)."""

    seq_len: int
    num_seqs: int
    mode: str
    samples: Mapping[str, tuple[float, ...]]
    facts: Mapping[str, float | None] = field(default_factory=dict)
    split: Split = "equal"

    def median(self, measure: str) -> float:
        return statistics.median(self.samples[measure])


@dataclass(frozen=True)
class Ratio:
    """One shape's modes side by side: on the level's ranking measure, the faster of the
    two fastest modes and the slower/faster median ratio, ``noisy`` when a median is more
    than :data:`NOISY` times its minimum; ``over``: per measure every mode has, each
    mode's median over the shape's first mode's."""

    seq_len: int
    num_seqs: int
    faster: str
    slower: str
    ratio: float
    noisy: bool = False
    over: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    split: Split = "equal"


def ratios(rows: Iterable[BenchRow], measure: str) -> list[Ratio]:
    """Per shape of ``rows`` (in order): its modes side by side, ranked by ``measure``."""
    groups: dict[tuple[int, int, Split], list[BenchRow]] = {}
    for row in rows:
        groups.setdefault((row.seq_len, row.num_seqs, row.split), []).append(row)
    out = []
    for (length, n, split), group in groups.items():
        fast, slow = sorted(group, key=lambda r: r.median(measure))[:2] if len(group) > 1 else (group[0], group[0])
        noisy = any(r.median(measure) > NOISY * min(r.samples[measure]) for r in group)
        first = group[0]
        over = {m: {r.mode: r.median(m) / first.median(m) for r in group}
                for m in first.samples if all(m in r.samples for r in group)}
        out.append(Ratio(length, n, fast.mode, slow.mode, slow.median(measure) / fast.median(measure), noisy, over,
                         split))
    return out


def interleaved(runs: Mapping[K, Callable[[], T]], warmup: int, repeats: int) -> dict[K, list[T]]:
    """Each run's results of ``repeats`` rounds after ``warmup`` discarded ones; every
    round calls each run once, in order (drift on a shared machine hits all alike)."""
    out: dict[K, list[T]] = {key: [] for key in runs}
    for r in range(warmup + repeats):
        for key, run in runs.items():
            result = run()
            if r >= warmup:
                out[key].append(result)
    return out


class BenchLevel(Protocol):
    """What differs between the levels :func:`run_bench` times at."""

    @property
    def warmup(self) -> int: ...

    @property
    def repeats(self) -> int: ...

    @property
    def threads(self) -> int | None: ...

    #: The measure that ranks the modes (:class:`Ratio`).
    @property
    def measure(self) -> str: ...

    def shapes(self) -> list[BenchShape]:
        """The shapes timed, in order."""

    def start(self) -> None:
        """Load what every shape needs (after the threads are set)."""

    def runs(self, shape: BenchShape) -> Mapping[MaskMode, Run]:
        """One ready run per mode compared at a shape, each returning one round's sample."""

    def facts(self, shape: BenchShape, mode: MaskMode) -> dict[str, float | None]:
        """What the level knows of a mode's graph after its timing."""

    def close(self) -> None:
        """Release what :meth:`start` loaded."""

    def to_json(self, rows: Sequence[BenchRow]) -> dict[str, Any]:
        """What ``bench --json`` writes of ``rows``."""


def run_bench(level: BenchLevel, advance: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Time every (shape, mode) of ``level``, modes interleaved; one row each."""
    if level.threads:
        torch.set_num_threads(level.threads)
    level.start()
    rows: list[BenchRow] = []
    try:
        for shape in level.shapes():
            timed = interleaved(level.runs(shape), level.warmup, level.repeats)
            rows += [BenchRow(shape.seq_len, shape.num_seqs, mode.value,
                              {m: tuple(s[m] for s in samples) for m in samples[0]}, level.facts(shape, mode),
                              shape.split) for mode, samples in timed.items()]
            if advance is not None:
                advance(f"L={shape.seq_len} n={shape.num_seqs} {shape.split}")
    finally:
        level.close()
    return rows


# -- attention calls ---------------------------------------------------------------------


def modes_for(num_seqs: int) -> tuple[MaskMode, ...]:
    """The modes compared at ``num_seqs`` sequences (both levels), the first the one the others are divided by."""
    if num_seqs == 1:
        return MaskMode.CAUSAL, MaskMode.MASK, MaskMode.ROWS
    return MaskMode.MASK, MaskMode.VARLEN, MaskMode.ROWS


def _time_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
               s: BenchSettings) -> tuple[float, float]:
    """Total and mask-build seconds of one MASK call that builds its mask afresh."""
    (call,) = plan_calls(layout, MaskMode.MASK)
    fn = graph_fn(call, s.impl, None, s.partition_len)
    assert not isinstance(fn, FlexGraph)  # the dense-mask implementations only
    t0 = time.perf_counter()
    mask = mask_for(layout).materialize()
    t1 = time.perf_counter()
    fn(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask).transpose(0, 1)
    return time.perf_counter() - t0, t1 - t0


def time_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, mode: MaskMode,
              s: BenchSettings) -> tuple[float, float | None]:
    """Seconds of one uncompiled call in ``mode``, and of its mask build (MASK only)."""
    if mode is MaskMode.MASK:
        return _time_mask(q, k, v, layout, s)
    t0 = time.perf_counter()
    attend(q, k, v, layout, mode, s.impl, partition_len=s.partition_len)
    return time.perf_counter() - t0, None


def _attention_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, mode: MaskMode,
                      s: BenchSettings) -> Sample:
    """One round of :func:`time_mode` (inference mode), in ms: ``call``, and ``mask_build`` where built."""
    with torch.inference_mode():
        total, build = time_mode(q, k, v, layout, mode, s)
    return {"call": total * 1e3} | ({} if build is None else {"mask_build": build * 1e3})


class AttentionBench:
    """``bench``: packed q/k/v of :class:`BenchSettings` through one attention call per mode."""

    measure = "call"

    def __init__(self, settings: BenchSettings) -> None:
        self.settings = settings
        self.warmup, self.repeats, self.threads = settings.warmup, settings.repeats, settings.threads

    def shapes(self) -> list[BenchShape]:
        return grid(self.settings.lengths, self.settings.seqs, self.settings.splits)

    def start(self) -> None:
        self._gen = torch.Generator().manual_seed(self.settings.seed)

    def runs(self, shape: BenchShape) -> Mapping[MaskMode, Run]:
        s, dtype = self.settings, BENCH_TORCH_DTYPES[self.settings.dtype]
        q, k, v = (torch.randn(shape.seq_len, heads, s.head_dim, generator=self._gen).to(dtype)
                   for heads in (s.heads, s.kv_heads, s.kv_heads))
        layout = shape.layout()
        return {mode: partial(_attention_sample, q, k, v, layout, mode, s) for mode in modes_for(shape.num_seqs)}

    def facts(self, shape: BenchShape, mode: MaskMode) -> dict[str, float | None]:
        return {}

    def close(self) -> None:
        pass

    def row_json(self, row: BenchRow) -> dict[str, Any]:
        call = row.samples["call"]
        return {"seq_len": row.seq_len, "num_seqs": row.num_seqs, "split": row.split, "mode": row.mode,
                "impl": self.settings.impl,
                "median_ms": row.median("call"), "min_ms": min(call), "max_ms": max(call),
                "mask_build_ms": row.median("mask_build") if "mask_build" in row.samples else None}

    def to_json(self, rows: Sequence[BenchRow]) -> dict[str, Any]:
        """``bench --json``: the rows, the speedups and what they ran on."""
        s = self.settings
        return {"rows": [self.row_json(r) for r in rows],
                "speedups": [{"seq_len": r.seq_len, "num_seqs": r.num_seqs, "split": r.split, "faster": r.faster,
                              "slower": r.slower, "ratio": r.ratio, "noisy": r.noisy}
                             for r in ratios(rows, self.measure)],
                "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": s.dtype,
                        "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "impl": s.impl,
                        "repeats": s.repeats, "warmup": s.warmup}}


# -- whole-model forwards ----------------------------------------------------------------


def _ms(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> float:
    t0 = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - t0) * 1e3


def _model_sample(graph: Callable[..., Any], plain: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> Sample:
    """One round (no grad), in ms: ``compiled``, one call of the graph, then ``eager``,
    one of the uncompiled forward, on ``inputs``."""
    with torch.no_grad():
        return {"compiled": _ms(graph, inputs), "eager": _ms(plain, inputs)}


class WholeModelBench:
    """``bench --model``: the whole forward of the model ``spec`` names over each shape
    of ``lengths`` x ``seqs`` x ``splits`` (:func:`grid`), compiled (``backend``) and plain."""

    measure = "compiled"

    def __init__(self, spec: str, lengths: tuple[int, ...] = MODEL_LENGTHS, *, seqs: tuple[int, ...] = (1,),
                 splits: tuple[Split, ...] = ("equal",), backend: str = "inductor", repeats: int = 5,
                 warmup: int = 1, threads: int | None = 1) -> None:
        self.spec, self.lengths, self.seqs, self.splits, self.backend = spec, lengths, seqs, splits, backend
        self.warmup, self.repeats, self.threads = warmup, repeats, threads
        #: the spec as loaded (every field), once :meth:`start` has loaded it
        self.described = spec

    def shapes(self) -> list[BenchShape]:
        return grid(self.lengths, self.seqs, self.splits)

    def start(self) -> None:
        model, self.described = load_model(self.spec)
        top = max(self.lengths)
        # exact buckets and one rows bucket per sequence count: every graph holds its shape, no padding
        cfg = AttnPolicyConfig(policy="always-mask", backend=self.backend, buckets=Buckets(kind="exact"),
                               max_seq_len=top, max_batch_tokens=top, row_buckets=tuple(sorted(set(self.seqs))))
        self._vocab = model.config.vocab_size
        self._compiled = StaticModelRunner(model, cfg)
        self._eager = StaticModelRunner(model, cfg.model_copy(update={"backend": "none"}))

    def runs(self, shape: BenchShape) -> Mapping[MaskMode, Run]:
        layout = shape.layout()
        ids = torch.randint(0, self._vocab, (shape.seq_len,), generator=torch.Generator().manual_seed(shape.seq_len))
        runs = {}
        for mode in modes_for(shape.num_seqs):
            batch = self._compiled.prepare(ids, layout, mode)
            runs[mode] = partial(_model_sample, self._compiled.graph_for(batch),
                                 self._eager.graph_for(self._eager.prepare(ids, layout, mode)), batch.inputs)
        return runs

    def facts(self, shape: BenchShape, mode: MaskMode) -> dict[str, float | None]:
        """The compile seconds and memory of the mode's compiled graph (from the runner;
        shapes of one graph, as MASK's at one length, share its build's)."""
        (key,) = map(str, self._compiled.keys_for(shape.layout(), mode))
        mem = next(m for m in self._compiled.stats().memory if m.key == key)
        return {"compile_s": mem.compile_seconds, "rss_mib": mem.rss_bytes / 2**20,
                "estimate_mib": mem.estimate_bytes / 2**20,
                "device_mib": None if mem.device_bytes is None else mem.device_bytes / 2**20}

    def close(self) -> None:
        self._compiled.close()

    def row_json(self, row: BenchRow) -> dict[str, Any]:
        f = row.facts
        return {"seq_len": row.seq_len, "num_seqs": row.num_seqs, "split": row.split, "mode": row.mode,
                "compile_s": f["compile_s"], "compiled_ms": row.median("compiled"), "eager_ms": row.median("eager"),
                "rss_mib": f["rss_mib"], "estimate_mib": f["estimate_mib"], "device_mib": f["device_mib"]}

    def to_json(self, rows: Sequence[BenchRow]) -> dict[str, Any]:
        """``bench --model --json``: what was measured, on what; ``ratios``: per shape,
        compiled and eager, each mode's median over the shape's first mode's."""
        return {"model": self.described, "backend": self.backend, "threads": torch.get_num_threads(),
                "repeats": self.repeats, "rows": [self.row_json(r) for r in rows],
                "ratios": [{"seq_len": r.seq_len, "num_seqs": r.num_seqs, "split": r.split, **r.over}
                           for r in ratios(rows, self.measure)]}
