"""Features: what an attention call computes beyond plain softmax attention (in the
spirit of xformers' attn_bias): a sliding window, a logit soft cap, attention sinks.

Positions are those of :class:`~attnpolicy.core.layout.BatchLayout`: query ``j`` of a
sequence with ``c`` cached-context keys sits at position ``c + j`` and its keys at
``0 .. kv_len - 1``.

- ``window`` ``W``: query at position ``p`` sees keys ``t`` with ``p - W < t`` (so at
  most ``W`` keys, itself included, when causal); bidirectional layouts see
  ``|p - t| < W``. ``None``: every key the layout allows.
- ``softcap`` ``c``: each logit ``s`` (after the scale) becomes ``c · tanh(s / c)``.
- ``sinks``: the call takes per-head sink logits ``sinks[Hq]`` (a tensor, an input of
  the graph, never baked into it): each head gets one extra virtual key of that logit
  and a zero value, so the softmax's weights over the real keys sum to less than 1
  (as GPT-OSS does).

A feature set is part of every graph key (through
:class:`~attnpolicy.graphs.keys.TensorSpec`), so graphs, plans and cost models that
differ in it never share a graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnpolicy.errors import LayoutError


@dataclass(frozen=True, slots=True)
class Features:
    """The sliding window, soft cap and sinks flag of one call (all off by default)."""

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        w, c = self.window, self.softcap
        if w is not None and (type(w) is not int or w < 1):
            raise LayoutError(f"window must be an int >= 1 (or None for no window), got {w!r}")
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise LayoutError(f"softcap must be a finite number > 0 (or None for no cap), got {c!r}")
            object.__setattr__(self, "softcap", float(c))
        if not isinstance(self.sinks, bool):
            raise LayoutError(f"sinks must be a bool (whether the call takes sink logits), got {self.sinks!r}")

    @property
    def any(self) -> bool:
        """Whether any feature is on."""
        return self.window is not None or self.softcap is not None or self.sinks

    def describe(self) -> str:
        """E.g. ``sliding window 8, soft cap 50, sinks`` (``plain`` when none is on)."""
        parts = [f"sliding window {self.window}"] if self.window is not None else []
        if self.softcap is not None:
            parts.append(f"soft cap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts) or "plain"

    def tag(self) -> str:
        """The short suffix graph-key names carry, e.g. ``/w8/cap50/sinks`` (empty when plain)."""
        out = "" if self.window is None else f"/w{self.window}"
        out += "" if self.softcap is None else f"/cap{self.softcap:g}"
        return out + ("/sinks" if self.sinks else "")


#: No feature: plain attention.
PLAIN = Features()
