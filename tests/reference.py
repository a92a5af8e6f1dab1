"""An independent per-sequence reference: float64, explicit loops, no attnpolicy code."""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, q_starts, q_lens, kv_starts, kv_lens, causal, scale=None, *,
                        window=None, softcap=None, sinks=None):
    """Packed q[T, Hq, D], k/v[Tk, Hkv, D] → float64 [T, Hq, D]; padding rows are 0.

    ``window`` W: query at position p (= kl - ql + i) sees keys t with p - t < W (and
    t - p < W when bidirectional); ``softcap`` c: logits s → c·tanh(s/c); ``sinks[Hq]``:
    one more key per head with that logit and a zero value."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    for qs, ql, ks, kl in zip(q_starts, q_lens, kv_starts, kv_lens):
        qq = q[qs:qs + ql].double()
        kk = k[ks:ks + kl].double().repeat_interleave(group, dim=1)
        vv = v[ks:ks + kl].double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(kl - ql, kl)[:, None]  # query i is position kl - ql + i of its sequence
        key = torch.arange(kl)[None, :]
        hidden = torch.zeros(ql, kl, dtype=torch.bool)
        if causal:
            hidden |= key > pos
        if window is not None:
            hidden |= pos - key >= window
            if not causal:
                hidden |= key - pos >= window
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.double()[:, None, None].expand(s.shape[0], ql, 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :kl]
        out[qs:qs + ql] = torch.einsum("hqk,khd->qhd", p, vv)
    return out


def reference_for(q, k, v, layout, scale=None, *, window=None, softcap=None, sinks=None):
    return reference_attention(q, k, v, layout.q_starts, layout.q_lens, layout.kv_starts,
                               layout.kv_lens, layout.causal, scale, window=window, softcap=softcap, sinks=sinks)
