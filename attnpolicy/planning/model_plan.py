"""Plan whole-model graphs: the bucket list, policy and eviction for a model cost model.

Whole-model graphs cost seconds each to compile, so the number of distinct graphs
(buckets × modes, VARLEN: combinations of buckets) weighs on the plan far more than
padding. For each stateless policy the planner decides every batch's mode once, then
grows a bucket list greedily: it starts from the buckets the largest batch needs and
adds, one at a time, the candidate size (every needed length rounded up to a
multiple of ``align``, :data:`~attnpolicy.planning.bucket_search.ALIGN` by default, or
to its limit) that most lowers the simulated total at the given capacity (best of the
live evictions tried), until no size lowers it or ``max_buckets`` is reached. Every
candidate is costed by a real replay of its key stream
(:func:`~attnpolicy.modelling.model_simulation.replay_keys`). The plan is compared
with the base config's buckets (pow2) under LRU and under Belady at the same capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.modelling.model_simulation import ModelSimRow, decided_modes, key_stream, replay_keys, spec_of
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.bucket_search import ALIGN


@dataclass(frozen=True)
class ModelPolicyPlan:
    """One policy's plan: its buckets and eviction, the simulated row, and the base
    buckets' rows under LRU and Belady."""

    policy: str
    buckets: tuple[int, ...]
    row: ModelSimRow
    base_lru: ModelSimRow
    base_belady: ModelSimRow

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "buckets": list(self.buckets), "row": self.row.to_json(),
                "base_lru": self.base_lru.to_json(), "base_belady": self.base_belady.to_json(),
                "speedup_vs_base_lru": self.base_lru.total_seconds / self.row.total_seconds}


@dataclass(frozen=True)
class ModelPlan:
    """The best policy's plan (lowest simulated total) and every policy's."""

    config: AttnPolicyConfig
    policies: tuple[ModelPolicyPlan, ...]

    @property
    def chosen(self) -> ModelPolicyPlan:
        return min(self.policies, key=lambda p: p.row.total_seconds)

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.chosen.policy, "buckets": list(self.chosen.buckets),
                "eviction": self.chosen.row.eviction, "max_graphs": self.config.max_graphs,
                "policies": [p.to_json() for p in self.policies]}


def _needs(layouts: Sequence[BatchLayout], modes: Sequence[MaskMode]) -> tuple[list[int], list[int]]:
    """The lengths bucketed by ``max_seq_len`` (CAUSAL totals, VARLEN sequences) and by
    ``max_batch_tokens`` (MASK totals)."""
    seq: list[int] = []
    batch: list[int] = []
    for layout, mode in zip(layouts, modes):
        if mode is MaskMode.VARLEN:
            seq += layout.q_lens
        elif mode is MaskMode.CAUSAL:
            seq.append(sum(layout.q_lens))
        else:
            batch.append(sum(layout.q_lens))
    return seq, batch


def plan_model_policy(layouts: Sequence[BatchLayout], policy: str, base: AttnPolicyConfig, model: ModelCostModel,
                      evictions: Sequence[str], max_buckets: int, align: int = ALIGN) -> ModelPolicyPlan:
    """The greedy bucket list of ``policy`` (see the module docstring)."""
    if align < 1:
        raise ConfigError(f"align must be >= 1, got {align}")

    def _up(n: int, limit: int) -> int:
        return min(-(-n // align) * align, limit)

    with_policy = base.model_copy(update={"policy": policy})
    modes = decided_modes(layouts, with_policy, spec_of(model))
    seq, batch = _needs(layouts, modes)
    limit_seq, limit_batch = base.max_seq_len, base.max_batch_tokens
    required = {_up(max(seq), limit_seq)} if seq else set()
    if batch:
        required.add(_up(max(batch), limit_batch))
    if min(required) > limit_seq:  # a list needs a size within max_seq_len
        required.add(limit_seq)
    candidates = sorted({_up(n, limit_seq) for n in seq} | {_up(n, limit_batch) for n in batch})

    def cost(sizes: set[int]) -> ModelSimRow:
        config = AttnPolicyConfig(**{**with_policy.model_dump(),
                                     "buckets": Buckets(kind="list", sizes=tuple(sorted(sizes)))})
        keys = key_stream(layouts, modes, config)
        return min((replay_keys(keys, model, config, e) for e in evictions), key=lambda r: r.total_seconds)

    chosen, best = set(required), cost(required)
    while len(chosen) < max_buckets:
        trials = [(cost(chosen | {c}), c) for c in candidates if c not in chosen]
        if not trials:
            break
        row, c = min(trials, key=lambda t: t[0].total_seconds)
        if row.total_seconds >= best.total_seconds:
            break
        chosen.add(c)
        best = row
    base_keys = key_stream(layouts, decided_modes(layouts, with_policy, spec_of(model)), with_policy)
    return ModelPolicyPlan(policy, tuple(sorted(chosen)), best, replay_keys(base_keys, model, with_policy, "lru"),
                           replay_keys(base_keys, model, with_policy, "belady"))


def plan_model_graphs(layouts: Sequence[BatchLayout], base: AttnPolicyConfig, model: ModelCostModel,
                      policies: Sequence[str], evictions: Sequence[str], max_buckets: int,
                      progress: Callable[[str], None] | None = None, align: int = ALIGN) -> ModelPlan:
    """Plan every policy of ``policies``, sizes aligned to ``align``; the config is the
    best one's (buckets, policy, eviction)."""
    plans = []
    for policy in policies:
        plans.append(plan_model_policy(layouts, policy, base, model, evictions, max_buckets, align))
        if progress:
            progress(policy)
    best = min(plans, key=lambda p: p.row.total_seconds)
    config = AttnPolicyConfig(**{**base.model_dump(), "policy": best.policy, "eviction": best.row.eviction,
                                 "buckets": Buckets(kind="list", sizes=best.buckets)})
    return ModelPlan(config, tuple(plans))
