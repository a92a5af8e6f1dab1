"""An independent per-sequence reference: float64, explicit loops, no attnpolicy code."""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, q_starts, q_lens, kv_starts, kv_lens, causal, scale=None):
    """Packed q[T, Hq, D], k/v[Tk, Hkv, D] → float64 [T, Hq, D]; padding rows are 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    for qs, ql, ks, kl in zip(q_starts, q_lens, kv_starts, kv_lens):
        qq = q[qs:qs + ql].double()
        kk = k[ks:ks + kl].double().repeat_interleave(group, dim=1)
        vv = v[ks:ks + kl].double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if causal:  # query i is position kl - ql + i of its sequence
            hidden = torch.ones(ql, kl, dtype=torch.bool).triu(diagonal=kl - ql + 1)
            s = s.masked_fill(hidden, float("-inf"))
        out[qs:qs + ql] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    return out


def reference_for(q, k, v, layout, scale=None):
    return reference_attention(q, k, v, layout.q_starts, layout.q_lens, layout.kv_starts,
                               layout.kv_lens, layout.causal, scale)
