"""Replay a workload through a real Dispatcher: real tensors, real compiles, real time.

Each step of the batch former becomes one ``Dispatcher.attend`` call on random
tensors of the step's layout (one attention layer). Time a call stalled on a
compile (compiling synchronously, or waiting for a background compile at its
switch point: the dispatcher's stall seconds) is compile time; the rest of the call
is attention time. With ``check`` every output is compared with a float64
per-sequence reference (uncompiled VARLEN through the ``eager`` kernel).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.traces import Request

#: Largest absolute error against the float64 reference that ``check`` accepts, per dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class RunResult:
    """What a real replay measured. ``cache`` is the graph cache's stats, ``modes``
    counts batches per mode; ``compile_seconds`` are the seconds batches stalled on
    compiles, ``stalls`` and ``background`` the dispatcher's figures (see
    docs/cache.md); ``max_abs_err``, ``tolerance`` and ``passed`` are
    ``None`` unless outputs were checked against the reference; ``switch`` counts the
    switches to re-planned configs (see docs/plan.md), a switch still pending after the
    last batch waited for and applied then (``switch_at_end``): the figures do not
    depend on how fast its graphs built."""

    cache: dict[str, Any]
    modes: dict[str, int]
    batches: int
    calls: int
    guard_fallbacks: int
    overflow: int
    padding: dict[str, Any]
    attention_seconds: float
    compile_seconds: float
    total_seconds: float
    max_abs_err: float | None
    tolerance: float | None
    passed: bool | None
    config: dict[str, Any]
    spec: dict[str, Any]
    stalls: dict[str, Any]
    background: dict[str, Any]
    warmup_graphs: int = 0
    warmup_seconds: float = 0.0
    compiles_after_warmup: int = 0
    strict_violations: int = 0
    startup_seconds: float = 0.0
    warmup_loads: int = 0
    disk: dict[str, Any] | None = None
    switch: dict[str, Any] | None = None
    switch_at_end: bool = False

    def to_json(self) -> dict[str, Any]:
        """The result as JSON: one key per field."""
        return asdict(self)


def _pool(rows: int, heads: int, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, heads, spec.head_dim, generator=gen).to(getattr(torch, spec.dtype))


def run_workload(requests: Sequence[Request], config: AttnPolicyConfig, spec: TensorSpec,
                 former: BatchFormer | None = None, *, check: bool = False, seed: int = 0,
                 progress: Callable[[str], None] | None = None,
                 steps: Sequence[ScheduledBatch] | None = None,
                 observe: Callable[[Dispatcher, BatchLayout], object] | None = None,
                 cost_model: CostModel | None = None) -> RunResult:
    """Run every step of ``requests`` (or the given ``steps``) through a Dispatcher;
    with ``check``, compare every output with the float64 reference. A config with a
    warm set (``warmup``) is warmed first: its compile seconds are
    ``warmup_seconds``, not part of the replay's, and ``compiles_after_warmup`` counts
    the replay's compiles; ``startup_seconds`` runs from building the dispatcher until
    its warm set is ready (loaded from ``store_dir``, or compiled), ``warmup_loads``
    counts the warm graphs loaded, ``disk`` is the store's stats (``None`` without one).
    ``observe(dispatcher, layout)`` is called after each batch has run (e.g.
    :meth:`Replanner.observe <attnpolicy.planning.replan.Replanner.observe>`).
    ``cost_model``: the dispatcher's (cost-aware's prices, the cost eviction's), the
    built-in one if None. A switch ``observe`` requested that is still pending after the
    last batch is waited for and applied (``switch_at_end``)."""
    if steps is None:
        steps = list((former or BatchFormer(max_model_len=config.max_seq_len)).steps(requests))
    start = time.perf_counter()
    with Dispatcher(config, cost_model=cost_model) as dispatcher:
        return _run(dispatcher, steps, config, spec, check, seed, progress, start, observe)


def _run(dispatcher: Dispatcher, steps: Sequence[ScheduledBatch], config: AttnPolicyConfig, spec: TensorSpec,
         check: bool, seed: int, progress: Callable[[str], None] | None, start: float,
         observe: Callable[[Dispatcher, BatchLayout], object] | None = None) -> RunResult:
    warm_keys = dispatcher.warmup(spec) if config.warmup else []
    startup = time.perf_counter() - start  # the dispatcher built and its warm set ready
    warm = dispatcher.cache.stats()
    gen = torch.Generator().manual_seed(seed)
    max_q = max((s.layout.q_tokens for s in steps), default=1)
    max_kv = max((s.layout.kv_tokens for s in steps), default=1)
    q_pool = _pool(max_q, spec.heads, spec, gen)
    k_pool, v_pool = (_pool(max_kv, spec.kv_heads, spec, gen) for _ in range(2))
    total = compile_total = 0.0
    max_err = 0.0
    with torch.inference_mode():
        for step in steps:
            lay = step.layout
            q, k, v = q_pool[:lay.q_tokens], k_pool[:lay.kv_tokens], v_pool[:lay.kv_tokens]
            stalled_before = dispatcher.stall_seconds
            t0 = time.perf_counter()
            out = dispatcher.attend(q, k, v, lay, spec.scale)
            total += time.perf_counter() - t0
            compile_total += dispatcher.stall_seconds - stalled_before
            if check:
                ref = attend(q.double(), k.double(), v.double(), lay, MaskMode.VARLEN, "eager",
                             scale=spec.scale)
                max_err = max(max_err, float((out.double() - ref).abs().max()))
            if observe is not None:
                observe(dispatcher, lay)
            if progress:
                progress(f"step {step.index}")
    finished = dispatcher.finish_switch()
    stats = dispatcher.stats().to_json()
    tolerance = TOLERANCE[spec.dtype] if check else None
    return RunResult(
        cache=dict(stats["cache"]),
        modes=dict(stats["modes"]),
        batches=stats["batches"],
        calls=stats["calls"],
        guard_fallbacks=stats["guard_fallbacks"],
        overflow=stats["overflow"],
        padding=dict(stats["padding"]),
        attention_seconds=total - compile_total,
        compile_seconds=compile_total,
        total_seconds=total,
        max_abs_err=max_err if check else None,
        tolerance=tolerance,
        passed=None if tolerance is None else max_err <= tolerance,
        config=config.model_dump(mode="json"),
        spec={"dtype": spec.dtype, "heads": spec.heads, "kv_heads": spec.kv_heads,
              "head_dim": spec.head_dim},
        stalls=dict(stats["stalls"]),
        background=dict(stats["background"]),
        warmup_graphs=len(warm_keys),
        warmup_seconds=warm.compile_seconds,
        compiles_after_warmup=stats["cache"]["compiles"] - warm.compiles,
        strict_violations=stats["strict_violations"],
        startup_seconds=startup,
        warmup_loads=warm.loads,
        disk=None if stats["disk"] is None else dict(stats["disk"]),
        switch=dict(stats["switch"]),
        switch_at_end=finished,
    )
