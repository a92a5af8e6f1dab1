"""How the report writes sizes and cache bounds (Markdown, plot labels, sentences)."""

from __future__ import annotations

MIB = 2**20
GIB = 2**30


def human_bytes(nbytes: int) -> str:
    """``nbytes`` in MiB below 1 GiB (``445 MiB``), else in GiB to 3 digits (``16.6 GiB``)."""
    return f"{nbytes / MIB:.0f} MiB" if nbytes < GIB else f"{nbytes / GIB:.3g} GiB"


def capacity_text(capacity: int | None) -> str:
    """A max-graphs bound: its number, ``∞`` when unbounded."""
    return "∞" if capacity is None else str(capacity)


def bound_text(capacity: int | None, max_bytes: int | None) -> str:
    """A cache bound as the first screen writes it: ``32 graphs``, ``∞ graphs, 512 MiB``."""
    return f"{capacity_text(capacity)} graphs" + ("" if max_bytes is None else f", {human_bytes(max_bytes)}")
