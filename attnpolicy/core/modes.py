"""Mask modes, decisions, and which mode is legal for which layout."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
    """

    CAUSAL = "causal"
    MASK = "mask"
    VARLEN = "varlen"

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


def why_illegal(mode: MaskMode, layout: BatchLayout) -> str | None:
    """``None`` if ``mode`` computes the right answer for ``layout``, else why not."""
    if mode is not MaskMode.CAUSAL:
        return None
    if layout.num_seqs != 1:
        return f"CAUSAL needs one sequence, the layout packs {layout.num_seqs}"
    if not layout.causal:
        return "CAUSAL needs a causal layout, the layout is bidirectional"
    if layout.is_padded:
        return f"CAUSAL needs an unpadded tensor, the layout is {layout.describe()}"
    if layout.has_context:
        return (f"CAUSAL needs kv length == query length, got kv={layout.kv_lens[0]} "
                f"q={layout.q_lens[0]} (cached context)")
    return None


def is_legal(mode: MaskMode, layout: BatchLayout) -> bool:
    return why_illegal(mode, layout) is None


def legal_modes(layout: BatchLayout) -> tuple[MaskMode, ...]:
    return tuple(m for m in MaskMode if why_illegal(m, layout) is None)


def check_legal(mode: MaskMode, layout: BatchLayout) -> None:
    """Raise :class:`IllegalModeError` if ``mode`` would compute a wrong result."""
    reason = why_illegal(mode, layout)
    if reason is not None:
        raise IllegalModeError(f"mode={mode.value} is illegal for layout ({layout.describe()}): {reason}")
