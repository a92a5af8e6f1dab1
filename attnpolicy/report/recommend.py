"""The report's answer: the configuration to run, from ``attnpolicy plan``.

The sweep picks the graph-cache bound to plan at: the bound (capacity, byte budget)
with the least peak graph memory whose best total is within :data:`TOLERANCE` of
the sweep's best. :func:`~attnpolicy.planning.graph_set.plan_graphs` then chooses
the policy, buckets, eviction and warm-up set at that bound, and its config is
saved where the report writes (``DIR/config``). The plan's total is set against
the defaults (``varlen``, pow2 buckets, unbounded, LRU) and against pow2 + LRU at
the same bound; the simulator's error on this machine comes from the validation
(predicted vs measured on the same batches).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from attnpolicy.cache.key_stream import BELADY
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.simulation import SimRow, simulate_layouts
from attnpolicy.planning.graph_set import POLICIES, GraphPlan, plan_graphs, plan_markdown, plannable, with_fields
from attnpolicy.workloads.batching import Step, Workload

#: A bound is "as good" as the sweep's best when its best total is within this fraction.
TOLERANCE = 0.10
#: Above this relative error (compile or total seconds) the report warns that its
#: predicted seconds are rough.
TRUST_LIMIT = 0.20
#: The config directory under the report's output directory.
CONFIG_DIR = "config"


class Checked(Protocol):
    """A validation row: predicted and measured seconds of one replay."""

    @property
    def predicted_compile_seconds(self) -> float: ...
    @property
    def measured_compile_seconds(self) -> float: ...
    @property
    def predicted_total_seconds(self) -> float: ...
    @property
    def measured_total_seconds(self) -> float: ...


@dataclass(frozen=True)
class SimulatorError:
    """Predicted / measured - 1 over the validated policies, summed (``None``: nothing
    measured); ``trusted``: both within :data:`TRUST_LIMIT`."""

    compile: float | None
    total: float | None
    trusted: bool


@dataclass(frozen=True)
class Recommendation:
    """What the report recommends and what it is predicted to save."""

    policy: str
    buckets: tuple[int, ...]
    max_graphs: int | None
    max_bytes: int | None
    eviction: str
    warm_graphs: int
    warm_compile_seconds: float
    warm_calls: int
    calls: int
    total_seconds: float
    peak_bytes: int
    hit_rate: float
    default_total_seconds: float
    default_peak_bytes: int
    pow2_lru_total_seconds: float
    pow2_lru_peak_bytes: int
    config_dir: str
    apply: tuple[str, ...]
    plan_seconds: float
    simulator_error: SimulatorError

    @property
    def saving_vs_defaults(self) -> float:
        """1 - plan total / defaults' total (above 0: the plan is faster)."""
        return 1 - self.total_seconds / self.default_total_seconds

    @property
    def saving_vs_pow2_lru(self) -> float:
        return 1 - self.total_seconds / self.pow2_lru_total_seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "saving_vs_defaults": self.saving_vs_defaults,
                "saving_vs_pow2_lru": self.saving_vs_pow2_lru}


def plannable_policies(policies: Sequence[str], base: AttnPolicyConfig) -> tuple[str, ...]:
    """The swept policies a plan can choose (stateless ones); the planner's defaults
    when none is."""
    def ok(name: str) -> bool:
        try:
            plannable(name, base)
        except (ConfigError, PolicyError):
            return False
        return True

    return tuple(p for p in policies if ok(p)) or POLICIES


def plan_bound(rows: Sequence[SimRow], policies: Sequence[str]) -> tuple[int | None, int | None]:
    """The (capacity, max_bytes) of least peak memory whose best online total (over
    ``policies``, bucket schemes and live evictions) is within :data:`TOLERANCE` of
    the best; unbounded when the sweep has no such row."""
    online = [r for r in rows if r.eviction != BELADY and r.policy in policies]
    if not online:
        return None, None
    best: dict[tuple[int | None, int | None], SimRow] = {}
    for r in online:
        k = (r.capacity, r.max_bytes)
        if k not in best or r.total_seconds < best[k].total_seconds:
            best[k] = r
    limit = (1 + TOLERANCE) * min(r.total_seconds for r in best.values())
    pick = min((r for r in best.values() if r.total_seconds <= limit),
               key=lambda r: (r.peak_bytes, r.total_seconds))
    return pick.capacity, pick.max_bytes


def _relative(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1 if measured > 0 else None


def simulator_error(validation: Sequence[Checked]) -> SimulatorError:
    """Summed predicted over summed measured seconds, minus 1, of the validation rows."""
    compile_err = _relative(sum(v.predicted_compile_seconds for v in validation),
                            sum(v.measured_compile_seconds for v in validation))
    total_err = _relative(sum(v.predicted_total_seconds for v in validation),
                          sum(v.measured_total_seconds for v in validation))
    trusted = all(e is not None and abs(e) <= TRUST_LIMIT for e in (compile_err, total_err))
    return SimulatorError(compile_err, total_err, trusted)


def apply_commands(config_dir: Path) -> tuple[str, ...]:
    """The commands that use the saved config: a replay that checks it, and a runtime."""
    return (f"attnpolicy run --config {config_dir} --check --limit 20",
            f"ATTNPOLICY_CONFIG={config_dir} vllm serve MODEL")


def recommend(steps: Sequence[Step], rows: Sequence[SimRow], base: AttnPolicyConfig, model: CostModel,
              policies: Sequence[str], evictions: Sequence[str], validation: Sequence[Checked], out: Path,
              max_buckets: int, source: str, workload: Workload | None = None) -> tuple[Recommendation, GraphPlan]:
    """Plan ``steps`` at the sweep's :func:`plan_bound`, save the config (and the plan's
    ``plan.md``, ``plan.json``) under ``out / CONFIG_DIR``, and compare it with the
    defaults and with pow2 + LRU at the same bound. ``workload``: what the batch
    former made of the trace (its rejected requests are counted in every row)."""
    rejected = workload.rejected if workload else 0
    start = time.perf_counter()
    candidates = plannable_policies(policies, base)
    capacity, nbytes = plan_bound(rows, candidates)
    live = [e for e in evictions if e != BELADY] or ["lru"]
    plan = plan_graphs(steps, with_fields(base, max_graphs=capacity, max_bytes=nbytes), model, candidates,
                       live, None, max_buckets, rejected=rejected)
    (defaults,) = simulate_layouts(steps, ["varlen"], [None], ["lru"], base, model, rejected=rejected)
    config_dir = out / CONFIG_DIR
    plan.config.save(config_dir)
    write_json(config_dir / "plan.json", {"source": source, "rejected": rejected,
                                          **({"workload": workload.to_json()} if workload else {}),
                                          **plan.to_json()})
    write_text_atomic(config_dir / "plan.md", plan_markdown(plan, source, workload))
    chosen, pow2 = plan.chosen, plan.chosen.baseline("lru")
    rec = Recommendation(
        policy=plan.policy, buckets=chosen.buckets, max_graphs=capacity, max_bytes=nbytes,
        eviction=chosen.eviction, warm_graphs=len(plan.warm), warm_compile_seconds=plan.warm_compile_seconds,
        warm_calls=sum(w.uses for w in plan.warm), calls=chosen.row.calls,
        total_seconds=chosen.row.total_seconds, peak_bytes=chosen.row.peak_bytes, hit_rate=chosen.row.hit_rate,
        default_total_seconds=defaults.total_seconds, default_peak_bytes=defaults.peak_bytes,
        pow2_lru_total_seconds=pow2.total_seconds, pow2_lru_peak_bytes=pow2.peak_bytes,
        config_dir=str(config_dir), apply=apply_commands(config_dir),
        plan_seconds=time.perf_counter() - start, simulator_error=simulator_error(validation))
    return rec, plan
