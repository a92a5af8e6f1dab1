"""Whole-model forward, CAUSAL vs MASK, one sequence per length (``attnpolicy bench --model``).

For each length L one sequence of L tokens runs through a
:class:`~attnpolicy.engine.runner.StaticModelRunner` in CAUSAL and in
MASK mode: each mode's graph is compiled once (its compile seconds and memory
measured by the runner), then the compiled graph and the same forward uncompiled
(backend ``"none"``) are timed on the same inputs, modes interleaved within each
repeat. Times are the graph call alone: the MASK graph's mask is an input built
before timing, as a runtime that caches masks per layout pays it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from attnpolicy.bench.mode_timing import interleaved
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.graphs.buckets import Buckets

#: The lengths of ``bench --model`` unless told otherwise.
MODEL_LENGTHS = (128, 512, 1024, 2048, 4096)
TIMED_MODES = (MaskMode.CAUSAL, MaskMode.MASK)


@dataclass(frozen=True, slots=True)
class ModelBenchRow:
    """One (length, mode): compile seconds and memory of its graph, median compiled and
    eager forward ms."""

    seq_len: int
    mode: str
    compile_s: float
    compiled_ms: float
    eager_ms: float
    rss_mib: float
    estimate_mib: float
    device_mib: float | None


@dataclass(frozen=True, slots=True)
class ModelRatio:
    """MASK over CAUSAL median time at one length, compiled and eager."""

    seq_len: int
    compiled: float
    eager: float


@dataclass(frozen=True, slots=True)
class ModelBench:
    """What ``bench --model`` measured, and on what."""

    model: str
    backend: str
    threads: int
    repeats: int
    rows: tuple[ModelBenchRow, ...]

    def ratios(self) -> tuple[ModelRatio, ...]:
        by = {(r.seq_len, r.mode): r for r in self.rows}
        return tuple(ModelRatio(n, by[(n, "mask")].compiled_ms / by[(n, "causal")].compiled_ms,
                                by[(n, "mask")].eager_ms / by[(n, "causal")].eager_ms)
                     for n in dict.fromkeys(r.seq_len for r in self.rows))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratios": [asdict(r) for r in self.ratios()]}


def _ms(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> float:
    t0 = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - t0) * 1e3


def _both_ms(graph: Callable[..., Any], plain: Callable[..., Any], inputs: tuple[torch.Tensor, ...]
             ) -> tuple[float, float]:
    """The ms of one compiled call and then of one uncompiled call on ``inputs``."""
    return _ms(graph, inputs), _ms(plain, inputs)


def run_model_bench(spec: str, lengths: tuple[int, ...] = MODEL_LENGTHS, *, backend: str = "inductor",
                    repeats: int = 5, warmup: int = 1, threads: int | None = 1,
                    advance: Callable[[str], None] | None = None) -> ModelBench:
    """Time the whole forward of the model ``spec`` names (see the module docstring)."""
    if threads is not None:
        torch.set_num_threads(threads)
    model, described = load_model(spec)
    top = max(lengths)
    cfg = AttnPolicyConfig(policy="always-mask", backend=backend, buckets=Buckets(kind="exact"),
                           max_seq_len=top, max_batch_tokens=top)
    compiled = StaticModelRunner(model, cfg)
    eager = StaticModelRunner(model, cfg.model_copy(update={"backend": "none"}))
    rows = []
    for n in lengths:
        layout = BatchLayout.from_lens([n])
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        runs = {}
        for mode in TIMED_MODES:
            batch = compiled.prepare(ids, layout, mode)
            runs[mode] = (compiled.graph_for(batch), eager.graph_for(eager.prepare(ids, layout, mode)), batch.inputs)
        with torch.no_grad():
            times = interleaved({mode: partial(_both_ms, *run) for mode, run in runs.items()}, warmup, repeats)
        memory = {m.key: m for m in compiled.stats().memory}
        for mode in TIMED_MODES:
            mem = memory[str(compiled.key_for(layout, mode))]
            rows.append(ModelBenchRow(n, mode.value, mem.compile_seconds, statistics.median(c for c, _ in times[mode]),
                                      statistics.median(e for _, e in times[mode]), mem.rss_bytes / 2**20,
                                      mem.estimate_bytes / 2**20,
                                      None if mem.device_bytes is None else mem.device_bytes / 2**20))
        if advance is not None:
            advance(f"L={n}")
    compiled.close()
    return ModelBench(described, backend, torch.get_num_threads(), repeats, tuple(rows))
