"""Cost models that tests price with: a synthetic whole-model cost model, and the
built-in attention model with compiles too pricey ever to pay off."""

from __future__ import annotations

from attnpolicy.engine.model_specs import spec_config
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.modelling.whole_model_costs import ModelCostModel, ModelDims, ModelFit, StepFits

#: The built-in model with every compile priced at a million seconds.
PRICEY = CostModel.default().model_copy(update={"compile": {f: Fit(base=1e6) for f in CostModel.default().compile}})


def synthetic(compile_base: float = 2.0) -> ModelCostModel:
    """A whole-model cost model of a tiny model: compiles cost ``compile_base`` seconds
    plus a millisecond per token, runs grow with tokens, cells and segments."""
    fit = ModelFit(base=compile_base, per_token=1e-3)
    run = ModelFit(base=1e-3, per_token=1e-5, per_cell=1e-8, per_segment=1e-4)
    rss = ModelFit(base=1e6)
    return ModelCostModel(spec="synthetic", dims=ModelDims(hidden=64, heads=2, kv_heads=1, head_dim=32,
                                                            intermediate=128, vocab=64, layers=1),
                          compile=dict.fromkeys(("causal", "mask", "varlen"), fit),
                          run=dict.fromkeys(("causal", "mask", "varlen"), run),
                          rss=dict.fromkeys(("causal", "mask", "varlen"), rss), warmup_seconds=0.5)


def with_steps(compile_base: float = 1.0) -> ModelCostModel:
    """:func:`synthetic` with step fits: compile ``compile_base`` s plus 1 ms per row and
    1 µs per context column; run 1 ms plus 10 µs per row, 1 µs per context column and
    10 ns per cell."""
    compile_fit = ModelFit(base=compile_base, per_token=1e-3, per_context=1e-6)
    run = ModelFit(base=1e-3, per_token=1e-5, per_context=1e-6, per_cell=1e-8)
    modes = ("causal", "mask", "varlen")
    return synthetic().model_copy(update={"steps": StepFits(
        compile=dict.fromkeys(modes, compile_fit), run=dict.fromkeys(modes, run),
        rss=dict.fromkeys(modes, ModelFit(base=1e6)))})


def of_model(model: ModelCostModel, spec: str) -> ModelCostModel:
    """``model``'s fits as a cost model calibrated on the model of ``spec`` (its spec,
    architecture and dims), as ``run --model SPEC`` requires."""
    config = spec_config(spec)
    return model.model_copy(update={"spec": spec, "model_type": config.model_type, "dims": ModelDims.of(config)})


def with_rows(model: ModelCostModel) -> ModelCostModel:
    """``model`` with ROWS fits: its MASK fits, plus 0.1 ms of run per row (prefill and steps)."""
    def plus(fits, extra=None):
        return {**fits, "rows": extra or fits["mask"]}
    run = model.run["mask"].model_copy(update={"per_segment": 1e-4})
    steps = model.steps
    if steps is not None:
        steps = steps.model_copy(update={"compile": plus(steps.compile), "rss": plus(steps.rss),
                                         "run": plus(steps.run, steps.run["mask"].model_copy(
                                             update={"per_segment": 1e-4}))})
    return model.model_copy(update={"compile": plus(model.compile), "run": plus(model.run, run),
                                    "rss": plus(model.rss), "steps": steps})
