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
