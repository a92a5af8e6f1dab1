"""The dispatcher's overhead: ``Dispatcher.attend`` against the bare kernel it runs.

The bare kernel is the cheapest code computing the same batch without attnpolicy:
the per-sequence SDPA loop (slice, ``is_causal`` SDPA, write back) for a policy that
runs CAUSAL or VARLEN, one SDPA call with the dense mask (built beforehand) for
MASK. Each repeat times the bare kernel, then ``attend``, then the bare kernel
again; the overhead of the repeat is ``attend`` minus the mean of the two bare
times, and the reported figure is the median over repeats (drift on a shared
machine cancels). Graphs are compiled before timing; only cached calls are timed.

:func:`measure_decisions` times the policy's decisions alone (``Dispatcher.decide``)
over the layout stream of the built-in workload, priced with the built-in cost model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode, legal_modes
from attnpolicy.dispatch import Dispatcher
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.masks import mask_for
from attnpolicy.modelling.simulation import SimulatedGraph, simulation_config
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import synthetic_default

#: (sequences, tokens per sequence) of the overhead table.
SHAPES = ((1, 16), (1, 128), (4, 256), (16, 64))
OVERHEAD_POLICIES = ("varlen", "dynamic", "always-mask", "cost-aware")
OVERHEAD_BACKENDS = ("none", "eager", "aot_eager", "inductor")


@dataclass(frozen=True)
class OverheadRow:
    """One (backend, policy, shape): medians in µs over interleaved repeats."""

    backend: str
    policy: str
    num_seqs: int
    seq_len: int
    mode: str
    graph_calls: int
    bare_us: float
    attend_us: float
    overhead_us: float


def bare_kernel(layout: BatchLayout, mode: MaskMode, device: str = "cpu") -> Callable[..., torch.Tensor]:
    """The attention of ``layout`` in ``mode`` without attnpolicy (see the module doc)."""
    if mode is MaskMode.MASK:
        mask = mask_for(layout).dense(layout.q_tokens, layout.kv_tokens, device)[None, None]

        def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            gqa = q.shape[1] != k.shape[1]
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        return dense
    rows = tuple(zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens))

    def loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for qs, ql, ks, kl in rows:
            o = F.scaled_dot_product_attention(
                q[qs:qs + ql].transpose(0, 1)[None], k[ks:ks + kl].transpose(0, 1)[None],
                v[ks:ks + kl].transpose(0, 1)[None], is_causal=layout.causal, enable_gqa=gqa)
            out[qs:qs + ql] = o[0].transpose(0, 1)
        return out
    return loop


def _per_call_us(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e6


def measure_overhead(backend: str, policy: str, num_seqs: int, seq_len: int, *, heads: int = 8,
                     kv_heads: int = 8, head_dim: int = 64, repeats: int = 15,
                     budget_s: float = 0.02) -> OverheadRow:
    """Time ``attend`` and its bare kernel interleaved (each timing ~``budget_s``)."""
    layout = BatchLayout.from_lens([seq_len] * num_seqs)
    g = torch.Generator().manual_seed(0)
    n = layout.q_tokens
    q, k, v = (torch.randn(n, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cfg = AttnPolicyConfig.model_validate({"policy": policy, "backend": backend, "max_seq_len": max(seq_len, 16),
                                           "max_batch_tokens": max(n, 16)})
    d = Dispatcher(cfg)
    with torch.inference_mode():
        d.attend(q, k, v, layout)  # compile
        mode = d.preview(layout, TensorSpec.of(q, k)).mode
        bare = bare_kernel(layout, mode)
        torch.testing.assert_close(d.attend(q, k, v, layout), bare(q, k, v), atol=1e-4, rtol=1e-4)
        stats = d.stats()
        calls = stats.calls // stats.batches
        one = _per_call_us(lambda: bare(q, k, v), 3) / 1e6
        number = max(1, int(budget_s / max(one, 1e-7)))
        bares, attends, overheads = [], [], []
        for _ in range(repeats):
            b1 = _per_call_us(lambda: bare(q, k, v), number)
            a = _per_call_us(lambda: d.attend(q, k, v, layout), number)
            b2 = _per_call_us(lambda: bare(q, k, v), number)
            bares.append((b1 + b2) / 2)
            attends.append(a)
            overheads.append(a - (b1 + b2) / 2)
    return OverheadRow(backend, policy, num_seqs, seq_len, mode.value, calls, statistics.median(bares),
                       statistics.median(attends), statistics.median(overheads))


def run_overhead(backends: Iterable[str] = OVERHEAD_BACKENDS, policies: Iterable[str] = OVERHEAD_POLICIES,
                 shapes: Iterable[tuple[int, int]] = SHAPES, *, threads: int | None = 1,
                 advance: Callable[[], None] = lambda: None, **options: float) -> list[OverheadRow]:
    """:func:`measure_overhead` for every backend × policy × shape (``threads`` torch
    threads; 1 by default, so the kernel does not hide the Python around it)."""
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    for backend in backends:
        for policy in policies:
            for num_seqs, seq_len in shapes:
                rows.append(measure_overhead(backend, policy, num_seqs, seq_len, **options))  # type: ignore[arg-type]
                advance()
    return rows


@dataclass(frozen=True)
class DecisionRow:
    """Per-decision medians in µs of one policy over a layout stream: ``cold`` as the
    stream comes (a new layout's plans are built inside its decision when the policy
    prices them), ``warm`` with every legal mode planned beforehand (the decision alone)."""

    policy: str
    decisions: int
    cold_us: float
    warm_us: float


def measure_decisions(policy: str, requests: int = 200, *, max_graphs: int | None = 16) -> DecisionRow:
    """Time ``Dispatcher.decide`` per batch of the built-in workload (``requests``
    requests, the default batch former), each batch's graphs then fetched from a cache
    of ``max_graphs`` holding stand-ins (nothing compiles), as a simulation runs."""
    model = CostModel.default()
    former = BatchFormer()
    layouts = [step.layout for step in former.steps(synthetic_default(requests))]
    spec = model.spec
    medians = []
    for warm in (False, True):
        cfg = simulation_config(model, former, policy=policy, max_graphs=max_graphs)
        d = Dispatcher(cfg, cost_model=model, builder=lambda call, key, spec: SimulatedGraph(key))
        ctx = d.context_for(spec)
        times = []
        for layout in layouts:
            if warm:
                for mode in legal_modes(layout):
                    ctx.keys_for(layout, mode)
            start = time.perf_counter()
            decision = d.decide(layout, spec)
            times.append(time.perf_counter() - start)
            d.prepare(layout, spec, decision)
            d.release_batch()
        medians.append(statistics.median(times) * 1e6)
    return DecisionRow(policy, len(layouts), medians[0], medians[1])
