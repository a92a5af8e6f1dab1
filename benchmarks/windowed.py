"""Sliding-window attention: windowed VARLEN, MASK and flex against the per-sequence
SDPA loop with the window in its mask.

Not a test: run it by hand on a machine as quiet as you can get::

    python benchmarks/windowed.py --window 256 --json windowed.json

Batches: ``1×4096`` and ``4×1024`` causal tokens (8 heads of 64, fp32, CPU by default).
Rows:

- ``loop``: per sequence, ``scaled_dot_product_attention`` with the sequence's
  window band as its boolean mask (no attnpolicy: the baseline);
- ``varlen`` / ``mask``: a :class:`~attnpolicy.dispatch.Dispatcher` under the
  ``varlen`` / ``always-mask`` policy, ``attend(..., window=W)`` (``sdpa`` kernel,
  uncompiled: the window is in the band or the dense mask, every key is computed);
- ``flex``: ``always-mask`` with the ``flex`` kernel, compiled by inductor (blocks
  outside the window are skipped);
- ``chunked``: what a window-aware VARLEN plan would run (not built yet): each
  sequence's queries in chunks of ``W`` rows, each chunk attending only the
  ``2W - 1`` keys its window can reach.

Times are medians of ``--repeats`` after one warm-up call (compiles, masks);
``vs_loop`` is the loop's median over the row's (> 1: faster). Every row is checked
against the loop's output (max abs error printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.kernels.accuracy import MaxAbsError
from attnpolicy.kernels.masks import window_band

HEADS, HEAD_DIM = 8, 64


def _loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    for qs, n in zip(layout.q_starts, layout.q_lens):
        band = window_band(n, n, window, causal=True)
        out[qs:qs + n] = F.scaled_dot_product_attention(
            *(t[qs:qs + n].transpose(0, 1)[None] for t in (q, k, v)), attn_mask=band)[0].transpose(0, 1)
    return out


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    for qs, n in zip(layout.q_starts, layout.q_lens):
        for c in range(0, n, window):
            end = min(c + window, n)
            lo = max(0, c - window + 1)
            band = window_band(end - c, end - lo, window, causal=True)
            qq = q[qs + c:qs + end].transpose(0, 1)[None]
            kk, vv = (t[qs + lo:qs + end].transpose(0, 1)[None] for t in (k, v))
            out[qs + c:qs + end] = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=band)[0].transpose(0, 1)
    return out


def _dispatcher(policy: str, kernels: dict[str, str], backend: str) -> Dispatcher:
    return Dispatcher(AttnPolicyConfig(policy=policy, backend=backend, max_seq_len=4096, max_batch_tokens=4096,
                                       kernels=kernels, max_mask_bytes=64 * 2**20,
                                       buckets={"kind": "list", "sizes": [1024, 4096]}))


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: compiles, masks
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _batch(n: int, length: int, w: int, repeats: int, no_flex: bool) -> list[dict[str, object]]:
    """The rows of one batch of ``n`` sequences of ``length`` tokens under window ``w``."""
    layout = BatchLayout.from_lens([length] * n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * length, HEADS, HEAD_DIM, generator=g) for _ in range(3))
    want = _loop(q, k, v, layout, w)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "loop": lambda: _loop(q, k, v, layout, w),
        "chunked": lambda: _chunked(q, k, v, layout, w),
    }
    for name, policy, kernels, backend in (("varlen", "varlen", {}, "none"), ("mask", "always-mask", {}, "none"),
                                           ("flex", "always-mask", {"mask": "flex"}, "inductor")):
        if name == "flex" and no_flex:
            continue
        d = _dispatcher(policy, kernels, backend)
        runs[name] = lambda d=d: d.attend(q, k, v, layout, window=w)
    with torch.no_grad():
        times = {name: _median_ms(fn, repeats) for name, fn in runs.items()}
        errors = {name: MaxAbsError() for name in runs}
        for name, fn in runs.items():
            errors[name].add(fn(), want)
    return [{"batch": f"{n}x{length}", "window": w, "row": name, "median_ms": round(ms, 2),
             "vs_loop": round(times["loop"] / ms, 2), "max_err": errors[name].value,
             "non_finite": errors[name].non_finite} for name, ms in times.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-flex", action="store_true", help="skip flex (its inductor compile is slow on CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for n, length in ((1, 4096), (4, 1024)):
        for row in _batch(n, length, args.window, args.repeats, args.no_flex):
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
