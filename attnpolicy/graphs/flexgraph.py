"""MASK graphs run by FlexAttention: the block mask (cached per layout) and the
sanitise/re-poison isolation around a graph of :func:`attnpolicy.kernels.flex.flex_graph`."""

from __future__ import annotations

from typing import Any

import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.graphs.keys import Call
from attnpolicy.kernels.flex import BlockMaskCache, FlexFn, flex_attend


class FlexGraph:
    """A ``mask`` graph whose input is the layout's block mask, not a dense mask.

    ``graph`` is the (compiled or plain) ``f(q, k, v, block_mask[, sinks])``; ``masks``
    the bounded block-mask cache it draws from (the dispatcher's); ``window`` the
    sliding window its block masks carry."""

    __slots__ = ("graph", "masks", "window")

    def __init__(self, graph: FlexFn | Any, masks: BlockMaskCache, window: int | None = None) -> None:
        self.graph = graph
        self.masks = masks
        self.window = window

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
            call: Call, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tensors in, packed ``[q_tokens, Hq, D]`` out (padding rows 0)."""
        mask = self.masks.get(layout, call.q_bucket, call.kv_bucket, str(q.device), self.window)
        fn = getattr(self.graph, "call", self.graph)  # a CompiledGraph runs its direct callable
        return flex_attend(fn, q, k, v, layout, mask, call.q_bucket, call.kv_bucket, sinks, self.window)

    def __repr__(self) -> str:
        return f"FlexGraph({self.graph!r})"
