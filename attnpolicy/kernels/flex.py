"""FlexAttention for ``mask`` calls: one call over the packed batch that computes
only the blocks a block mask built from the layout allows (block-sparse MASK).

Each row gets a document id and a position: sequence ``i`` owns its rows, query
``j`` of a sequence with ``c`` cached-context keys sits at position ``c + j`` and
sees its own keys at positions ``0 .. c + j`` (bottom-right causal; every key of
its sequence when the layout is bidirectional). Padding rows get documents -1 (q)
and -2 (kv), so they match nothing; fully masked rows come out 0. A sliding window
is part of the block mask (blocks wholly outside the window are skipped: windows
are block-sparse); a soft cap is a ``score_mod``; sinks rescale the output by the
log-sum-exp FlexAttention returns: ``out · sigmoid(lse - sink)`` is the softmax
with one more key of logit ``sink`` and a zero value.

Isolation: FlexAttention computes a 128-row block whole, so a sequence sharing a
block with another would see the other's non-finite values (0 · inf is NaN).
:func:`flex_attend` therefore sanitises first and re-poisons after: non-finite
K/V rows are zeroed, the call runs, then the output rows that attend such a row
are set to NaN (the faithful result of their own bad input). The finiteness check
runs outside any compiled graph (inductor's CPU build assumes finite math).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from attnpolicy.core.layout import BatchLayout
from attnpolicy.kernels.isolation import all_finite, bad_rows, repoisoned, sanitised

#: Block masks kept per dispatcher (one per (layout, buckets, device)); least recently
#: used first out, at most this many ... At 4096² one takes ~0.3 MB (block indices
#: plus row vectors).
BLOCK_MASK_CACHE_SIZE = 64
#: ... and at most this many bytes together (a larger mask is built for its call, not kept).
BLOCK_MASK_CACHE_BYTES = 64 * 2**20

FlexFn = Callable[..., torch.Tensor]  # f(q, k, v, block_mask[, sinks])


def row_vectors(layout: BatchLayout, q_rows: int, kv_rows: int,
                device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """``(q_doc, q_pos, kv_doc, kv_pos)`` int32 of ``q_rows`` / ``kv_rows`` (≥ the
    layout's tokens; the extra rows are padding). Positions are bottom-right aligned
    in causal and bidirectional layouts alike."""
    q_doc = torch.full((q_rows,), -1, dtype=torch.int32)
    kv_doc = torch.full((kv_rows,), -2, dtype=torch.int32)
    q_pos = torch.zeros(q_rows, dtype=torch.int32)
    kv_pos = torch.zeros(kv_rows, dtype=torch.int32)
    for i, (qs, ql, ks, kl) in enumerate(zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens)):
        q_doc[qs:qs + ql] = i
        kv_doc[ks:ks + kl] = i
        q_pos[qs:qs + ql] = torch.arange(kl - ql, kl, dtype=torch.int32)
        kv_pos[ks:ks + kl] = torch.arange(kl, dtype=torch.int32)
    return tuple(t.to(device) for t in (q_doc, q_pos, kv_doc, kv_pos))


def build_block_mask(layout: BatchLayout, q_rows: int, kv_rows: int, device: str = "cpu",
                     window: int | None = None) -> BlockMask:
    """The layout's document (and causal, context-offset, sliding-``window``) block mask."""
    q_doc, q_pos, kv_doc, kv_pos = row_vectors(layout, q_rows, kv_rows, device)

    def doc_mod(b, h, qi, ki):  # type: ignore[no-untyped-def]
        return q_doc[qi] == kv_doc[ki]

    def causal_mod(b, h, qi, ki):  # type: ignore[no-untyped-def]
        return (q_doc[qi] == kv_doc[ki]) & (kv_pos[ki] <= q_pos[qi])

    base = causal_mod if layout.causal else doc_mod
    if window is None:
        return create_block_mask(base, None, None, q_rows, kv_rows, device=device)

    causal = layout.causal

    def window_mod(b, h, qi, ki):  # type: ignore[no-untyped-def]
        ahead = q_pos[qi] - kv_pos[ki]  # how far the key is behind the query
        near = ((ahead >= 0) if causal else (-ahead < window)) & (ahead < window)
        return (q_doc[qi] == kv_doc[ki]) & near

    return create_block_mask(window_mod, None, None, q_rows, kv_rows, device=device)


def block_mask_bytes(mask: BlockMask) -> int:
    """Bytes held by a block mask: its block tables and the row vectors its mask reads."""
    tensors = [t for t in mask.as_tuple(flatten=True) if isinstance(t, torch.Tensor)]
    mod = mask.mask_mod
    for cell in getattr(mod, "__closure__", None) or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            tensors.append(cell.cell_contents)
    return sum(t.numel() * t.element_size() for t in tensors)


class BlockMaskCache:
    """Block masks per (layout, q rows, kv rows, device), at most ``max_entries`` and
    ``max_bytes`` bytes together (least recently used evicted; a mask larger than
    ``max_bytes`` is not kept); ``nbytes`` is what they hold. Thread-safe."""

    def __init__(self, max_entries: int = BLOCK_MASK_CACHE_SIZE, max_bytes: int = BLOCK_MASK_CACHE_BYTES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._masks: OrderedDict[tuple[BatchLayout, int, int, str, int | None],
                                 tuple[BlockMask, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.builds = 0

    def get(self, layout: BatchLayout, q_rows: int, kv_rows: int, device: str = "cpu",
            window: int | None = None) -> BlockMask:
        key = (layout, q_rows, kv_rows, device, window)
        with self._lock:
            hit = self._masks.get(key)
            if hit is not None:
                self._masks.move_to_end(key)
                return hit[0]
        mask = build_block_mask(layout, q_rows, kv_rows, device, window)
        size = block_mask_bytes(mask)
        with self._lock:
            if key not in self._masks:
                self.builds += 1
                if size <= self.max_bytes:
                    self._masks[key] = (mask, size)
                    self.nbytes += size
                while len(self._masks) > self.max_entries or self.nbytes > self.max_bytes:
                    self.nbytes -= self._masks.popitem(last=False)[1][1]
        return mask

    def __len__(self) -> int:
        return len(self._masks)

    def clear(self) -> None:
        with self._lock:
            self._masks.clear()
            self.nbytes = 0


def flex_graph(scale: float | None, softcap: float | None = None, sinks: bool = False) -> FlexFn:
    """``f(q, k, v, block_mask)`` (``f(q, k, v, block_mask, sinks)`` with ``sinks``) on
    ``[1, H, L, D]`` tensors, logits soft-capped at ``softcap`` if given: what gets
    compiled (per bucket, static shapes: FlexAttention's dynamic-shape recompile fails
    on CPU; the batch dimension is added outside, inductor's CPU template needs 4-D
    inputs)."""
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def capped(score, b, h, qi, ki):  # type: ignore[no-untyped-def]
            return torch.tanh(score / cap) * cap
        score_mod = capped

    def flex_mask_graph(q, k, v, block_mask):  # type: ignore[no-untyped-def]
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1])

    def flex_sink_graph(q, k, v, block_mask, sink):  # type: ignore[no-untyped-def]
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
        lse = aux.lse
        assert lse is not None  # asked for
        weight = torch.sigmoid(lse - sink.to(lse.dtype)[None, :, None])
        return (out * weight[..., None].to(out.dtype)).to(q.dtype)
    return flex_sink_graph if sinks else flex_mask_graph


def flex_attend(fn: FlexFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
                block_mask: BlockMask, q_rows: int, kv_rows: int, sinks: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
    """Packed ``q[q_tokens, Hq, D]``, ``k, v[kv_tokens, Hkv, D]`` through ``fn`` (a
    :func:`flex_graph`, maybe compiled; ``sinks[Hq]`` its last input when it takes
    them) padded to ``q_rows`` / ``kv_rows``; returns ``[q_tokens, Hq, D]`` with
    padding rows 0, sanitised and re-poisoned (module doc; ``window``: the block
    mask's, so only the rows that see a bad key are re-poisoned)."""
    bad = None
    if not layout.is_single and not all_finite(k, v):  # one cheap gate (no neighbour: none)
        bad = bad_rows(k, v)
        k, v = sanitised(k, bad), sanitised(v, bad)
    ins = (_padded(q, q_rows), _padded(k, kv_rows), _padded(v, kv_rows), block_mask)
    out = fn(*ins) if sinks is None else fn(*ins, sinks)
    out = out[0, :, :layout.q_tokens].transpose(0, 1)
    return out if bad is None else repoisoned(out, layout, bad, window)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if rows > x.shape[0]:
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
    return x.transpose(0, 1)[None]
