"""The model-level cost model: predicted compile seconds, run seconds and bytes of
whole-model graphs (:class:`~attnpolicy.engine.keys.ModelKey`): prefill graphs and
step graphs over cached context (a key with ``kv``: decode, chunked prefill).

A :class:`ModelCostModel` is fitted by ``attnpolicy calibrate --model SPEC``
(:func:`attnpolicy.bench.calibration.calibrate`) through the real
:class:`~attnpolicy.engine.runner.StaticModelRunner`. Per mode it holds
one :class:`ModelFit` each for compile seconds, run seconds and the RSS a build
took, for prefill graphs and (``steps``) for step graphs. A fit is linear in four
features of a key, so one form serves every mode and both kinds of graph:

- ``tokens``: the graph's rows (VARLEN: the sum of its segments);
- ``context``: the cached context columns a step graph takes as input (its past keys
  and values, gathered into the graph's padded span; a prefill graph has none);
- ``cells``: the attention score cells per layer: each segment's rows times its context
  and rows (MASK and CAUSAL as one segment; a prefill's: ``tokens²``, VARLEN: the sum of
  each segment's square);
- ``segments``: the attention calls per layer (VARLEN: its segments, else 1).

A VARLEN graph's run seconds are so a sum over its segments (a per-segment cost and
each segment's cells) plus the graph's fixed and per-token cost, and its compile
seconds a fit over its total tokens and segment count. The bytes a cache bounds are
the runner's own static-shape estimate, computed exactly from the model's sizes
(:func:`~attnpolicy.engine.keys.estimate_bytes`), so a simulated cache
evicts as the runner's does. ``warmup_seconds`` is what the first compile of a
process pays on top of its key's fit.

A ROWS graph's features are its totals (rows times each row's length and context) and
its rows as segments: a fit of its own, over calibrated ROWS graphs of several row
counts. A model holds a fit of every mode for each quantity (prefill graphs and, when
calibrated, step graphs; ROWS where the calibration timed it), each coefficient bounded and each run fit positive as an
attention model's (:data:`~attnpolicy.graphs.costmodel.Coefficient`); it records the
model it was calibrated on (``spec``, ``model_type`` and ``dims``), which
:meth:`ModelCostModel.model_differs` compares with another model's config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from attnpolicy.core.modes import MaskMode
from attnpolicy.core.names import Backend
from attnpolicy.engine.keys import ModelKey, estimate_bytes
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import (
    COST_MODEL_VERSION,
    MAX_SIZE,
    Coefficient,
    Positive,
    Size,
    check_run_fits,
    nonnegative_fit,
)

#: A step graph's cached context columns: 0 up to :data:`~attnpolicy.graphs.costmodel.MAX_SIZE`.
Context = Annotated[int, Field(strict=True, ge=0, le=MAX_SIZE)]
#: The modes a model cost model prices, as JSON keys.
Mode = Literal["causal", "mask", "varlen", "rows"]
#: The modes every model cost model covers.
MODEL_COST_MODES: tuple[Mode, ...] = ("causal", "mask", "varlen")
#: The modes a calibration fits: every model's and ROWS (a file calibrated before ROWS
#: existed has no ROWS fits, and its model refuses to price a ROWS graph).
CALIBRATED_MODES: tuple[Mode, ...] = (*MODEL_COST_MODES, "rows")


#: A feature of a fit: one value, or an array of them priced elementwise.
Feature = TypeVar("Feature", float, np.ndarray)


def features(key: ModelKey) -> tuple[int, int, int, int, int]:
    """The fit's features of ``key``: 1, tokens, context, score cells per layer, segments
    (ROWS: its rows, each a segment of its length and context)."""
    return 1, key.tokens, key.context, sum(t * (c + t) for t, c in key.segments), len(key.segments)


class ModelFit(BaseModel):
    """``base + per_token·tokens + per_context·context + per_cell·cells +
    per_segment·segments`` (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: Coefficient = 0.0
    per_token: Coefficient = 0.0
    per_context: Coefficient = 0.0
    per_cell: Coefficient = 0.0
    per_segment: Coefficient = 0.0

    def __call__(self, key: ModelKey) -> float:
        _, tokens, context, cells, segments = features(key)
        return self.at(tokens, context, cells, segments)

    def at(self, tokens: Feature, context: Feature, cells: Feature, segments: int = 1) -> Feature:
        """The fit at these features (a shape priced without a key of this runner:
        another runtime's graph), or elementwise at arrays of them."""
        return (self.base + self.per_token * tokens + self.per_context * context + self.per_cell * cells
                + self.per_segment * segments)

    @classmethod
    def to_samples(cls, samples: Sequence[tuple[ModelKey, float]]) -> ModelFit:
        """The non-negative fit of ``(key, value)`` samples minimising the squared
        relative error: the best least-squares solution over every subset of the
        terms that has no negative coefficient. A term no sample has (prefill
        graphs' context) is left out of the fit (coefficient 0)."""
        if not samples:
            raise ConfigError("a model fit needs at least one (key, value) sample, got none")
        values = np.array([max(v, 1e-12) for _, v in samples], dtype=float)
        terms = np.array([features(k) for k, _ in samples], dtype=float)
        present = np.flatnonzero(terms.any(axis=0))
        coefficients = np.zeros(terms.shape[1])
        coefficients[present] = nonnegative_fit(terms[:, present], values)
        base, per_token, per_context, per_cell, per_segment = coefficients.tolist()
        return cls(base=base, per_token=per_token, per_context=per_context, per_cell=per_cell,
                   per_segment=per_segment)


class ModelSample(BaseModel):
    """One calibrated graph: its key's shape and what it measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode
    segments: tuple[Size, ...]
    compile_seconds: Coefficient
    run_seconds: Coefficient
    rss_bytes: Annotated[int, Field(strict=True)]
    estimate_bytes: Positive

    def key(self, backend: str) -> ModelKey:
        return key_of(self.mode, self.segments, backend)


class StepSample(BaseModel):
    """One calibrated step graph: its key's shape (per sequence its rows' and its
    context's buckets; one pair for MASK and CAUSAL) and what it measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode
    tokens: Size
    context: Context
    segments: tuple[tuple[Size, Context], ...]
    compile_seconds: Coefficient
    run_seconds: Coefficient
    rss_bytes: Annotated[int, Field(strict=True)]
    estimate_bytes: Positive

    def key(self, backend: str) -> ModelKey:
        return ModelKey(MaskMode(self.mode), self.tokens, self.context, self.segments, backend, kv=True)


def every_mode(fits: dict[Mode, ModelFit]) -> dict[Mode, ModelFit]:
    """``fits`` when it holds a fit of every mode; else ``ValueError`` naming those missing."""
    missing = [m for m in MODEL_COST_MODES if m not in fits]
    if missing:
        raise ValueError(f"needs a fit of every mode ({', '.join(MODEL_COST_MODES)}); missing: {', '.join(missing)}")
    return fits


def positive_runs(fits: dict[Mode, ModelFit]) -> dict[Mode, ModelFit]:
    """``fits`` (run seconds, every mode fitted) when each predicts a call of one token to
    take time (:func:`~attnpolicy.graphs.costmodel.check_run_fits`)."""
    check_run_fits({mode: fit.at(1, 0, 1) for mode, fit in fits.items()})
    return fits


#: A quantity's fits, one of every mode.
ModeFits = Annotated[dict[Mode, ModelFit], AfterValidator(every_mode)]
#: The run seconds' fits, one of every mode, each predicting a call to take time.
RunFits = Annotated[dict[Mode, ModelFit], AfterValidator(every_mode), AfterValidator(positive_runs)]


class StepFits(BaseModel):
    """The step graphs' fits per mode (compile seconds, run seconds, build RSS) and the
    samples they were fitted on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compile: ModeFits
    run: RunFits
    rss: ModeFits
    samples: tuple[StepSample, ...] = ()


def key_of(mode: str, segments: Sequence[int], backend: str) -> ModelKey:
    """The prefill :class:`ModelKey` of a mode and its segments' rows (one segment unless VARLEN)."""
    return ModelKey(MaskMode(mode), sum(segments), 0, tuple((n, 0) for n in segments), backend, kv=False)


class ModelDims(BaseModel):
    """The sizes of the calibrated model that its graphs' byte estimate needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: Size
    heads: Size
    kv_heads: Size
    head_dim: Size
    intermediate: Size
    vocab: Size
    layers: Size
    itemsize: Size = 4

    @classmethod
    def of(cls, config: Any, itemsize: int = 4) -> ModelDims:
        """The dims of a model of HF ``config`` whose parameters take ``itemsize`` bytes."""
        c = config
        return cls(hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   intermediate=c.intermediate_size, vocab=c.vocab_size, layers=c.num_hidden_layers,
                   itemsize=itemsize)


class ModelCostModel(BaseModel):
    """Predicted compile seconds, run seconds and bytes of one model's whole-model graphs.

    Immutable; it is the ``model`` section of a cost-model file
    (:class:`~attnpolicy.modelling.cost_file.CostFile`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = COST_MODEL_VERSION
    spec: str
    #: the architecture calibrated, as HF's ``model_type`` (``None``: not recorded by the calibration)
    model_type: str | None = None
    dims: ModelDims
    backend: Backend = "aot_eager"
    threads: Positive = 1
    clock: Literal["cpu", "wall"] = "cpu"
    torch_version: str = ""
    compile: ModeFits
    run: RunFits
    rss: ModeFits
    warmup_seconds: Coefficient = 0.0
    samples: tuple[ModelSample, ...] = ()
    #: the step graphs' fits (``None``: a calibration that measured prefill graphs only)
    steps: StepFits | None = None

    def model_differs(self, config: Any, name: str) -> str | None:
        """How the model of HF ``config`` (``name``: how the user named it) differs from
        the one this was calibrated on, in architecture or dims (one phrase naming both),
        or ``None``. A file without ``model_type`` compares its dims only."""
        mine = {"model_type": self.model_type, **self.dims.model_dump()}
        theirs = {"model_type": getattr(config, "model_type", None), **ModelDims.of(config).model_dump()}
        differs = [k for k in mine if mine[k] != theirs[k] and (k != "model_type" or self.model_type is not None)]
        if not differs:
            return None
        return (f"calibrated on {self.spec} ({_fields(mine, differs)}), not on {name} "
                f"({_fields(theirs, differs)})")

    @property
    def calibrated_range(self) -> tuple[int, int] | None:
        """The most tokens and the most segments of a calibrated graph; larger graphs are
        extrapolated. ``None``: a model without samples, whose range is unknown."""
        if not self.samples:
            return None
        return max(sum(x.segments) for x in self.samples), max(len(x.segments) for x in self.samples)

    @property
    def step_range(self) -> tuple[int, int, int] | None:
        """The most rows, context columns and sequences of a calibrated step graph; larger
        steps are extrapolated. ``None``: no step samples, whose range is unknown."""
        if self.steps is None or not self.steps.samples:
            return None
        samples = self.steps.samples
        return (max(x.tokens for x in samples), max(x.context for x in samples),
                max(len(x.segments) for x in samples))

    def step_fits(self) -> StepFits:
        """The step graphs' fits; :class:`ConfigError` naming the fix when it holds none."""
        if self.steps is None:
            raise ConfigError(f"the cost model of {self.spec} holds no step-graph fits (decode, chunked "
                              f"prefill): calibrate it again with attnpolicy calibrate --model SPEC")
        return self.steps

    def fit(self, key: ModelKey, what: Literal["compile", "run", "rss"]) -> ModelFit:
        """The fit of ``what`` for ``key``'s kind of graph and mode; :class:`ConfigError`
        naming the mode and the fix when this model holds no fit of it (a file calibrated
        before ROWS existed: no ROWS graph is priced by analogy with another mode's)."""
        source: ModelCostModel | StepFits = self.step_fits() if key.kv else self
        fits = {"compile": source.compile, "run": source.run, "rss": source.rss}[what]
        fit = fits.get(key.mode.value)
        if fit is None:
            kind = "step" if key.kv else "prefill"
            raise ConfigError(f"the cost model of {self.spec} holds no {kind}-graph fits of mode={key.mode.value} "
                              f"(calibrated before that mode): calibrate it again with attnpolicy calibrate "
                              f"--family model --model SPEC")
        return fit

    def compile_seconds(self, key: ModelKey) -> float:
        """Seconds to build the graph of ``key`` (compile and first run)."""
        return self.fit(key, "compile")(key)

    def run_seconds(self, key: ModelKey) -> float:
        """Seconds of one batch (one step) through the graph of ``key`` (placement and
        scatter included; a step's gather of its context and write-back too)."""
        return self.fit(key, "run")(key)

    def rss_bytes(self, key: ModelKey) -> int:
        """The RSS a build of ``key``'s graph is predicted to take (measured in calibration)."""
        return round(self.fit(key, "rss")(key))

    def graph_bytes(self, key: ModelKey) -> int:
        """The runner's static-shape estimate for ``key``: what its cache is bounded by."""
        d = self.dims
        config = SimpleNamespace(hidden_size=d.hidden, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads,
                                 head_dim=d.head_dim, intermediate_size=d.intermediate, vocab_size=d.vocab,
                                 num_hidden_layers=d.layers)
        return estimate_bytes(key, config, d.itemsize)


def _fields(values: Mapping[str, Any], names: Sequence[str]) -> str:
    return ", ".join(f"{n} {values[n]}" for n in names)
