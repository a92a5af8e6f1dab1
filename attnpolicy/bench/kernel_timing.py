"""Every registered implementation per call kind, timed side by side.

For each batch (``n`` causal sequences of ``L/n`` tokens) the baseline is the
per-sequence SDPA loop (no attnpolicy); each (kind, implementation) runs through
a :class:`~attnpolicy.dispatch.Dispatcher` whose policy forces the kind
(``varlen`` or ``always-mask``) and whose ``kernels`` pick the implementation.
Graphs are compiled and masks cached before timing (steady state); the mask build
(dense mask for MASK, block mask for ``flex``) is timed apart, uncached.
Implementations are interleaved within each repeat, every other repeat in reverse
order; times are medians, ``vs_loop`` the median of the per-repeat ratios.
``flex`` runs compiled with inductor (uncompiled FlexAttention materialises every
score); the others with the ``backend`` given. Plugins' kernels get their rows like
the built-ins, except where they cannot run: a kernel that cannot serve the batch
(dtype, GQA, causal, device, compilation: its declared capabilities) is not timed,
nor is a ``varlen`` kernel not also registered for ``causal`` (the ``varlen``
policy runs these causal batches, which have no cached context, through CAUSAL
graphs, with the implementation of the same name; a ``mask`` kernel without one
leaves them to ``sdpa``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from attnpolicy.bench.mode_timing import split_lengths
from attnpolicy.bench.overhead import bare_kernel
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.kernels.flex import build_block_mask
from attnpolicy.kernels.masks import mask_for
from attnpolicy.plugins.kernels import KernelInfo, impls_for, kernel_registry, why_unfit

POLICY = {"varlen": "varlen", "mask": "always-mask"}


@dataclass(frozen=True)
class KernelRow:
    """One implementation on one batch: median ms and its speed relative to the loop."""

    total_tokens: int
    num_seqs: int
    kv_heads: int
    family: str  # the call kind (``varlen``, ``mask``) or ``loop``; the JSON's name for it
    impl: str
    backend: str
    median_ms: float
    vs_loop: float  # median over repeats of loop time / this time (> 1: faster than the loop)
    build_ms: float | None = None  # dense mask or block mask, built uncached


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _build_ms(layout: BatchLayout, impl: str, repeats: int = 3) -> float:
    """Fastest of ``repeats`` uncached builds (the first block mask build also compiles)."""
    if impl == "flex":
        return min(_ms(lambda: build_block_mask(layout, layout.q_tokens, layout.kv_tokens)) for _ in range(repeats))
    return min(_ms(lambda: mask_for(layout).materialize(layout.q_tokens, layout.kv_tokens)) for _ in range(repeats))


def _runs(kind: str, info: KernelInfo, gqa: bool, backend: str) -> bool:
    """Whether ``info`` computes the causal batches of :func:`bench_kernels` (see the module doc)."""
    if info.name == "flex":
        return True  # MASK only, compiled by inductor

    def fits(k: KernelInfo) -> bool:
        return why_unfit(k, causal=True, context=False, dtype="float32", gqa=gqa, device="cpu",
                         compiled=backend != "none") is None
    causal = kernel_registry().get(("causal", info.name))
    return fits(info) and (kind != "varlen" or (causal is not None and fits(causal)))


def bench_kernels(total: int, num_seqs: int, *, heads: int = 8, kv_heads: int = 8, head_dim: int = 64,
                  repeats: int = 5, backend: str = "none", skip: Iterable[str] = (),
                  kinds: Iterable[str] = ("varlen", "mask")) -> list[KernelRow]:
    """Rows for one batch: the SDPA loop, then every registered (kind, impl) of
    ``kinds`` whose impl is not in ``skip``."""
    layout = BatchLayout.from_lens(split_lengths(total, num_seqs))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    runs: dict[tuple[str, str, str], Callable[[], object]] = {
        ("loop", "sdpa", "none"): lambda: bare_kernel(layout, MaskMode.VARLEN)(q, k, v)}
    skip = set(skip)
    for kind in kinds:
        for info in impls_for(kind):
            if info.name in skip or not _runs(kind, info, heads != kv_heads, backend):
                continue
            be = "inductor" if info.name == "flex" else backend
            causal = info.name if ("causal", info.name) in kernel_registry() else "sdpa"
            kernels = {kind: info.name, "causal": causal}
            cfg = AttnPolicyConfig.model_validate({
                "policy": POLICY[kind], "backend": be, "kernels": kernels, "max_seq_len": max(total, 16),
                "max_batch_tokens": max(total, 16), "buckets": {"kind": "exact"}})
            d = Dispatcher(cfg)
            with torch.inference_mode():
                d.attend(q, k, v, layout)  # compile, cache masks

            def run(d: Dispatcher = d) -> object:
                return d.attend(q, k, v, layout)
            runs[(kind, info.name, be)] = run
    times: dict[tuple[str, str, str], list[float]] = {name: [] for name in runs}
    order = list(runs.items())
    with torch.inference_mode():
        for i in range(repeats):  # every other repeat in reverse order: no implementation always runs first
            for name, fn in order if i % 2 == 0 else order[::-1]:
                times[name].append(_ms(fn))
    loops = times[("loop", "sdpa", "none")]
    rows = []
    for (kind, impl, be), ts in times.items():
        build = _build_ms(layout, impl) if kind == "mask" else None
        vs_loop = statistics.median(a / b for a, b in zip(loops, ts))  # per repeat: drift cancels
        rows.append(KernelRow(total, num_seqs, kv_heads, kind, impl, be, statistics.median(ts), vs_loop, build))
    return rows
