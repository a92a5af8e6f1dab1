"""The step graph family: a model's forward over cached context (decode, chunked
prefill, and a first prefill chunk whose KV is kept) as one graph per :class:`StepKey`.

The KV cache is a graph input and output. The runner keeps each running sequence's
keys and values in a slot of a :class:`~attnpolicy.engine.kv_cache.KVCache`; a step
gathers its sequences' past into the graph's padded ``past_k``/``past_v`` inputs
``[layers, kv_heads, C, head_dim]`` and the graph returns, beside the logits, every
layer's new key and value rows ``[layers, kv_heads, T, head_dim]``, which the runner
writes back into the slots. Gathered spans rather than block tables: a static graph
then takes two dense tensors whose shape the key fixes, and reads only the context its
key pads to; block tables (vLLM, Gaudi) save that copy but need a paged kernel inside
the graph, which no portable SDPA graph has.

What each mode's graph is (``T`` rows, ``C`` context columns):

- ``MASK``: every sequence's rows packed, padded to the batch bucket of their total,
  every context packed, padded to the batch bucket of its total; one attention call per
  layer with the host-built mask ``[T, C + T]`` as an input (each row sees its own
  sequence's context and its own earlier rows). One graph serves every layout of the
  two buckets.
- ``VARLEN``: each sequence padded to its own (rows, context) buckets, in a span of its
  own; one call per sequence, seeing only its own span (the mask input ``[C]`` marks the
  real context positions). The key is the tuple of per-sequence buckets, sorted.
- ``CAUSAL``: one sequence, its context exact (no padding inside it), its rows padded at
  the end; a mask-free causal call (bottom-right aligned: trailing padding reaches no
  real row). The graph is keyed by the exact context length: mask-free needs it.

A larger graph serves a key it :func:`step_dominates` padded up (not ``CAUSAL``'s context,
which must be exact). Stored graphs are keyed by the model's code and config
(:func:`~attnpolicy.engine.graph_family.model_code`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.graph_family import PAST_KWARG, Past, WholeModelGraphs

#: A step graph's inputs: ids ``[T]``, positions ``[T]``, past keys and values and
#: (MASK, VARLEN) its mask.
StepInputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class StepKey:
    """One step graph: its mode, padded rows, padded context columns and per-sequence
    ``(rows, context)`` buckets (one pair for MASK and CAUSAL)."""

    mode: MaskMode
    tokens: int
    context: int
    segments: tuple[tuple[int, int], ...]
    backend: str

    def __str__(self) -> str:
        if self.mode is MaskMode.VARLEN:
            shape = "+".join(f"t{t}c{c}" for t, c in self.segments)
        else:
            shape = f"t{self.tokens}c{self.context}"
        return f"step/{self.mode.value}/{shape}/{self.backend}"


def contexts(layout: BatchLayout) -> tuple[int, ...]:
    """Each sequence's cached context: its keys before its query rows."""
    return tuple(kv - q for kv, q in zip(layout.kv_lens, layout.q_lens))


def why_illegal_step(mode: MaskMode, layout: BatchLayout) -> str | None:
    """``None`` when a step graph of ``mode`` computes ``layout`` right: MASK and VARLEN
    always; CAUSAL for one causal sequence (its context is exact in its key)."""
    if mode is not MaskMode.CAUSAL:
        return None
    if not layout.causal:
        return "bidirectional"
    return None if layout.num_seqs == 1 else f"{layout.num_seqs} sequences packed"


def segment(rows: int, context: int, config: AttnPolicyConfig) -> tuple[int, int]:
    """A sequence's VARLEN span: its rows' and its context's buckets (no context: 0)."""
    return config.bucket(rows), config.bucket(context) if context else 0


def step_key_for(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig) -> StepKey:
    """The step graph key ``layout`` runs under in ``mode`` with ``config``'s buckets
    (pure: the runner and a simulator share it). A sequence's rows and context are
    bucketed by ``config.bucket`` (at most ``max_seq_len``), MASK's totals by
    ``config.batch_bucket`` (at most ``max_batch_tokens``)."""
    ctx = contexts(layout)
    if mode is MaskMode.VARLEN:
        segments = tuple(sorted((segment(q, c, config) for q, c in zip(layout.q_lens, ctx)), reverse=True))
        return StepKey(mode, sum(t for t, _ in segments), sum(c for _, c in segments), segments, config.backend)
    if mode is MaskMode.CAUSAL:
        tokens, context = config.bucket(layout.q_lens[0]), ctx[0]
    else:
        total = sum(ctx)
        tokens, context = config.batch_bucket(sum(layout.q_lens)), config.batch_bucket(total) if total else 0
    return StepKey(mode, tokens, context, ((tokens, context),), config.backend)


def step_dominates(other: StepKey, key: StepKey) -> bool:
    """Whether ``other``'s graph can serve ``key``'s step padded up: same mode and
    backend, at least as many rows and context columns (VARLEN: per sequence; CAUSAL:
    the same context, which must be exact)."""
    if other.mode is not key.mode or other.backend != key.backend or other == key:
        return False
    if key.mode is MaskMode.VARLEN:
        return len(other.segments) == len(key.segments) and all(
            a >= b and c >= d for (a, c), (b, d) in zip(other.segments, key.segments))
    if key.mode is MaskMode.CAUSAL:
        return other.context == key.context and other.tokens >= key.tokens
    return other.tokens >= key.tokens and other.context >= key.context


def step_estimate_bytes(key: StepKey, model_config: Any, itemsize: int = 4) -> int:
    """A static-shape estimate of what one step graph holds while it runs: its inputs
    (ids, positions, past keys and values, the mask), its logits and new KV rows, and
    one layer's activations (hidden states, q/k/v, MLP)."""
    c, t = model_config, key.tokens
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_row = 2 * c.num_hidden_layers * kv_heads * head_dim
    mask = t * (key.context + t) if key.mode is MaskMode.MASK else key.context
    layer = t * (2 * c.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * c.intermediate_size)
    return 16 * t + mask + itemsize * (kv_row * (key.context + t) + t * c.vocab_size + layer)


def _step_forward(model: torch.nn.Module, segments: tuple[tuple[int, int], ...] | None, ids: torch.Tensor,
                  positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step graph's forward, the model and (VARLEN) its segments first (constants of
    the graph): ``(logits [T, vocab], new keys, new values [layers, kv_heads, T, D])``."""
    new: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                **{PAST_KWARG: Past(past_k, past_v, mask, segments, new)})
    return out.logits[0], torch.stack([k for k, _ in new]), torch.stack([v for _, v in new])


class StepFamily(WholeModelGraphs):
    """The step graphs of ``model`` (:class:`~attnpolicy.graphs.family.GraphFamily`),
    keyed by :class:`StepKey`, built from a placed step's inputs; stored (in ``store``,
    beside the prefill graphs), loaded and padded up as they are."""

    def estimate_bytes(self, key: StepKey) -> int:
        return step_estimate_bytes(key, self.model.config, self._itemsize)

    def pad_up(self, key: StepKey, resident: Sequence[StepKey]) -> StepKey | None:
        """The smallest resident key (by rows, context, then segments) that :func:`step_dominates` ``key``."""
        larger = [k for k in resident if isinstance(k, StepKey) and step_dominates(k, key)]
        return min(larger, key=lambda k: (k.tokens, k.context, k.segments)) if larger else None

    def forward(self, key: StepKey) -> Callable[..., tuple[torch.Tensor, ...]]:
        return _step_forward

    def eager(self, key: StepKey, request: StepInputs) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The uncompiled forward of ``key``'s graph (its inputs as ``request``)."""
        model, segments = self.bound(key)
        if key.mode is MaskMode.CAUSAL:
            def causal(ids: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
                       past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return _step_forward(model, None, ids, positions, past_k, past_v)
            return causal

        def masked(ids: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return _step_forward(model, segments, ids, positions, past_k, past_v, mask)
        return masked

    def bound(self, key: StepKey) -> tuple[Any, ...]:
        """The leading inputs of ``key``'s graph: the model and (VARLEN) its segments."""
        return self.model, key.segments if key.mode is MaskMode.VARLEN else None
