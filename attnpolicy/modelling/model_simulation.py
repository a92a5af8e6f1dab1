"""Simulation on whole-model graphs: a workload's batches as the
:class:`~attnpolicy.integrations.static_model.ModelKey` stream a
:class:`~attnpolicy.integrations.static_model.StaticModelRunner` would request,
replayed through a bounded cache with a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`.

Each batch's mode is the guarded policy's decision (as the runner's), its key the
runner's own :func:`~attnpolicy.integrations.static_model.model_key_for`, and the key
stream is replayed by :func:`~attnpolicy.cache.key_stream.replay_stream` with the
runner's cache bounds and eviction, the graphs' bytes being the runner's own
estimate: the misses, compiles and evictions are the ones a real runner replay of
the same batches counts (tested). Seconds come from the cost model: a compile per
miss, a run per batch, and the process's one-off ``warmup_seconds`` once when
anything compiles. ``belady`` is the offline optimum (the fewest misses any eviction
achieves on the stream).

The runner serves prefill without cached context, so the batches are prefill-only
(an embedding-style workload: :func:`model_former`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from attnpolicy.cache.key_stream import replay_stream
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.integrations.static_model import ModelKey, model_key_for
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch


def model_former(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> BatchFormer:
    """The batch former of a model-graph workload: prefill only, each prompt in one step."""
    return BatchFormer(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       chunked_prefill=False, prefill_only=True, max_model_len=max_model_len)


def model_layouts(steps: Sequence[ScheduledBatch | BatchLayout]) -> list[BatchLayout]:
    """The layouts of ``steps``; one with cached context (decode, a prefill chunk) is an
    error: whole-model graphs here serve prefill only."""
    layouts = [s.layout if isinstance(s, ScheduledBatch) else s for s in steps]
    for i, layout in enumerate(layouts):
        if layout.has_context or not layout.causal:
            raise ConfigError(f"batch {i} ({layout.describe()}) is not a causal prefill without cached context: "
                              "whole-model graphs serve prefill-only workloads")
    return layouts


def model_config(model: ModelCostModel, max_seq_len: int, max_batch_tokens: int, **fields: Any
                 ) -> AttnPolicyConfig:
    """The runner config a simulation of ``model`` assumes (its backend, the limits), with ``fields``."""
    return AttnPolicyConfig(**{"backend": model.backend, "max_seq_len": max_seq_len,
                               "max_batch_tokens": max_batch_tokens, "strict": "off", **fields})


def spec_of(model: ModelCostModel) -> TensorSpec:
    """The attention tensor spec the runner's policy sees for ``model``."""
    d = model.dims
    return TensorSpec("float32" if d.itemsize == 4 else "float16", d.heads, d.kv_heads, d.head_dim)


def decided_modes(layouts: Sequence[BatchLayout], config: AttnPolicyConfig, spec: TensorSpec) -> list[MaskMode]:
    """The guarded policy's mode per layout, in the context the runner gives it."""
    guard = Guard.for_policy(config.policy, config.policy_options, on_illegal=config.on_illegal,
                             fallback=MaskMode(config.fallback_mode))
    context = PolicyContext(config=config, spec=spec)
    return [guard.decide(layout, context).mode for layout in layouts]


def key_stream(layouts: Sequence[BatchLayout], modes: Sequence[MaskMode], config: AttnPolicyConfig
               ) -> list[ModelKey]:
    """The key each batch runs under (the runner's :func:`model_key_for`)."""
    return [model_key_for(layout, mode, config) for layout, mode in zip(layouts, modes)]


@dataclass(frozen=True)
class ModelSimRow:
    """One replay of a key stream: the cache's counters and the modelled seconds."""

    policy: str
    buckets: str
    max_graphs: int | None
    max_bytes: int | None
    eviction: str
    batches: int
    graphs: int
    misses: int
    compiles: int
    evictions: int
    compile_seconds: float
    warmup_seconds: float
    run_seconds: float
    peak_graphs: int
    peak_bytes: int

    @property
    def total_seconds(self) -> float:
        return self.compile_seconds + self.warmup_seconds + self.run_seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_seconds": self.total_seconds}


def replay_keys(keys: Sequence[ModelKey], model: ModelCostModel, config: AttnPolicyConfig, eviction: str
                ) -> ModelSimRow:
    """Replay ``keys`` through a cache of ``config``'s bounds with ``eviction`` (or
    ``belady``), costed by ``model``."""
    ids: dict[ModelKey, int] = {}
    stream = [ids.setdefault(k, len(ids)) for k in keys]
    distinct = list(ids)
    sizes = [model.graph_bytes(k) for k in distinct]
    costs = [model.compile_seconds(k) for k in distinct]
    run = [model.run_seconds(k) for k in distinct]
    stats = replay_stream(stream, sizes, costs, max_graphs=config.max_graphs, max_bytes=config.max_bytes,
                          eviction=eviction, oversize=config.oversize,
                          name=lambda i: distinct[i])
    return ModelSimRow(config.policy, config.buckets.describe(), config.max_graphs, config.max_bytes, eviction,
                       len(keys), len(distinct), stats.misses, stats.compiles, stats.evictions,
                       stats.compile_seconds, model.warmup_seconds if stats.compiles else 0.0,
                       sum(run[i] for i in stream), stats.peak_graphs, stats.peak_bytes)


def simulate_model(layouts: Sequence[BatchLayout], model: ModelCostModel, configs: Sequence[AttnPolicyConfig],
                   evictions: Sequence[str]) -> list[ModelSimRow]:
    """One row per config × eviction: each config's policy decides, its buckets key."""
    spec = spec_of(model)
    rows = []
    for config in configs:
        keys = key_stream(layouts, decided_modes(layouts, config, spec), config)
        rows += [replay_keys(keys, model, config, eviction) for eviction in evictions]
    return rows
