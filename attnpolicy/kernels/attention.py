"""Attention kernels: the math of one call, per implementation.

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

import torch
import torch.nn.functional as F

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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
          partition_len: int | None) -> torch.Tensor:
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


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
           partition_len: int | None) -> torch.Tensor:
    hq, lq, d = q.shape
    lk = k.shape[-2]
    qg = _grouped(q, k)
    scores = qg @ k.float()[:, None].transpose(-1, -2) * scale
    allowed = _allowed(lq, lk, causal, mask, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()[:, None]
    return out.reshape(hq, lq, d).to(q.dtype)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
           partition_len: int | None) -> torch.Tensor:
    hq, lq, d = q.shape
    lk = k.shape[-2]
    qg = _grouped(q, k)
    kf, vf = k.float()[:, None], v.float()[:, None]
    allowed = _allowed(lq, lk, causal, mask, q.device)
    run_max = torch.full((*qg.shape[:-1], 1), float("-inf"), device=q.device)
    run_sum = torch.zeros_like(run_max)
    acc = torch.zeros_like(qg)
    assert partition_len is not None  # attention() resolves it
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
