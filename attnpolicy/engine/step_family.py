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
from typing import Any

import torch

from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.graph_family import PAST_KWARG, Past, WholeModelGraphs
from attnpolicy.engine.keys import StepKey, step_dominates, step_estimate_bytes

#: A step graph's inputs: ids ``[T]``, positions ``[T]``, past keys and values and
#: (MASK, VARLEN) its mask.
StepInputs = tuple[torch.Tensor, ...]


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
    """The step graphs of ``model`` (:class:`~attnpolicy.dispatch.family.GraphFamily`),
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
