"""Extrapolation: the batches of a workload a cost model prices outside the range it
was calibrated on.

A fit is linear in its features and extrapolates beyond its samples without saying
so; :func:`outside_range` counts the batches it prices there, so that every command
that prices a workload can say how many (one line, and a JSON field). A batch is
measured in the dimensions its level's fits were calibrated in, each against the
largest calibrated value; the level says which (its :class:`Reach`):

- attention calls (:class:`~attnpolicy.graphs.costmodel.CostModel`): its packed query
  tokens or its longest sequence's keys, whichever is more (the longest length any
  call of the batch can span, under any policy), against the run samples' largest
  bucket (:attr:`~attnpolicy.graphs.costmodel.CostModel.calibrated_len`), :data:`CALL_RANGE`;
- whole-model graphs (:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`):
  its tokens and its sequences (a VARLEN graph's segments), :data:`GRAPH_RANGE`;
- whole-model step graphs (whole requests): its rows, its cached context and its
  sequences, :data:`STEP_RANGE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

from attnpolicy.core.layout import BatchLayout
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch

M = TypeVar("M")


@dataclass(frozen=True)
class OutsideRange:
    """``outside`` of ``batches`` batches priced outside the calibrated range; the
    largest batch size (``largest``) and the largest calibrated one (``calibrated``)."""

    outside: int
    batches: int
    largest: str
    calibrated: str

    def line(self) -> str:
        """``N of M batches priced outside the calibrated range (sizes up to X, calibrated to Y)``."""
        return (f"{self.outside} of {self.batches} batches priced outside the calibrated range "
                f"(sizes up to {self.largest}, calibrated to {self.calibrated})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def batch_len(layout: BatchLayout) -> int:
    """A batch's size against an attention-call model's range: its packed query tokens
    or its longest sequence's keys, whichever is more."""
    return max(layout.total_tokens, layout.max_kv_len)


@dataclass(frozen=True)
class Reach(Generic[M]):
    """What a level's fits are calibrated in: the dimensions' names, a batch's value of
    each (``sizes``), a cost model's largest calibrated value of each (``limits``:
    ``None`` when unknown, a model without samples) and the command that calibrates
    larger batches (``covers``)."""

    names: tuple[str, ...]
    limits: Callable[[M], tuple[int, ...] | None]
    sizes: Callable[[BatchLayout], tuple[int, ...]]
    covers: str

    def describe(self, values: Sequence[int]) -> str:
        """``values`` named: ``8 tokens``, ``8 tokens and 2 segments``, ``a, b and c``."""
        parts = [f"{v} {n}" for v, n in zip(values, self.names, strict=True)]
        return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _call_size(layout: BatchLayout) -> tuple[int, ...]:
    return (batch_len(layout),)


def _graph_size(layout: BatchLayout) -> tuple[int, ...]:
    return layout.total_tokens, layout.num_seqs


def _step_size(layout: BatchLayout) -> tuple[int, ...]:
    rows = sum(layout.q_lens)
    return rows, sum(layout.kv_lens) - rows, layout.num_seqs


#: Attention calls: a batch's :func:`batch_len` against the longest calibrated bucket.
CALL_RANGE: Reach[CostModel] = Reach(
    ("tokens",), lambda m: None if m.calibrated_len is None else (m.calibrated_len,), _call_size,
    "'attnpolicy calibrate --max-len N' covers longer batches")
#: Whole-model graphs: a batch's tokens and sequences.
GRAPH_RANGE: Reach[ModelCostModel] = Reach(
    ("tokens", "segments"), lambda m: m.calibrated_range, _graph_size,
    "'attnpolicy calibrate --model SPEC --sizes' covers larger graphs")
#: Whole-model step graphs (whole requests): a step's rows, cached context and sequences.
STEP_RANGE: Reach[ModelCostModel] = Reach(
    ("rows", "context", "sequences"), lambda m: m.step_range, _step_size,
    "'attnpolicy calibrate --model SPEC --sizes' covers larger steps")


def outside_range(model: M, steps: Sequence[ScheduledBatch | BatchLayout], reach: Reach[M]) -> OutsideRange | None:
    """The batches of ``steps`` larger than ``model`` was calibrated on in any dimension
    of ``reach`` (its level's); ``None`` when its range is unknown."""
    limits = reach.limits(model)
    if limits is None:
        return None
    sizes = [reach.sizes(s.layout if isinstance(s, ScheduledBatch) else s) for s in steps]
    outside = sum(any(v > limit for v, limit in zip(size, limits, strict=True)) for size in sizes)
    most = [max((size[i] for size in sizes), default=0) for i in range(len(reach.names))]
    return OutsideRange(outside, len(sizes), reach.describe(most), reach.describe(limits))
