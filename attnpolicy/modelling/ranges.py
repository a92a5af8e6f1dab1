"""Extrapolation: the batches of a workload a cost model prices outside the range it
was calibrated on.

A fit is linear in its features and extrapolates beyond its samples without saying
so; these functions count the batches it prices there, so that every command that
prices a workload can say how many (one line, and a JSON field). A batch's size is
compared with the largest calibrated one:

- attention-call models (:class:`~attnpolicy.graphs.costmodel.CostModel`): its
  packed query tokens or its longest sequence's keys, whichever is more (the longest
  length any call of the batch can span, under any policy), against the run
  samples' largest bucket (:attr:`~attnpolicy.graphs.costmodel.CostModel.calibrated_len`);
- whole-model models (:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`):
  its tokens and its sequences (a VARLEN graph's segments), against the most tokens
  and segments of a calibrated graph; a step of whole requests (each on a step graph),
  its rows, its cached context and its sequences against those of a calibrated step
  graph.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def outside_range(model: CostModel, steps: Sequence[ScheduledBatch | BatchLayout]) -> OutsideRange | None:
    """The batches of ``steps`` longer than ``model`` was calibrated on; ``None`` when
    its range is unknown (a model without samples)."""
    calibrated = model.calibrated_len
    if calibrated is None:
        return None
    sizes = [batch_len(s.layout if isinstance(s, ScheduledBatch) else s) for s in steps]
    outside = sum(n > calibrated for n in sizes)
    return OutsideRange(outside, len(sizes), f"{max(sizes, default=0)} tokens", f"{calibrated} tokens")


def model_outside_range(model: ModelCostModel, layouts: Sequence[BatchLayout]) -> OutsideRange | None:
    """The whole-model batches of ``layouts`` with more tokens or more sequences than
    any graph ``model`` was calibrated on; ``None`` when its range is unknown."""
    calibrated = model.calibrated_range
    if calibrated is None:
        return None
    tokens, segments = calibrated
    outside = sum(x.total_tokens > tokens or x.num_seqs > segments for x in layouts)
    most = (max((x.total_tokens for x in layouts), default=0), max((x.num_seqs for x in layouts), default=0))
    return OutsideRange(outside, len(layouts), f"{most[0]} tokens and {most[1]} segments",
                        f"{tokens} tokens and {segments} segments")


def step_outside_range(model: ModelCostModel, layouts: Sequence[BatchLayout]) -> OutsideRange | None:
    """The steps of ``layouts`` (each priced on a step graph) with more rows, more cached
    context or more sequences than any step graph ``model`` was calibrated on; ``None``
    when its range is unknown."""
    calibrated = model.step_range
    if calibrated is None:
        return None
    rows, context, seqs = calibrated
    sizes = [(sum(x.q_lens), sum(x.kv_lens) - sum(x.q_lens), x.num_seqs) for x in layouts]
    outside = sum(r > rows or c > context or n > seqs for r, c, n in sizes)
    most = [max((size[i] for size in sizes), default=0) for i in range(3)]
    return OutsideRange(outside, len(layouts), f"{most[0]} rows, {most[1]} context and {most[2]} sequences",
                        f"{rows} rows, {context} context and {seqs} sequences")
