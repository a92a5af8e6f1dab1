"""Attention kernels: one call per implementation, the graph families, and ``attend``.

Tensor layout of a single call: ``q[Hq, Lq, D]``, ``k, v[Hkv, Lk, D]`` (heads first,
as torch's SDPA takes them), ``Hkv`` dividing ``Hq`` (GQA). ``causal`` is aligned
bottom-right (query ``j`` sees keys ``0 .. Lk - Lq + j``), ``mask`` is boolean
``[Lq, Lk]`` with True = attend; both may be given.

Implementations (RBLN's names in brackets):
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``;
- ``eager`` ["eager"]: explicit ``softmax(q kᵀ · scale) v`` in fp32;
- ``flash`` ["flash_attn"]: keys in partitions of ``partition_len`` tokens combined
  with an exact online softmax (running max and sum), in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from attnpolicy.errors import LayoutError
from attnpolicy.keys import Call
from attnpolicy.layout import BatchLayout
from attnpolicy.masks import bounded_mask, mask_for, real_rows
from attnpolicy.modes import MaskMode
from attnpolicy.plan import plan_calls

IMPLS = ("sdpa", "eager", "flash")


def _causal_allowed(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    q_idx = torch.arange(lq, device=device)[:, None]
    k_idx = torch.arange(lk, device=device)[None, :]
    return k_idx <= q_idx + (lk - lq)


def _allowed(lq: int, lk: int, causal: bool, mask: torch.Tensor | None,
             device: torch.device) -> torch.Tensor | None:
    """The combined boolean mask, or None when every key is allowed."""
    if causal and lq > 1:
        tri = _causal_allowed(lq, lk, device)
        return tri if mask is None else mask & tri
    return mask


def _sdpa(q, k, v, causal, mask, scale, partition_len):
    # SDPA's fused CPU/CUDA kernels take [batch, heads, L, D]; 3-D input falls back
    # to the (several times slower) math path, so add a batch dimension.
    lq, lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[-3] != k.shape[-3]
    q, k, v = q[None], k[None], v[None]
    if causal and mask is None and lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)[0]
    allowed = _allowed(lq, lk, causal, mask, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)[0]


def _grouped(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """View q as ``[Hkv, G, Lq, D]`` in fp32 so each kv head serves its G query heads."""
    hq, lq, d = q.shape
    return q.float().reshape(k.shape[0], hq // k.shape[0], lq, d)


def _eager(q, k, v, causal, mask, scale, partition_len):
    hq, lq, d = q.shape
    lk = k.shape[-2]
    qg = _grouped(q, k)
    scores = qg @ k.float()[:, None].transpose(-1, -2) * scale
    allowed = _allowed(lq, lk, causal, mask, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()[:, None]
    return out.reshape(hq, lq, d).to(q.dtype)


def _flash(q, k, v, causal, mask, scale, partition_len):
    hq, lq, d = q.shape
    lk = k.shape[-2]
    qg = _grouped(q, k)
    kf, vf = k.float()[:, None], v.float()[:, None]
    allowed = _allowed(lq, lk, causal, mask, q.device)
    run_max = torch.full((*qg.shape[:-1], 1), float("-inf"), device=q.device)
    run_sum = torch.zeros_like(run_max)
    acc = torch.zeros_like(qg)
    for start in range(0, lk, partition_len):
        end = min(start + partition_len, lk)
        s = qg @ kf[..., start:end, :].transpose(-1, -2) * scale
        if allowed is not None:
            s = s.masked_fill(~allowed[:, start:end], float("-inf"))
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max)
        alpha = torch.exp(run_max - safe_max)
        run_sum = run_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ vf[..., start:end, :]
        run_max = new_max
    return (acc / run_sum).reshape(hq, lq, d).to(q.dtype)


_IMPL_FNS = {"sdpa": _sdpa, "eager": _eager, "flash": _flash}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str = "sdpa",
              causal: bool = False, mask: torch.Tensor | None = None,
              scale: float | None = None, partition_len: int | None = None) -> torch.Tensor:
    """One attention call on ``[H, L, D]`` tensors (see the module docstring)."""
    fn = _IMPL_FNS.get(impl)
    if fn is None:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "flash":
        partition_len = k.shape[-2] if partition_len is None else partition_len
        if partition_len < 1:
            raise ValueError(f"partition_len must be >= 1, got {partition_len}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return fn(q, k, v, causal, mask, scale, partition_len)


GraphFn = Callable[..., torch.Tensor]


def graph_fn(call: Call, impl: str, scale: float | None, partition_len: int | None) -> GraphFn:
    """The Python function a graph of ``call``'s family computes (what gets compiled).

    - CAUSAL: ``f(q, k, v)``, mask-free, ``is_causal``;
    - MASK: ``f(q, k, v, mask)`` with a dense boolean mask built on the host;
    - VARLEN: ``f(q, k, v, lens)``, one sequence; bounds arrive as a tensor.
    Each family's functions are closures over one code object; ``compile.py`` gives
    every compiled graph a fresh code object of its own.
    """
    if call.kind is MaskMode.CAUSAL:
        def causal_graph(q, k, v):
            return attention(q, k, v, impl=impl, causal=True, scale=scale, partition_len=partition_len)
        return causal_graph
    if call.kind is MaskMode.MASK:
        def mask_graph(q, k, v, mask):
            return attention(q, k, v, impl=impl, mask=mask, scale=scale, partition_len=partition_len)
        return mask_graph
    rows, cols, causal = call.q_bucket, call.kv_bucket, call.causal

    def varlen_graph(q, k, v, lens):
        m = bounded_mask(rows, cols, lens, causal)
        return attention(q, k, v, impl=impl, mask=m, scale=scale, partition_len=partition_len)
    return varlen_graph


def graph_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
                 call: Call) -> tuple[torch.Tensor, ...]:
    """Slice, pad to the call's buckets and transpose packed tensors into graph inputs.

    A MASK call takes the whole packed tensors; the layout's padding rows of k and v
    are zeroed so that garbage there (an uninitialised buffer: NaN, inf) cannot leak
    through a zero attention weight (0 · NaN is NaN)."""
    def rows(x: torch.Tensor, start: int, n: int, bucket: int) -> torch.Tensor:
        x = x[start:start + n]
        if bucket > n:
            x = torch.cat([x, x.new_zeros(bucket - n, *x.shape[1:])])
        return x.transpose(0, 1)

    if call.kind is MaskMode.MASK and layout.kv_tokens != layout.total_kv_tokens:
        real = real_rows(layout.kv_starts, layout.kv_lens, layout.kv_tokens, str(k.device))[:, None, None]
        k, v = k.where(real, 0), v.where(real, 0)
    ins = (rows(q, call.q_start, call.q_len, call.q_bucket),
           rows(k, call.kv_start, call.kv_len, call.kv_bucket),
           rows(v, call.kv_start, call.kv_len, call.kv_bucket))
    if call.kind is MaskMode.MASK:
        return (*ins, mask_for(layout).dense(call.q_bucket, call.kv_bucket, str(q.device)))
    if call.kind is MaskMode.VARLEN:
        return (*ins, _lens(call.q_len, call.kv_len, str(q.device)))
    return ins


@lru_cache(maxsize=4096)
def _lens(q_len: int, kv_len: int, device: str) -> torch.Tensor:
    """The bounds tensor of a VARLEN call, kept per device (no transfer per call)."""
    return torch.tensor([q_len, kv_len], device=device)


def execute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
            graphs: Sequence[tuple[Call, GraphFn]]) -> torch.Tensor:
    """Run each planned call through its graph and scatter the outputs into a packed
    ``[q_tokens, Hq, D]`` tensor (padding rows zero). Inputs are made contiguous so
    every graph sees the strides it was compiled for."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    call, fn = graphs[0]
    if len(graphs) == 1 and call.q_len == layout.q_tokens and call.kind is not MaskMode.VARLEN:
        out = fn(*graph_inputs(q, k, v, layout, call))[:, :call.q_len].transpose(0, 1)
        if call.kind is MaskMode.MASK and layout.is_padded:
            real = real_rows(layout.q_starts, layout.q_lens, layout.q_tokens, str(out.device))
            out = out.masked_fill(~real[:, None, None], 0)
        return out
    out = q.new_zeros(q.shape)
    for call, fn in graphs:
        o = fn(*graph_inputs(q, k, v, layout, call))
        out[call.q_start:call.q_start + call.q_len] = o[:, :call.q_len].transpose(0, 1)
    return out


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout) -> None:
    """Raise :class:`LayoutError` naming the field if the tensors do not fit the layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise LayoutError(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
    if k.shape != v.shape:
        raise LayoutError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != layout.q_tokens:
        raise LayoutError(f"q has {q.shape[0]} tokens but layout.q_tokens={layout.q_tokens}")
    if k.shape[0] != layout.kv_tokens:
        raise LayoutError(f"k has {k.shape[0]} tokens but layout.kv_tokens={layout.kv_tokens}")
    if q.shape[2] != k.shape[2]:
        raise LayoutError(f"head_dim differs: q has {q.shape[2]}, k has {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise LayoutError(f"kv heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise LayoutError(f"dtype differs: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise LayoutError(f"device differs: q {q.device}, k {k.device}, v {v.device}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
           mode: MaskMode | str, impl: str = "sdpa", *, scale: float | None = None,
           partition_len: int | None = None) -> torch.Tensor:
    """Attention over packed ``q[q_tokens, Hq, D]``, ``k, v[kv_tokens, Hkv, D]``, uncompiled.

    Returns ``[q_tokens, Hq, D]``; padding rows are zero. Raises
    :class:`~attnpolicy.errors.IllegalModeError` if ``mode`` is illegal for the layout.
    """
    mode = MaskMode(mode)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if partition_len is not None and partition_len < 1:
        raise ValueError(f"partition_len must be >= 1, got {partition_len}")
    check_inputs(q, k, v, layout)
    graphs = [(call, graph_fn(call, impl, scale, partition_len)) for call in plan_calls(layout, mode)]
    return execute(q, k, v, layout, graphs)
