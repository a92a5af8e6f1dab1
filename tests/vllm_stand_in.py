"""A stand-in vLLM attention backend (needs vLLM importable): its own metadata, metadata
builder, KV-cache layout (vLLM's flash layout, ``kv_cache[blocks, Hkv, block_size,
2 * D]`` with each token's key then value on the last axis), KV-cache writes and
kernel (the float64 reference over the keys it reads back from its cache, under the
layer's window, cap and sinks, kept its own way). The wrapper's unit tests drive
attnpolicy's wrapper over it without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from reference import reference_attention
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType


@dataclass
class StandInMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    causal: bool = True
    prefix_ranges: Any = None  # when set, only the stand-in's kernel knows what to do


class StandInBuilder:
    """Never called here: the wrapper must hand vLLM this very class."""


class StandInImpl(AttentionImpl):
    #: the kernel's calls, over every instance
    calls: ClassVar[int] = 0

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 chunk_lookback: int = -1) -> None:
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads
        # kept the way a flash backend keeps them, not as vLLM passed them
        self.window_pair = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.cap = logits_soft_cap or 0.0
        self.sink_logits = sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        bs = kv_cache.shape[2]
        key_cache[slot_mapping // bs, slot_mapping % bs] = key
        value_cache[slot_mapping // bs, slot_mapping % bs] = value

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: StandInMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        StandInImpl.calls += 1
        md = attn_metadata
        starts, kv_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        bs = kv_cache.shape[2]
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        ks, vs = [], []
        for i, n in enumerate(kv_lens):  # this kernel's own reading of its cache
            pos = torch.arange(n)
            blocks = md.block_table[i, pos // bs].long()
            ks.append(key_cache[blocks, pos % bs])
            vs.append(value_cache[blocks, pos % bs])
        kv_starts = [sum(kv_lens[:i]) for i in range(len(kv_lens))]
        window = None if self.window_pair[0] < 0 else self.window_pair[0] + 1
        out = reference_attention(query, torch.cat(ks), torch.cat(vs), starts[:-1], q_lens, kv_starts, kv_lens,
                                  md.causal, self.scale, window=window, softcap=self.cap or None,
                                  sinks=self.sink_logits)
        n = md.num_actual_tokens
        output[:n].copy_(out[:n].to(output.dtype))
        return output


class StandInBackend(AttentionBackend):
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "STAND_IN"

    @staticmethod
    def get_impl_cls() -> type[StandInImpl]:
        return StandInImpl

    @staticmethod
    def get_builder_cls() -> type[StandInBuilder]:
        return StandInBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)
