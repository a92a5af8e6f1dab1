"""Re-planning: measure how far the traffic has drifted from a plan, and refit it.

A plan is fitted to the traffic it saw. On a recent window of the layout stream,
:func:`measure_drift` compares the modelled total (compile + run, at the plan's
capacity) of the current config with that of a plan refitted on the window itself:

    drift = total(current config, window) / min(total(current config, window), total(refit plan, window)) - 1

so drift >= 0: the current config is a candidate too. 0 means the current plan is as
good as any the planner finds for the window (identical traffic gives 0); a refit that
models slower (it plans only the policies asked for, or its bucket search misses the
current buckets) is no drift. 0.1 means the window would run 10 % faster on the refit
plan. Both policies must be stateless (:func:`~attnpolicy.planning.graph_set.plannable`,
the rule ``attnpolicy plan`` applies): a policy that decides from the cache state has
no modelled row on a window. The refit is worth switching to when drift is
above a threshold (:data:`DRIFT_THRESHOLD` by default): the switch costs compiles, and
a small drift is sampling noise. :func:`switch_set` gives what the runtime needs to
switch without a stall: the new config, and the graphs of its warm set the current
warm set does not hold, to compile (or load) in the background before the new config
replaces the old one. :class:`Replanner` does this on a running dispatcher: it keeps
the recent layouts, measures the drift every N batches and switches through
:meth:`Dispatcher.switch_to <attnpolicy.dispatch.dispatcher.Dispatcher.switch_to>`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.bucket_schemes import base_scheme
from attnpolicy.modelling.simulation import SimRow
from attnpolicy.planning.call_table import CallTable
from attnpolicy.planning.graph_set import AttentionPlanLevel, GraphPlan, layouts_of, plan_graphs, plannable
from attnpolicy.workloads.batching import ScheduledBatch

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


def modelled_row(steps: Sequence[ScheduledBatch | BatchLayout], config: AttnPolicyConfig, model: CostModel,
                 spec: TensorSpec | None = None) -> SimRow:
    """``config`` (policy, buckets, capacity, eviction) replayed on ``steps``, modelled."""
    table = CallTable(layouts_of(steps), config.policy, config, model, spec)
    return table.rows(config, [config.eviction], base_scheme(config).name)[0]


def measure_drift(window: Sequence[ScheduledBatch | BatchLayout], current: AttnPolicyConfig, model: CostModel,
                  policies: Sequence[str] | None = None, spec: TensorSpec | None = None,
                  threshold: float = DRIFT_THRESHOLD) -> Drift:
    """The drift of ``current`` on ``window`` (module docstring); the refit plan keeps
    ``current``'s capacity and plans ``policies`` (default: ``current``'s policy).
    :class:`ConfigError` for a policy :func:`plannable` refuses, before any work."""
    policies = policies or [current.policy]
    for name in dict.fromkeys((current.policy, *policies)):
        plannable(name, current)
    row = modelled_row(window, current, model, spec)
    refit = plan_graphs(window, current, AttentionPlanLevel(model, spec), policies)
    best = min(row.total_seconds, refit.chosen.row.total_seconds)
    return Drift(row, refit, row.total_seconds / best - 1 if best > 0 else 0.0, threshold)


def switch_set(current: AttnPolicyConfig, new: AttnPolicyConfig) -> tuple[WarmShape, ...]:
    """The warm-set graphs of ``new`` that ``current``'s warm set does not hold: what the
    runtime compiles (or loads from a store) in the background before it switches."""
    held = {w.model_dump_json() for w in current.warmup}
    return tuple(w for w in new.warmup if w.model_dump_json() not in held)


@dataclass(frozen=True)
class DriftCheck:
    """One drift measurement of a :class:`Replanner`: after ``batch`` batches, on the
    last ``steps`` of them; ``switch``: the graphs the switch it requested builds
    (``None``: no switch requested)."""

    batch: int
    steps: int
    drift: float
    current_total_seconds: float
    refit_total_seconds: float
    switch: int | None


class Replanner:
    """A plan that follows the traffic of a running dispatcher.

    :meth:`observe` is told every batch's layout; it keeps the last ``window`` of them
    (default: ``every``) and, every ``every`` batches, measures the drift
    (:func:`measure_drift`, planning ``policies``) of the config the dispatcher runs,
    or is switching to, on them. Above ``threshold`` it asks the dispatcher to switch
    to the refit config for tensors of ``spec``: its warm set builds in the background
    while the running config serves (:mod:`~attnpolicy.dispatch.switch`)."""

    def __init__(self, spec: TensorSpec, *, every: int, window: int | None = None,
                 threshold: float = DRIFT_THRESHOLD, model: CostModel | None = None,
                 policies: Sequence[str] | None = None) -> None:
        for name, value in (("every", every), ("window", window)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"replan {name} must be an int >= 1, got {value!r}")
        self.spec, self.every, self.threshold = spec, every, threshold
        self.model = model or CostModel.default()
        self.policies = policies
        self.recent: deque[BatchLayout] = deque(maxlen=window or every)
        self.batches = 0
        self.checks: list[DriftCheck] = []

    def observe(self, dispatcher: Dispatcher, layout: BatchLayout) -> Drift | None:
        """Record the batch of ``layout`` (it has run); every ``every`` batches, the drift
        measured (and the switch requested when it is above the threshold)."""
        self.recent.append(layout)
        self.batches += 1
        if self.batches % self.every:
            return None
        current = dispatcher.switcher.config or dispatcher.config
        drift = measure_drift(list(self.recent), current, self.model, self.policies, self.spec, self.threshold)
        switch = len(dispatcher.switch_to(drift.refit.config, [self.spec])) if drift.replan else None
        self.checks.append(DriftCheck(self.batches, len(self.recent), drift.drift, drift.current.total_seconds,
                                      drift.refit.chosen.row.total_seconds, switch))
        return drift

    def to_json(self) -> dict[str, Any]:
        return {"every": self.every, "window": self.recent.maxlen, "threshold": self.threshold,
                "checks": [asdict(c) for c in self.checks]}
