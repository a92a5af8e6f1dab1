"""Every registered implementation per graph family, timed side by side.

For each batch (``n`` causal sequences of ``L/n`` tokens) the baseline is the
per-sequence SDPA loop (no attnpolicy); each (family, implementation) runs through
a :class:`~attnpolicy.dispatcher.Dispatcher` whose policy forces the family
(``varlen`` or ``always-mask``) and whose ``kernels`` pick the implementation.
Graphs are compiled and masks cached before timing (steady state); the mask build
(dense mask for MASK, block mask for ``flex``) is timed apart, uncached.
Implementations are interleaved within each repeat; figures are medians.
``flex`` runs compiled with inductor (uncompiled FlexAttention materialises every
score); the others with the ``backend`` given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.kernels.flex import build_block_mask
from attnpolicy.kernels.masks import mask_for
from attnpolicy.measure.overhead import bare_kernel
from attnpolicy.measure.timing import split_lengths
from attnpolicy.plugins.kernels import impls_for

POLICY = {"varlen": "varlen", "mask": "always-mask"}


@dataclass(frozen=True)
class KernelRow:
    """One implementation on one batch: median ms and its speed relative to the loop."""

    total_tokens: int
    num_seqs: int
    kv_heads: int
    family: str
    impl: str
    backend: str
    median_ms: float
    vs_loop: float  # loop time / this time (> 1: faster than the loop)
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


def bench_kernels(total: int, num_seqs: int, *, heads: int = 8, kv_heads: int = 8, head_dim: int = 64,
                  repeats: int = 5, backend: str = "none", skip: Iterable[str] = (),
                  families: Iterable[str] = ("varlen", "mask")) -> list[KernelRow]:
    """Rows for one batch: the SDPA loop, then every registered (family, impl) of
    ``families`` whose impl is not in ``skip``."""
    layout = BatchLayout.from_lens(split_lengths(total, num_seqs))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    runs: dict[tuple[str, str, str], Callable[[], object]] = {
        ("loop", "sdpa", "none"): lambda: bare_kernel(layout, MaskMode.VARLEN)(q, k, v)}
    skip = set(skip)
    for family in families:
        for info in impls_for(family):
            if info.name in skip:
                continue
            be = "inductor" if info.name == "flex" else backend
            kernels = {family: info.name, "causal": "sdpa" if info.name == "flex" else info.name}
            cfg = AttnPolicyConfig.model_validate({
                "policy": POLICY[family], "backend": be, "kernels": kernels, "max_seq_len": max(total, 16),
                "max_batch_tokens": max(total, 16), "buckets": {"kind": "exact"}})
            d = Dispatcher(cfg)
            with torch.inference_mode():
                d.attend(q, k, v, layout)  # compile, cache masks

            def run(d: Dispatcher = d) -> object:
                return d.attend(q, k, v, layout)
            runs[(family, info.name, be)] = run
    times: dict[tuple[str, str, str], list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in runs.items():
                times[name].append(_ms(fn))
    loop = statistics.median(times[("loop", "sdpa", "none")])
    rows = []
    for (family, impl, be), ts in times.items():
        med = statistics.median(ts)
        build = _build_ms(layout, impl) if family == "mask" else None
        rows.append(KernelRow(total, num_seqs, kv_heads, family, impl, be, med, loop / med, build))
    return rows
