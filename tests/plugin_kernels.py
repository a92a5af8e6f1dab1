"""A third-party-style attention kernel for tests of the kernel hook."""

from __future__ import annotations

import torch


def recording_sdpa():
    """``(kernel, calls)``: a kernel with the hook's signature (SDPA; no GQA; any mask)
    and the list of query shapes it was called with."""
    calls = []

    def plain(q, k, v, causal, mask, scale, partition_len):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal and mask is None, scale=scale)[0]
    return plain, calls


def sdpa_kernel(q, k, v, causal, mask, scale, partition_len):
    """A correct kernel with the hook's signature (SDPA, GQA, any mask)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=causal and mask is None, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0])[0]


#: Kernels that are wrong in one way each, by what they get wrong.
BROKEN = {
    "one-head": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k, v, c, m, s, p)[:1],
    "one-column": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k, v, c, m, s, p)[..., :1],
    "float64": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k, v, c, m, s, p).double(),
    "int32": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k, v, c, m, s, p).int(),
    "extra-rows": lambda q, k, v, c, m, s, p: torch.cat([sdpa_kernel(q, k, v, c, m, s, p), q[:, :1]], 1),
    "kv-head-0": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k[:1].expand_as(k).contiguous(),
                                                         v[:1].expand_as(v).contiguous(), c, m, s, p),
    "no-mask": lambda q, k, v, c, m, s, p: sdpa_kernel(q, k, v, c, None, s, p),
}


#: The most query rows of a conformance probe's call: a kernel may misbehave above it unprobed.
PROBE_ROWS = 16


def nan_row_0(q, k, v, causal, mask, scale, partition_len):
    """:func:`sdpa_kernel`, but a call of more query rows than a probe's (a prefill) returns
    NaN in its first row (every head); the other rows, the last one included, are right."""
    out = sdpa_kernel(q, k, v, causal, mask, scale, partition_len)
    if q.shape[1] <= PROBE_ROWS:
        return out
    return torch.cat([torch.full_like(out[:, :1], float("nan")), out[:, 1:]], dim=1)
