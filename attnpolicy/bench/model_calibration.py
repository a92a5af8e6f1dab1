"""Calibrate a :class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` on this machine.

Every sample goes through the real :class:`~attnpolicy.engine.runner.StaticModelRunner`
of the SPEC's model: one graph per (mode, segment buckets) of the grid is built
through the runner's graph cache (compile and first run, timed), then batches of
its key are run through :meth:`~attnpolicy.engine.runner.StaticModelRunner.run`
(placement, graph, scatter: what a replay pays per batch), and the build's RSS delta
and static-shape estimate are taken from the runner's stats. Real lengths are three
quarters of each bucket. Seconds are process CPU seconds (``clock="cpu"``, stable on
a loaded machine; a backend's compile workers in other processes are not counted)
or wall seconds (``clock="wall"``). The first compile of the process is timed in a
throwaway runner: what it pays over the same key's later compile is ``warmup_seconds``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass as validated

from attnpolicy.bench.calibration import pow2_sizes
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.modelling.whole_model_costs import MODES, ModelCostModel, ModelDims, ModelFit, ModelSample

#: Grid sizes without ``sizes`` (``quick``: the first two only).
DEFAULT_SIZES = (16, 32, 64, 128, 256, 512)


@validated(frozen=True)
class ModelCalibrationSettings:
    """What ``attnpolicy calibrate --model`` measures; validated like the config."""

    spec: str = "qwen3"
    backend: Literal["aot_eager", "inductor", "eager"] = "aot_eager"
    #: the pow2 bucket sizes of the grid (default: :data:`DEFAULT_SIZES`)
    sizes: tuple[Annotated[int, Field(ge=16)], ...] | None = None
    repeats: Annotated[int, Field(ge=1)] = 3
    threads: Annotated[int, Field(ge=1)] = 1
    clock: Literal["cpu", "wall"] = "cpu"
    quick: bool = False

    @field_validator("sizes")
    @classmethod
    def _pow2(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return pow2_sizes(sizes)


def clock_of(name: str) -> Callable[[], float]:
    """The clock a model cost model's seconds are in: process CPU or wall."""
    return time.process_time if name == "cpu" else time.perf_counter


def _real(bucket: int) -> int:
    return bucket - bucket // 4


def grid(s: ModelCalibrationSettings) -> list[tuple[MaskMode, tuple[int, ...]]]:
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


def runner_config(s: ModelCalibrationSettings, max_len: int) -> AttnPolicyConfig:
    """The runner config of a calibration: pow2 buckets up to ``max_len``, unbounded cache."""
    return AttnPolicyConfig(policy="dynamic", backend=s.backend, buckets=Buckets(), max_seq_len=max_len,
                            max_batch_tokens=max(2 * max_len, 64))


def calibrate_model(s: ModelCalibrationSettings, progress: Callable[[str], None] | None = None
                    ) -> ModelCostModel:
    """Build and time every graph of :func:`grid` and fit a :class:`ModelCostModel`.
    ``progress(label)`` is called once per graph and once per timing round."""
    torch.set_num_threads(s.threads)
    model, described = load_model(s.spec)
    clock = clock_of(s.clock)
    shapes = grid(s)
    config = runner_config(s, max(max(lens) for _, lens in shapes) * 2)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    first_layout = BatchLayout.from_lens(list(shapes[0][1]))
    throwaway = StaticModelRunner(model, config)
    start = clock()
    throwaway.run(torch.zeros(first_layout.q_tokens, dtype=torch.long), first_layout, shapes[0][0])
    first = clock() - start
    throwaway.close()

    runner = StaticModelRunner(model, config)
    built = []
    try:
        for mode, lens in shapes:
            layout = BatchLayout.from_lens(list(lens))
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            batch = runner.prepare(ids, layout, mode)
            start = clock()
            runner.graph_for(batch)
            built.append((mode, layout, ids, batch.key, clock() - start))
            if progress:
                progress(f"compiled {batch.key}")
        times: list[list[float]] = [[] for _ in built]
        for r in range(s.repeats):
            for seconds, (mode, layout, ids, _, _) in zip(times, built):
                start = clock()
                runner.run(ids, layout, mode)
                seconds.append(clock() - start)
            if progress:
                progress(f"timing round {r + 1}/{s.repeats}")
        memory = {m.key: m for m in runner.stats().memory}
    finally:
        runner.close()
    samples = tuple(
        ModelSample(mode=key.mode.value, segments=key.segments, compile_seconds=compile_s,
                    run_seconds=statistics.median(run_s), rss_bytes=memory[str(key)].rss_bytes,
                    estimate_bytes=memory[str(key)].estimate_bytes)
        for (_, _, _, key, compile_s), run_s in zip(built, times))
    c = model.config
    dims = ModelDims(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                     head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                     intermediate=c.intermediate_size, vocab=c.vocab_size, layers=c.num_hidden_layers,
                     itemsize=next(model.parameters()).element_size())
    compile_fits = {m: _fit(samples, m, s.backend, lambda x: x.compile_seconds) for m in MODES}
    first_key = samples[0].key(s.backend)
    return ModelCostModel(
        spec=described, dims=dims, backend=s.backend, threads=torch.get_num_threads(), clock=s.clock,
        torch_version=torch.__version__, compile=compile_fits,
        run={m: _fit(samples, m, s.backend, lambda x: x.run_seconds) for m in MODES},
        rss={m: _fit(samples, m, s.backend, lambda x: max(x.rss_bytes, 1)) for m in MODES},
        warmup_seconds=max(0.0, first - compile_fits[first_key.mode.value](first_key)), samples=samples)


def _fit(samples: Sequence[ModelSample], mode: str, backend: str, value: Callable[[ModelSample], float]
         ) -> ModelFit:
    return ModelFit.to_samples([(x.key(backend), float(value(x))) for x in samples if x.mode == mode])
