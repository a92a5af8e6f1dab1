"""Extrapolation: the batches of a workload a cost model prices outside the range it
was calibrated on.

A fit is linear in its features and extrapolates beyond its samples without saying
so; :func:`outside_range` counts the batches it prices there, so that every command
that prices a workload can say how many (one line, and a JSON field). A batch is
measured in the dimensions its graphs' fits were calibrated in, each against the
largest calibrated value (:class:`Extent`):

- attention calls (:class:`~attnpolicy.graphs.costmodel.CostModel`): its packed query
  tokens or its longest sequence's keys, whichever is more (the longest length any
  call of the batch can span, under any policy), against the run samples' largest
  bucket (:attr:`~attnpolicy.graphs.costmodel.CostModel.calibrated_len`);
- whole-model graphs (:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`):
  its tokens and its sequences (a VARLEN graph's segments);
- whole-model step graphs (whole requests): its rows, its cached context and its
  sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from attnpolicy.core.layout import BatchLayout
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch


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
class Extent:
    """The dimensions a cost model's fits were calibrated in: their names, the largest
    calibrated value of each (``limits``) and a batch's value of each (``sizes``)."""

    names: tuple[str, ...]
    limits: tuple[int, ...]
    sizes: Callable[[BatchLayout], tuple[int, ...]]

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


def extent(model: CostModel | ModelCostModel, step_graphs: bool = False) -> Extent | None:
    """What ``model`` was calibrated on (``step_graphs``: its step graphs'); ``None``
    when that is unknown (a model without samples)."""
    if isinstance(model, CostModel):
        length = model.calibrated_len
        return None if length is None else Extent(("tokens",), (length,), _call_size)
    if step_graphs:
        step = model.step_range
        return None if step is None else Extent(("rows", "context", "sequences"), step, _step_size)
    graph = model.calibrated_range
    return None if graph is None else Extent(("tokens", "segments"), graph, _graph_size)


def outside_range(model: CostModel | ModelCostModel, steps: Sequence[ScheduledBatch | BatchLayout],
                  step_graphs: bool = False) -> OutsideRange | None:
    """The batches of ``steps`` larger than ``model`` was calibrated on in any dimension
    of its :func:`extent`; ``None`` when its range is unknown."""
    bounds = extent(model, step_graphs)
    if bounds is None:
        return None
    sizes = [bounds.sizes(s.layout if isinstance(s, ScheduledBatch) else s) for s in steps]
    outside = sum(any(v > limit for v, limit in zip(size, bounds.limits, strict=True)) for size in sizes)
    most = [max((size[i] for size in sizes), default=0) for i in range(len(bounds.names))]
    return OutsideRange(outside, len(sizes), bounds.describe(most), bounds.describe(bounds.limits))
