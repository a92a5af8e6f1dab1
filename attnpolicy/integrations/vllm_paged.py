"""vLLM's paged KV caches, seen from attnpolicy (imports vLLM; vllm 0.32).

- :class:`PagedVarlenKernel`: vLLM's own CPU ``cpu_attention_with_kv_cache`` over a
  whole batch: varlen, mask-free, reading every sequence's keys (cached context
  included) through its block table, under the layer's sliding window, soft cap and
  sinks. It is the ``varlen`` kernel of the wrapper over ``CPU_ATTN``, with the call
  signature a kernel registry can take: queries, the paged cache, the step's metadata
  and the output.
- :class:`PagedGather`: packed ``k, v[Σ kv_len, Hkv, D]`` read from a layer's paged
  cache for the sequences of a step with cached context, the keys and values of
  attnpolicy's MASK and ROWS steps (a ROWS step gathers them into its rows as it runs).
  Where keys and values sit inside a block is the backend's: :func:`cpu_views` (vLLM's
  CPU backend) or :func:`flash_views` (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION).

Both layouts are ``kv_cache[num_blocks, Hkv, block_size, 2 * D]`` as the layer sees it.
vLLM's CPU backend writes each (block, head) as a K block then a V block, the V block
token-major ``[block_size, D]`` and the K block *transposed*, ``[D, block_size]`` (ISAs
``vec`` and ``vec16``). The flash layout holds each token's key then its value along the
last axis (``kv_cache.transpose(1, 2).split(D, dim=-1)``, as those backends read it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import AttentionType

from attnpolicy.core.features import PLAIN, Features

if TYPE_CHECKING:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

#: Views ``k, v[num_blocks, block_size, Hkv, D]`` of a layer's cache, given its head size.
KVViews = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

#: ISAs whose cache layout :class:`PagedGather` reads (AMX and fp8 caches pack differently).
GATHER_ISAS = ("vec", "vec16")


def cpu_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, block_size, Hkv, D]`` of vLLM's CPU cache (the
    K blocks read through their transpose)."""
    nb, heads, bs, _ = kv_cache.shape
    per = kv_cache.view(nb, heads, 2, bs * head_size)
    k = per[:, :, 0].view(nb, heads, head_size, bs).permute(0, 3, 1, 2)
    v = per[:, :, 1].view(nb, heads, bs, head_size).permute(0, 2, 1, 3)
    return k, v


def flash_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, block_size, Hkv, D]`` of the flash layout: each
    token's key, then its value, along the last axis."""
    per_token = kv_cache.transpose(1, 2)
    return per_token[..., :head_size], per_token[..., head_size:2 * head_size]


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_cache, value_cache`` views ``[num_blocks, Hkv, block_size, D]`` as vLLM's ops take them."""
    nb, heads, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)
    return key_cache, value_cache


@dataclass(frozen=True)
class PagedVarlenKernel:
    """One call of vLLM's CPU attention kernel for a whole batch, with vLLM's own
    scheduler metadata: bit-identical to stock vLLM.

    The scheduler metadata describes exactly the batch it was built for; never pass
    it with a subset of the batch's sequences (the kernel trusts it and can hang).

    ``features``: the layer's window and cap, passed as the kernel's ``sliding_window``
    and ``softcap``. Both mean what :class:`~attnpolicy.core.features.Features` means:
    the kernel's ``sliding_window=W`` lets a query see its ``W`` last keys, itself
    included (vLLM's layers keep the model config's ``sliding_window`` as it is), and
    ``softcap=0`` is no cap. ``sinks``: the layer's sink logits ``[Hq]`` (the kernel's
    ``s_aux``) when ``features.sinks``.
    """

    scale: float
    kv_cache_dtype: str = "auto"
    attn_type: str = AttentionType.DECODER
    features: Features = PLAIN

    def __call__(self, layer: object, query: torch.Tensor, key: torch.Tensor | None,
                 value: torch.Tensor | None, kv_cache: torch.Tensor, md: CPUAttentionMetadata,
                 output: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = md.num_actual_tokens
        feats = self.features
        if feats.sinks != (sinks is not None):
            raise ValueError(f"features {feats.describe()} and sinks={'a tensor' if sinks is not None else None} "
                             "disagree: pass sink logits exactly when the features have sinks")
        k_scale, v_scale = layer._k_scale_float, layer._v_scale_float  # type: ignore[attr-defined]
        if md.scheduler_metadata is None:
            raise ValueError("vLLM's metadata has no scheduler_metadata: the CPU kernel needs it")
        if self.attn_type == AttentionType.ENCODER_ONLY:
            if md.encoder_cache is None or key is None or value is None:
                raise ValueError("encoder-only attention needs key, value and metadata.encoder_cache")
            # a scratch cache: write this batch's keys first
            key_cache, value_cache = split_cache(md.encoder_cache)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping,
                                           layer.isa, k_scale=k_scale, v_scale=v_scale,  # type: ignore[attr-defined]
                                           kv_cache_dtype=self.kv_cache_dtype)
        else:
            key_cache, value_cache = split_cache(kv_cache)
        ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
            query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=self.scale,
            causal=md.causal, alibi_slopes=None,
            sliding_window=-1 if feats.window is None else feats.window, block_table=md.block_table,
            softcap=feats.softcap or 0.0, scheduler_metadata=md.scheduler_metadata, s_aux=sinks,
            dynamic_causal=md.dynamic_causal, k_scale=k_scale, v_scale=v_scale,
            kv_cache_dtype=self.kv_cache_dtype)
        return output


class PagedGather:
    """Reads packed keys and values of every sequence of a step from a layer's paged cache.

    Built once per step (the token → (block, offset) index, on the block table's device,
    is shared by all layers); each call is one indexed copy for K and one for V, straight
    into the packed ``[Σ kv_len, Hkv, D]`` layout, through ``views`` (the backend's
    layout: :func:`cpu_views` or :func:`flash_views`).
    """

    def __init__(self, block_table: torch.Tensor, kv_lens: tuple[int, ...], block_size: int, *,
                 views: KVViews) -> None:
        device = block_table.device
        lens = torch.tensor(kv_lens, device=device)
        seq = torch.repeat_interleave(torch.arange(len(kv_lens), device=device), lens)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(sum(kv_lens), device=device) - starts[seq]
        self.block_size = block_size
        self.views = views
        self.blocks = block_table[seq, pos // block_size].long()
        self.offsets = pos % block_size

    def __call__(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, two_d = kv_cache.shape[2], kv_cache.shape[3]
        if bs != self.block_size:
            raise ValueError(f"kv_cache block_size {bs} differs from the step's block_size {self.block_size}")
        k, v = self.views(kv_cache, two_d // 2)
        return k[self.blocks, self.offsets], v[self.blocks, self.offsets]
