"""A bounded sample of a long step stream to plan on: evenly spaced contiguous windows.

Planning replays the whole stream once per candidate bucket list and eviction, so its
time and memory grow with the stream. Above a threshold the planner plans on a sample
instead: :data:`WINDOWS` windows of consecutive steps (each keeps the stream's order
and so its cache reuse), spread evenly over the stream. The chosen plan is then
evaluated on every step, so its figure on the whole stream is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from attnpolicy.errors import ConfigError

#: Batches planned on by default: above this a workload is sampled.
SAMPLE = 8_000
#: Windows a sample is made of.
WINDOWS = 8

T = TypeVar("T")


@dataclass(frozen=True)
class PlanSample:
    """``batches`` steps planned on, out of ``of``, in ``windows`` windows."""

    batches: int
    of: int
    windows: int

    def describe(self) -> str:
        return (f"planned on a sample of {self.batches} of {self.of} batches "
                f"({self.windows} evenly spaced windows)")

    def to_json(self) -> dict[str, Any]:
        return {"batches": self.batches, "of": self.of, "windows": self.windows}


def sample_steps(steps: Sequence[T], size: int, windows: int = WINDOWS) -> tuple[list[T], PlanSample | None]:
    """``steps`` when they are at most ``size`` (or ``size`` is 0: no sampling), else
    ``size`` of them in ``windows`` evenly spaced windows of consecutive steps, and the
    :class:`PlanSample` that says so."""
    if size < 0 or windows < 1:
        raise ConfigError(f"a sample needs size >= 0 and windows >= 1, got size {size}, windows {windows}")
    if size == 0 or len(steps) <= size:
        return list(steps), None
    w = min(windows, size)
    out: list[T] = []
    for i in range(w):
        start = i * len(steps) // w
        out.extend(steps[start:start + size // w + (i < size % w)])
    return out, PlanSample(len(out), len(steps), w)
