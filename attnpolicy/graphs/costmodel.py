"""The cost model: predicted seconds of attention calls, graph compiles and mask builds.

A :class:`CostModel` holds, for the tensor spec, attention implementation and
compile backend it was calibrated with (``attnpolicy calibrate``, see
:mod:`attnpolicy.bench.calibration`), one :class:`Fit` per quantity:

- ``run[kind]``: seconds of one graph call of a key (its padded ``q_len × kv_len``
  shape), input padding and output copy included, for each :class:`CallKind`
  (JSON keys ``causal``, ``mask``, ``varlen``, ``rows``); the ``rows`` fit is one row's
  seconds, measured on rows graphs, and a rows call costs its rows times it. A model
  calibrated before the rows kind has no ``rows`` fits: it still loads, prices no
  rows call (:meth:`CostModel.prices`; ``cost-aware`` then never chooses rows) and
  names the fix when asked to;
- ``compile[kind]``: seconds to build one graph of a key (backend compile plus its
  first call on example inputs);
- ``warmup_seconds``: what the first compile in a process pays on top of its key's
  ``compile`` seconds (the backend's one-off start-up: Dynamo, AOTAutograd), charged
  once per backend by :meth:`CostModel.warmup_cost`;
- ``mask_build``: seconds to build a dense ``rows × cols`` mask on the host, and
  ``mask_build_window`` the same under a sliding window (each sequence's block is
  banded: one more pass over it; absent from models calibrated before it, which
  price a windowed build as ``mask_build``);
- ``call_overhead_seconds``: the dispatcher's own cost per call (decision, plan,
  cache lookup) on a cache hit;
- ``store_load[kind]``: seconds to load one graph of a key from a graph store
  (:class:`~attnpolicy.cache.disk_store.DiskStore`: read, verify, torch's load), and
  ``store_bytes[kind]``: the bytes its artifact and manifest take there.

``store_load`` and ``store_bytes`` came later within format version 1: a model saved
without them still loads, with both empty (the model knows no graph store, and
modelling one with it raises :class:`ConfigError` asking for a calibration).

Each fit is ``base + per_cell·rows·cols + per_token·(rows + cols)`` with
non-negative coefficients: attention's work grows with the score cells, its memory
traffic with the tokens, and a call has a fixed cost. Coefficients are fitted by
least squares on the *relative* error of the calibrated samples, so that small
and large shapes count alike. Non-negative coefficients make every prediction
monotone in the lengths and extrapolate linearly in the cells beyond the grid.

A model is checked whole when it is built or read (:data:`Coefficient`,
:func:`check_run_fits`), so that every prediction, and every sum and ratio of them,
is a finite number: a file is read in pydantic's strict mode (nothing coerced), each
coefficient and measured value is finite and at most :data:`MAX_COEFFICIENT`, and
each run fit predicts at least :data:`MIN_RUN_SECONDS` for the smallest call.
See ``docs/simulate.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Final, Literal, overload

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from attnpolicy.core import jsonfile
from attnpolicy.core.modes import CallKind
from attnpolicy.core.names import Backend, DType, Impl
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.footprint import graph_bytes
from attnpolicy.graphs.keys import GraphKey, TensorSpec, check_kv_heads

COST_MODEL_VERSION: Final = 1
DEFAULT_RESOURCE = "default_costmodel.json"

#: The largest coefficient or measured value of a cost-model file: seconds (a trillion
#: is 31,700 years) or bytes (a terabyte); above it a value is no measurement, and one
#: near a float's range makes sums of predictions infinite. (A model derived in code,
#: a planner's with compiles some times dearer, may exceed it.)
MAX_COEFFICIENT: Final = 1e12
#: The fewest seconds a run fit may predict for the smallest call (one token): a call
#: takes time, and a run total of about 0 makes ratios to it infinite.
MIN_RUN_SECONDS: Final = 1e-15


def _read_bound(value: float, info: ValidationInfo) -> float:
    """``value``, at most :data:`MAX_COEFFICIENT` when read from a file (see
    :func:`attnpolicy.core.jsonfile.validate`'s ``strict``)."""
    if info.context is not None and jsonfile.FILE_CONTEXT in info.context and value > MAX_COEFFICIENT:
        raise ValueError(f"must be at most {MAX_COEFFICIENT:g} (seconds, or bytes): no measurement is larger")
    return value


#: A fit's coefficient, or a measured value: a finite number >= 0 (an int is taken, a
#: bool or string is not), at most :data:`MAX_COEFFICIENT` in a file.
Coefficient = Annotated[float, Field(strict=True, ge=0.0, allow_inf_nan=False), AfterValidator(_read_bound)]
Positive = Annotated[int, Field(strict=True, ge=1)]
#: The largest size a cost model holds: a model's dimension (hidden, vocabulary, heads,
#: layers, ...) or a calibrated length; larger is no model, and keeps every byte count
#: computed from sizes a finite float.
MAX_SIZE: Final = 2**31
#: A size: an integer from 1 to :data:`MAX_SIZE`.
Size = Annotated[int, Field(strict=True, ge=1, le=MAX_SIZE)]


class Fit(BaseModel):
    """Seconds as ``base + per_cell·rows·cols + per_token·(rows + cols)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: Coefficient = 0.0
    per_cell: Coefficient = 0.0
    per_token: Coefficient = 0.0

    @overload
    def __call__(self, rows: float, cols: float) -> float: ...
    @overload
    def __call__(self, rows: np.ndarray, cols: np.ndarray | float) -> np.ndarray: ...
    def __call__(self, rows: float | np.ndarray, cols: float | np.ndarray) -> float | np.ndarray:
        """Seconds for ``rows × cols``: numbers, or numpy arrays element-wise."""
        return self.formula(self.base, self.per_cell, self.per_token, rows, cols)

    @overload
    @staticmethod
    def formula(base: float, per_cell: float, per_token: float, rows: float, cols: float) -> float: ...
    @overload
    @staticmethod
    def formula(base: float | np.ndarray, per_cell: float | np.ndarray, per_token: float | np.ndarray,
                rows: np.ndarray, cols: float | np.ndarray) -> np.ndarray: ...
    @overload
    @staticmethod
    def formula(base: float | np.ndarray, per_cell: float | np.ndarray, per_token: float | np.ndarray,
                rows: float | np.ndarray, cols: float | np.ndarray) -> float | np.ndarray: ...
    @staticmethod
    def formula(base: float | np.ndarray, per_cell: float | np.ndarray, per_token: float | np.ndarray,
                rows: float | np.ndarray, cols: float | np.ndarray) -> float | np.ndarray:
        """A fit's seconds from its coefficients, each a number or a numpy array
        (broadcast: a coefficient per shape prices many kinds' shapes at once): the one
        place the formula is written."""
        return base + per_cell * rows * cols + per_token * (rows + cols)

    @classmethod
    def to_samples(cls, samples: Sequence[tuple[int, int, float]]) -> Fit:
        """The non-negative fit of ``(rows, cols, seconds)`` samples minimising the
        squared relative error (exact: the best least-squares solution over every
        subset of the three terms that has no negative coefficient)."""
        if not samples:
            raise ConfigError("a fit needs at least one (rows, cols, seconds) sample, got none")
        data = np.array(samples, dtype=float)
        rows, cols, secs = data.T
        if (secs <= 0).any() or (rows < 1).any() or (cols < 1).any():
            raise ConfigError(f"fit samples need rows, cols >= 1 and seconds > 0, got {list(samples)!r}")
        terms = np.stack([np.ones_like(rows), rows * cols, rows + cols], axis=1)
        base, per_cell, per_token = nonnegative_fit(terms, secs)
        return cls(base=base, per_cell=per_cell, per_token=per_token)


def check_run_fits(smallest: Mapping[str, float]) -> None:
    """``ValueError`` naming the first run fit of ``smallest`` (its name: its seconds
    for the smallest call) below :data:`MIN_RUN_SECONDS`."""
    for name, seconds in smallest.items():
        if seconds < MIN_RUN_SECONDS:
            raise ValueError(f"{name} predicts {seconds:g} s for a call of one token: a call takes at least "
                             f"{MIN_RUN_SECONDS:g} s (calibrate again)")


def nonnegative_fit(terms: np.ndarray, values: np.ndarray) -> list[float]:
    """The non-negative coefficients of ``terms`` (samples × terms) that minimise the
    squared relative error against ``values`` (> 0): the best least-squares solution
    over every subset of the terms that has no negative coefficient (exact)."""
    terms = terms / values[:, None]
    scale = np.linalg.norm(terms, axis=0)
    scale[scale == 0] = 1.0
    terms = terms / scale
    target = np.ones(len(values))
    n = terms.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << n):
        used = [i for i in range(n) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(terms[:, used], target, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(n)
        full[used] = coef
        err = float(np.sum((terms @ full - target) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    assert best is not None  # a single term's least-squares coefficient is never negative
    return list((best[1] / scale).tolist())


class Sample(BaseModel):
    """One calibration measurement (kept in the JSON to show the fit's quality)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    what: Literal["run", "compile", "mask_build", "mask_build_window", "store_load", "store_bytes"]
    kind: CallKind | None = None
    rows: Size
    cols: Size
    seconds: Coefficient  # for ``store_bytes``: the bytes


class CostModel(BaseModel):
    """Predicted seconds for one tensor spec, implementation and compile backend.

    Immutable; :meth:`save` / :meth:`load` round-trip it through JSON and
    :meth:`default` is the built-in one (calibrated on the project's machine).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = COST_MODEL_VERSION
    dtype: DType = "float32"
    heads: Size = 8
    kv_heads: Size = 8
    head_dim: Size = 64
    impl: Impl = "sdpa"
    partition_len: Size | None = None
    backend: Backend = "aot_eager"
    threads: Positive = 1
    torch_version: str = ""
    run: dict[CallKind, Fit]
    compile: dict[CallKind, Fit]
    mask_build: Fit
    #: seconds to build a dense mask under a sliding window (``None``: as ``mask_build``)
    mask_build_window: Fit | None = None
    warmup_seconds: Coefficient = 0.0
    call_overhead_seconds: Coefficient = 0.0
    samples: tuple[Sample, ...] = ()
    #: seconds per call kind and kernel on a reference batch (``calibrate --kernels``);
    #: the kernel ``auto`` picks the fastest that can serve a call
    kernel_seconds: dict[str, dict[str, Coefficient]] = {}
    #: seconds to load a stored graph, per call kind (empty: not calibrated, see above)
    store_load: dict[CallKind, Fit] = {}
    #: bytes a stored graph takes on disk, artifact and manifest, per call kind (empty with ``store_load``)
    store_bytes: dict[CallKind, Fit] = {}

    @model_validator(mode="after")
    def _every_kind(self) -> CostModel:
        for field in ("run", "compile", "store_load", "store_bytes"):
            fits = getattr(self, field)
            missing = [f.value for f in CallKind if f not in fits and f is not CallKind.ROWS]
            if missing and (fits or field in ("run", "compile")):
                raise ValueError(f"{field} needs a fit for every call kind; missing: {', '.join(missing)}")
        if bool(self.store_load) != bool(self.store_bytes):
            raise ValueError("store_load and store_bytes are calibrated together: give both or neither")
        check_kv_heads(self.heads, self.kv_heads)
        check_run_fits({f"run.{kind.value}": fit(1, 1) for kind, fit in self.run.items()})
        return self

    @property
    def spec(self) -> TensorSpec:
        """The tensor spec the model was calibrated with."""
        return TensorSpec(self.dtype, self.heads, self.kv_heads, self.head_dim)

    def spec_differs(self, spec: TensorSpec) -> str | None:
        """How ``spec`` differs from the tensor spec the model was calibrated with (its
        dtype, heads, KV heads and head dim; one phrase naming both), or ``None``."""
        mine = self.spec
        if (mine.dtype, mine.heads, mine.kv_heads, mine.head_dim) == (spec.dtype, spec.heads, spec.kv_heads,
                                                                      spec.head_dim):
            return None
        return f"calibrated on {describe_spec(mine)}, not {describe_spec(spec)}"

    @property
    def calibrated_len(self) -> int | None:
        """The largest length the run fits were calibrated on (the run samples' largest
        bucket, rows or columns); longer calls are extrapolated. ``None``: a model
        without samples, whose range is unknown."""
        return max((max(x.rows, x.cols) for x in self.samples if x.what == "run"), default=None)

    # -- predictions -------------------------------------------------------------------
    def prices(self, kind: CallKind) -> bool:
        """Whether the model prices calls of ``kind``: every kind but ROWS, and ROWS once
        calibrated on rows graphs (a model calibrated before the rows kind has no fit for it)."""
        return kind is not CallKind.ROWS or (kind in self.run and kind in self.compile)

    def run_fit(self, kind: CallKind, rows: int = 1) -> Fit:
        """The fit of one call of kind ``kind`` in ``rows`` rows: the kind's run fit, a ROWS
        call's ``rows`` × the rows fit (one row's seconds). :class:`ConfigError` for a kind
        the model has no fit for (see :meth:`prices`)."""
        fit = _fit_of(self.run, kind)
        if rows == 1:
            return fit
        return Fit.model_construct(base=rows * fit.base, per_cell=rows * fit.per_cell, per_token=rows * fit.per_token)

    def compile_fit(self, kind: CallKind) -> Fit:
        """The compile fit of kind ``kind`` (a ROWS graph's whatever its rows);
        :class:`ConfigError` for a kind the model has no fit for."""
        return _fit_of(self.compile, kind)

    def call_seconds(self, kind: CallKind, q_len: int, kv_len: int, rows: int = 1) -> float:
        """Seconds of one call of kind ``kind`` on a padded ``q_len × kv_len`` shape in
        ``rows`` rows (:meth:`run_fit`)."""
        return self.run_fit(kind, rows)(q_len, kv_len)

    def run_seconds(self, key: GraphKey) -> float:
        """Seconds of one call of the graph of ``key`` (see :meth:`call_seconds`)."""
        return self.call_seconds(key.kind, key.q_len, key.kv_len, key.rows)

    def compile_seconds(self, key: GraphKey) -> float:
        """Seconds to build the graph of ``key`` (0 for backend ``"none"``: nothing compiles)."""
        if key.backend == "none":
            return 0.0
        return self.compile_fit(key.kind)(key.q_len, key.kv_len)

    def compile_cost(self, key: GraphKey, measured_seconds: float) -> float:
        """A :class:`~attnpolicy.cache.graph_cache.GraphCache` ``compile_cost``: record the modelled
        compile seconds (deterministic on every rank) instead of the measured ones."""
        return self.compile_seconds(key)

    @property
    def knows_store(self) -> bool:
        """Whether ``store_load`` and ``store_bytes`` were calibrated (a graph store can be modelled)."""
        return bool(self.store_load)

    def require_store(self, source: str) -> None:
        """:class:`ConfigError` unless the model :attr:`knows_store` (``source`` names the model)."""
        if not self.knows_store:
            raise ConfigError(f"cost model {source} has no store_load or store_bytes fits (calibrated before the graph "
                              "store existed): run attnpolicy calibrate to model a store")

    @staticmethod
    def stored(key: GraphKey) -> bool:
        """Whether the graph of ``key`` goes to a graph store: compiled ahead of time, so not
        a flex graph and not backend ``"none"`` (as the dispatcher's graph source decides)."""
        return key.backend != "none" and key.impl != "flex"

    def load_seconds(self, key: GraphKey) -> float:
        """Seconds to load the stored graph of ``key`` (needs :attr:`knows_store`)."""
        return _fit_of(self.store_load, key.kind)(key.q_len, key.kv_len)

    def stored_bytes(self, key: GraphKey) -> int:
        """Bytes the stored graph of ``key`` takes on disk, rounded up (needs :attr:`knows_store`)."""
        return math.ceil(_fit_of(self.store_bytes, key.kind)(key.q_len, key.kv_len))

    def warmup_cost(self, compiled: Iterable[GraphKey]) -> float:
        """The one-off start-up of a process that compiles the graphs of ``compiled``:
        ``warmup_seconds`` once per backend among them (backend ``"none"`` compiles
        nothing and pays none)."""
        return self.warmup_seconds * len({key.backend for key in compiled} - {"none"})

    def mask_build_seconds(self, rows: int, cols: int, window: int | None = None) -> float:
        """Seconds to build a dense ``rows × cols`` mask on the host (under a sliding
        ``window``: ``mask_build_window``'s, when calibrated)."""
        if window is not None and self.mask_build_window is not None:
            return self.mask_build_window(rows, cols)
        return self.mask_build(rows, cols)

    @staticmethod
    def graph_bytes(key: GraphKey) -> int:
        """Bytes the graph of ``key`` pins (:func:`attnpolicy.graphs.footprint.graph_bytes`)."""
        return graph_bytes(key)

    # -- files -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the model as JSON to ``path`` atomically (parents created); returns the path."""
        return jsonfile.write_json(path, self)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a model saved by :meth:`save`; any problem raises :class:`ConfigError`
        naming the file (and each bad field)."""
        path = Path(path)
        return cls.from_json(jsonfile.read_text(path, "cost model"), str(path))

    @classmethod
    def from_json(cls, text: str, source: str) -> CostModel:
        """Parse and validate a model's JSON; errors are :class:`ConfigError` naming ``source``."""
        return jsonfile.parse(cls, text, source, "cost model", COST_MODEL_VERSION, strict=True)

    @classmethod
    def default(cls) -> CostModel:
        """The built-in model, shipped as ``attnpolicy/data/default_costmodel.json``."""
        global _default
        if _default is None:
            resource = resources.files("attnpolicy").joinpath("data", DEFAULT_RESOURCE)
            _default = cls.from_json(resource.read_text(encoding="utf-8"), f"attnpolicy/data/{DEFAULT_RESOURCE}")
        return _default


def _fit_of(fits: Mapping[CallKind, Fit], kind: CallKind) -> Fit:
    """``fits[kind]``, or :class:`ConfigError` for a kind the model has no fit for."""
    fit = fits.get(kind)
    if fit is None:
        raise ConfigError(f"this cost model has no {kind.value} fit (calibrated before the {kind.value} kind): "
                          f"run attnpolicy calibrate to price {kind.value} calls")
    return fit


def describe_spec(spec: TensorSpec) -> str:
    """``float32 h8/kv8/d64``: a tensor spec's dtype, heads, KV heads and head dim."""
    return f"{spec.dtype} h{spec.heads}/kv{spec.kv_heads}/d{spec.head_dim}"


_default: CostModel | None = None
