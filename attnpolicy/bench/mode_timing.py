"""Mask vs mask-free attention, timed side by side (``attnpolicy bench``).

For each total length L and sequence count n (n sequences of about L/n tokens):
n = 1 compares CAUSAL with MASK, n > 1 compares MASK with VARLEN. Modes are
interleaved within each repeat so drift on a shared machine hits all alike.
MASK's time includes building its dense mask on the host (uncached), as a runtime
without a mask cache pays it; the build is also reported on its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from attnpolicy.bench.settings import BenchSettings
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.execute import attend, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.kernels.masks import mask_for

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

BENCH_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BenchRow:
    seq_len: int
    num_seqs: int
    mode: str
    impl: str
    median_ms: float
    min_ms: float
    max_ms: float
    mask_build_ms: float | None = None


#: A median this many times its run's minimum is flagged as noisy.
NOISY = 2.0
@dataclass(frozen=True)
class Speedup:
    """Per (length, sequences): the faster mode and the slower/faster median ratio;
    ``noisy`` when a median is more than :data:`NOISY` times its minimum."""

    seq_len: int
    num_seqs: int
    faster: str
    slower: str
    ratio: float
    noisy: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def split_lengths(total: int, n: int) -> list[int]:
    """``n`` lengths summing to ``total``, as equal as possible."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def modes_for(num_seqs: int) -> tuple[MaskMode, MaskMode]:
    return (MaskMode.CAUSAL, MaskMode.MASK) if num_seqs == 1 else (MaskMode.MASK, MaskMode.VARLEN)


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


def run_bench(s: BenchSettings, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Time every (length, n, mode) of ``s``; returns one row per (length, n, mode)."""
    if s.threads:
        torch.set_num_threads(s.threads)
    dtype = BENCH_TORCH_DTYPES[s.dtype]
    gen = torch.Generator().manual_seed(s.seed)
    rows: list[BenchRow] = []
    for length in s.lengths:
        for n in s.seqs:
            layout = BatchLayout.from_lens(split_lengths(length, n))
            q = torch.randn(length, s.heads, s.head_dim, generator=gen).to(dtype)
            k = torch.randn(length, s.kv_heads, s.head_dim, generator=gen).to(dtype)
            v = torch.randn(length, s.kv_heads, s.head_dim, generator=gen).to(dtype)
            modes = modes_for(n)
            with torch.inference_mode():
                timed = interleaved({mode: partial(time_mode, q, k, v, layout, mode, s) for mode in modes},
                                    s.warmup, s.repeats)
            builds = [build for mode in modes for _, build in timed[mode] if build is not None]
            for mode in modes:
                ms = [t * 1e3 for t, _ in timed[mode]]
                rows.append(BenchRow(length, n, mode.value, s.impl, statistics.median(ms), min(ms), max(ms),
                                     statistics.median(builds) * 1e3 if mode is MaskMode.MASK else None))
            if progress:
                progress(f"L={length} n={n}")
    return rows


def speedups(rows: Iterable[BenchRow]) -> list[Speedup]:
    """Per (length, n): the faster mode and slower/faster median ratio."""
    groups: dict[tuple[int, int], list[BenchRow]] = {}
    for row in rows:
        groups.setdefault((row.seq_len, row.num_seqs), []).append(row)
    out = []
    for (length, n), pair in groups.items():
        fast, slow = sorted(pair, key=lambda r: r.median_ms)[:2] if len(pair) > 1 else (pair[0], pair[0])
        noisy = any(r.median_ms > NOISY * r.min_ms for r in pair)
        out.append(Speedup(length, n, fast.mode, slow.mode, slow.median_ms / fast.median_ms, noisy))
    return out


def environment(s: BenchSettings) -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": s.dtype,
            "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "impl": s.impl,
            "repeats": s.repeats, "warmup": s.warmup}


def to_json(s: BenchSettings, rows: list[BenchRow]) -> dict[str, Any]:
    return {"rows": [asdict(r) for r in rows], "speedups": [sp.to_json() for sp in speedups(rows)],
            "env": environment(s)}
