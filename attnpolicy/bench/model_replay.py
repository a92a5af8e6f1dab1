"""A real replay of prefill batches through a :class:`~attnpolicy.engine.runner.StaticModelRunner`.

Each batch runs as the runner serves it (the guarded policy decides, the batch is
placed, the graph of its key comes from the cache, compiled on a miss, and runs);
its compile (a miss's build: compile and first run) and its run are timed apart on
the chosen clock. With ``check`` every output is compared with a reference model
built from the same SPEC (same seeded weights) run eagerly, one sequence at a time,
with transformers' own SDPA attention. With a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` the model-level
simulator's prediction for the same batches, config and eviction sits beside the
measurement, with predicted/measured ratios.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnpolicy.bench.model_calibration import clock_of
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner, eager_logits
from attnpolicy.modelling.simulation import ModelSimRow, simulate_model
from attnpolicy.modelling.whole_model_costs import ModelCostModel

#: fp32 tolerance of the runner's logits against the eager reference.
TOLERANCE = 1e-4


@dataclass(frozen=True)
class ModelReplay:
    """What a replay measured, and (with a cost model) what the simulator predicted."""

    spec: str
    policy: str
    batches: int
    modes: dict[str, int]
    hits: int
    misses: int
    compiles: int
    evictions: int
    clock: str
    compile_seconds: float
    run_seconds: float
    max_abs_err: float | None
    predicted: ModelSimRow | None

    @property
    def total_seconds(self) -> float:
        return self.compile_seconds + self.run_seconds

    @property
    def passed(self) -> bool | None:
        return None if self.max_abs_err is None else self.max_abs_err <= TOLERANCE

    def ratios(self) -> dict[str, float | None]:
        """predicted / measured misses, compile seconds, run seconds and total seconds."""
        p = self.predicted
        if p is None:
            return {}

        def ratio(a: float, b: float) -> float | None:
            return a / b if b else None
        return {"misses": ratio(p.misses, self.misses),
                "compile_seconds": ratio(p.compile_seconds + p.warmup_seconds, self.compile_seconds),
                "run_seconds": ratio(p.run_seconds, self.run_seconds),
                "total_seconds": ratio(p.total_seconds, self.total_seconds)}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["predicted"] = None if self.predicted is None else self.predicted.to_json()
        return {**data, "total_seconds": self.total_seconds, "passed": self.passed,
                "predicted_over_measured": self.ratios()}


def replay_model(spec: str, layouts: Sequence[BatchLayout], config: AttnPolicyConfig, *, check: bool = False,
                 cost: ModelCostModel | None = None, clock: str = "cpu", threads: int = 1,
                 progress: Callable[[str], None] | None = None) -> ModelReplay:
    """Serve ``layouts`` (random token ids, seeded) through a runner of SPEC's model under ``config``."""
    torch.set_num_threads(threads)
    model, described = load_model(spec)
    reference = load_model(spec)[0] if check else None
    runner = StaticModelRunner(model, config)
    now = clock_of(clock)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    compile_s = run_s = 0.0
    err: float | None = 0.0 if check else None
    modes: dict[str, int] = {}
    try:
        for layout in layouts:
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            mode = runner.decide(layout).mode
            modes[mode.value] = modes.get(mode.value, 0) + 1
            placing = now()
            batch = runner.prepare(ids, layout, mode)
            missed = batch.key not in runner.cache
            start = now()
            graph = runner.graph_for(batch, pin=True)
            built = now()
            try:
                with torch.no_grad():
                    out = batch.scatter(graph(*batch.inputs), layout.q_tokens)
            finally:
                runner.cache.unpin([batch.key])
            # a batch's run is what the calibration times (placement, graph, scatter); a miss's build apart
            run_s += now() - built + start - placing + (0.0 if missed else built - start)
            compile_s += built - start if missed else 0.0
            if reference is not None and err is not None:
                err = max(err, float((out - eager_logits(reference, ids, layout)).abs().max()))
            if progress:
                progress(str(batch.key))
        stats = runner.cache.stats()
    finally:
        runner.close()
    predicted = simulate_model(layouts, cost, [config], [config.eviction])[0] if cost is not None else None
    return ModelReplay(described, config.policy, len(layouts), modes, stats.hits, stats.misses, stats.compiles,
                       stats.evictions, clock, compile_s, run_s, err, predicted)
