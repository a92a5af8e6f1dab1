"""Re-planning: measure how far the traffic has drifted from a plan, and refit it.

A plan is fitted to the traffic it saw. On a recent window of the layout stream,
:func:`measure_drift` compares the modelled total (compile + run, at the plan's
capacity) of the current config with that of a plan refitted on the window itself:

    drift = total(current config, window) / total(refit plan, window) - 1

0 means the current plan is as good as any the planner finds for the window (identical
traffic gives 0, up to the candidates the planner searches); 0.1 means the window
would run 10 % faster on a refit plan. The refit is worth switching to when drift is
above a threshold (:data:`DRIFT_THRESHOLD` by default): the switch costs compiles, and
a small drift is sampling noise. :func:`switch_set` gives what the runtime needs to
switch without a stall: the new config, and the graphs of its warm set the current
warm set does not hold, to compile (or load) in the background before the new config
replaces the old one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.layout import BatchLayout
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.bucket_schemes import base_scheme
from attnpolicy.modelling.simulation import SimRow
from attnpolicy.planning.call_table import CallTable
from attnpolicy.planning.graph_set import GraphPlan, layouts_of, plan_graphs
from attnpolicy.workloads.batching import Step

#: Drift above which a refit plan replaces the current one (10 % modelled time).
DRIFT_THRESHOLD = 0.1


@dataclass(frozen=True)
class Drift:
    """The current config's modelled row on the window, the refit plan, and their ratio."""

    current: SimRow
    refit: GraphPlan
    drift: float
    threshold: float

    @property
    def replan(self) -> bool:
        """Whether the refit plan should replace the current one."""
        return self.drift > self.threshold


def modelled_row(steps: Sequence[Step | BatchLayout], config: AttnPolicyConfig, model: CostModel,
                 spec: TensorSpec | None = None) -> SimRow:
    """``config`` (policy, buckets, capacity, eviction) replayed on ``steps``, modelled."""
    table = CallTable(layouts_of(steps), config.policy, config, model, spec)
    return table.rows(config, [config.eviction], base_scheme(config).name)[0]


def measure_drift(window: Sequence[Step | BatchLayout], current: AttnPolicyConfig, model: CostModel,
                  policies: Sequence[str] | None = None, spec: TensorSpec | None = None,
                  threshold: float = DRIFT_THRESHOLD) -> Drift:
    """The drift of ``current`` on ``window`` (module docstring); the refit plan keeps
    ``current``'s capacity and plans ``policies`` (default: ``current``'s policy)."""
    row = modelled_row(window, current, model, spec)
    refit = plan_graphs(window, current, model, policies or [current.policy], spec=spec)
    best = refit.chosen.row.total_seconds
    return Drift(row, refit, row.total_seconds / best - 1 if best > 0 else 0.0, threshold)


def switch_set(current: AttnPolicyConfig, new: AttnPolicyConfig) -> tuple[WarmShape, ...]:
    """The warm-set graphs of ``new`` that ``current``'s warm set does not hold: what the
    runtime compiles (or loads from a store) in the background before it switches."""
    held = {w.model_dump_json() for w in current.warmup}
    return tuple(w for w in new.warmup if w.model_dump_json() not in held)
