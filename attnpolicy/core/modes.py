"""Mask modes (a policy's decision), call kinds (what one compiled attention
graph computes), and the one rule of which mode is legal for which layout."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import IllegalModeError


class MaskMode(str, Enum):
    """How one attention call keeps its sequences apart.

    - ``CAUSAL``: one call, no mask, ``is_causal=True``. Legal only for one unpadded
      causal sequence without cached context: the fastest path.
    - ``MASK``: one call with a dense block-diagonal mask built from the layout.
      Always legal; the mask costs a build, memory (L²) and a slower kernel.
    - ``VARLEN``: one call per sequence, no host-built mask. Always legal; causal
      sequences without context reuse exactly the CAUSAL graphs (mask-free), the
      others (context, decode, bidirectional) bound their keys inside the graph.
    - ``ROWS``: each sequence in its own row of a right-padded ``[rows, length]``
      batch (rows bucketed by ``row_buckets``). Always legal; fresh causal rows run
      mask-free, the others bound their keys per row inside the graph.
    """

    CAUSAL = "causal"
    MASK = "mask"
    VARLEN = "varlen"
    ROWS = "rows"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer for one batch: the mode, and a short reason for logs."""

    mode: MaskMode
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, MaskMode):
            object.__setattr__(self, "mode", MaskMode(self.mode))


class CallKind(str, Enum):
    """The kind of one attention call: what its compiled graph computes (a
    :class:`MaskMode` plans calls of these kinds).

    - ``CAUSAL``: mask-free, ``is_causal``, query rows == key rows (CAUSAL plans it,
      and VARLEN for each causal sequence without cached context);
    - ``MASK``: a dense mask is an input (MASK plans it);
    - ``VARLEN``: one sequence whose bounds arrive as a tensor (VARLEN plans it for
      sequences with cached context, and bidirectional ones);
    - ``ROWS``: up to a row bucket of sequences, one a row, right-padded; per-row
      lengths arrive as tensors (ROWS plans it).
    """

    CAUSAL = "causal"
    MASK = "mask"
    VARLEN = "varlen"
    ROWS = "rows"

    def __str__(self) -> str:
        return self.value


#: Every call kind, in the order the planner codes them.
CALL_KINDS: tuple[CallKind, ...] = tuple(CallKind)


def why_not_causal(layout: BatchLayout) -> str | None:
    """The legality rule: ``None`` when CAUSAL computes the right answer for
    ``layout`` (one unpadded causal sequence without cached context), else a short
    reason such as ``"3 sequences packed"``. Allocates nothing per call (reasons are
    shared strings), so policies may call it on every batch."""
    if layout.num_seqs != 1:
        return _packed(layout.num_seqs)
    if not layout.causal:
        return "bidirectional"
    if layout.is_padded:
        return "padded"
    if layout.has_context:
        return "cached context"
    return None


@lru_cache(maxsize=1024)
def _packed(num_seqs: int) -> str:
    return f"{num_seqs} sequences packed"


def why_illegal(mode: MaskMode, layout: BatchLayout) -> str | None:
    """``None`` if ``mode`` computes the right answer for ``layout``, else why not
    (MASK, VARLEN and ROWS are always legal; CAUSAL follows :func:`why_not_causal`)."""
    if mode is not MaskMode.CAUSAL:
        return None
    why = why_not_causal(layout)
    if why is None:
        return None
    return (f"CAUSAL needs one sequence, unpadded, causal, without cached context; "
            f"this layout: {why} ({layout.describe()})")


def is_legal(mode: MaskMode, layout: BatchLayout) -> bool:
    """Whether :func:`why_illegal` is ``None``, without building its message."""
    return mode is not MaskMode.CAUSAL or why_not_causal(layout) is None


def legal_modes(layout: BatchLayout) -> tuple[MaskMode, ...]:
    return tuple(m for m in MaskMode if is_legal(m, layout))


def check_legal(mode: MaskMode, layout: BatchLayout) -> None:
    """Raise :class:`IllegalModeError` if ``mode`` would compute a wrong result."""
    reason = why_illegal(mode, layout)
    if reason is not None:
        raise IllegalModeError(f"mode={mode.value} is illegal for layout ({layout.describe()}): {reason}")
