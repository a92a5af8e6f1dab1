"""Compile stalls on whole-model graphs, modelled: synchronous compiles against
background compiles with pad-up, as a
:class:`~attnpolicy.integrations.static_model.StaticModelRunner` serves them.

The key stream is the model simulation's (:func:`~attnpolicy.modelling.model_simulation.key_stream`:
the guarded policy's modes, the runner's keys); a cache of the config's bounds and
eviction holds the graphs, sized by the cost model. Time is the
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`'s: ``sync`` stalls a
batch for the compile seconds of its miss; ``background`` follows the runner's rule
(:mod:`~attnpolicy.integrations.model_background`): a miss runs on the smallest
resident graph that dominates its key (its run seconds) else eagerly (costed as its
own graph's run seconds: the model holds no eager figure), while the compile runs on
one worker (compiles queue) and switches in ``switch_after`` batches after its
request, the batch waiting ``max(0, finish − now)`` then. The worker is assumed not
to slow the batches; the process's one-off ``warmup_seconds`` is left out of both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch.stats import percentile
from attnpolicy.integrations.model_background import dominates
from attnpolicy.integrations.static_model import ModelKey
from attnpolicy.modelling.model_simulation import decided_modes, key_stream, spec_of
from attnpolicy.modelling.whole_model_costs import ModelCostModel


@dataclass(frozen=True)
class ModelStallRow:
    """One modelled run on whole-model graphs: run seconds (as served: padded up or
    eager included) plus stall seconds (synchronous compiles, waits at switch points)."""

    policy: str
    capacity: int | None
    compile_mode: str
    switch_after: int
    batches: int
    compiles: int
    compile_seconds: float
    padded_up: int
    eager_served: int
    run_seconds: float
    stall_seconds: float
    stall_p50: float
    stall_p99: float
    stall_max: float
    stalled_batches: int

    @property
    def total_seconds(self) -> float:
        return self.run_seconds + self.stall_seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_seconds": self.total_seconds}


def model_stall_row(layouts: Sequence[BatchLayout], model: ModelCostModel, config: AttnPolicyConfig) -> ModelStallRow:
    """Replay ``layouts`` under ``config`` (its policy, buckets, bounds, ``compile_mode``
    and ``switch_after``) on ``model``'s clock."""
    keys = key_stream(layouts, decided_modes(layouts, config, spec_of(model)), config)
    cache: GraphCache[ModelKey] = GraphCache.from_config(config, sizeof=model.graph_bytes,
                                                         compile_cost=lambda key, _: model.compile_seconds(key))
    background = config.compile_mode == "background"
    pending: dict[ModelKey, tuple[float, int]] = {}  # key -> (modelled finish, due batch)
    now = worker_free = run = compile_seconds = 0.0
    compiles = padded = eager = 0
    stalls: list[float] = []
    for batch, key in enumerate(keys, start=1):
        t = now
        for other, (finish, due) in list(pending.items()):  # switch points, in request order
            if due <= batch:
                del pending[other]
                t = max(t, finish)
                cache.get_or_compile(other, _itself(other))
        if key in cache:
            cache.get_or_compile(key, _itself(key))
            seconds = model.run_seconds(key)
        elif not background:
            cache.get_or_compile(key, _itself(key))
            t += model.compile_seconds(key)
            compiles += 1
            compile_seconds += model.compile_seconds(key)
            seconds = model.run_seconds(key)
        else:
            if key not in pending:
                worker_free = max(t, worker_free) + model.compile_seconds(key)
                pending[key] = (worker_free, batch + config.switch_after)
                compiles += 1
                compile_seconds += model.compile_seconds(key)
            resident = cache.keys()  # a snapshot (the cache is not iterable)
            larger = [k for k in resident if isinstance(k, ModelKey) and dominates(k, key)]
            if larger:
                padded += 1
                seconds = model.run_seconds(min(larger, key=lambda k: (k.tokens, k.segments)))
            else:
                eager += 1
                seconds = model.run_seconds(key)
        if t > now:
            stalls.append(t - now)
        run += seconds
        now = t + seconds
    stalls.sort()
    n = len(keys)
    return ModelStallRow(config.policy, config.max_graphs, config.compile_mode, config.switch_after, n,
                         compiles, compile_seconds, padded, eager, run, sum(stalls),
                         percentile(stalls, n, 0.5), percentile(stalls, n, 0.99),
                         stalls[-1] if stalls else 0.0, len(stalls))


def compare_model_stalls(layouts: Sequence[BatchLayout], model: ModelCostModel, configs: Sequence[AttnPolicyConfig]
                         ) -> list[ModelStallRow]:
    """For each config, its ``sync`` row then its ``background`` row."""
    return [model_stall_row(layouts, model, config.model_copy(update={"compile_mode": mode}))
            for config in configs for mode in ("sync", "background")]


def _itself(key: ModelKey) -> Callable[[], ModelKey]:
    """The modelled build of ``key``'s graph: the key stands for its graph."""
    return lambda: key
