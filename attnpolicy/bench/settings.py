"""The settings of what ``bench`` and ``calibrate`` measure, plain data validated on
construction (no torch: a command resolves its cost model, and says which, before it
loads anything that runs a graph)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as validated

from attnpolicy.graphs.keys import TensorSpec, check_kv_heads

#: The dtypes ``bench`` and ``calibrate`` time.
BenchDType = Literal["float32", "bfloat16", "float16"]
BENCH_DTYPES: tuple[BenchDType, ...] = get_args(BenchDType)

#: How ``bench`` splits a shape's L tokens among its n sequences: ``equal`` (L/n
#: each) or ``spread`` (sequence i of n about i / (1 + ... + n) of them, at least one each).
Split = Literal["equal", "spread"]
SPLITS: tuple[Split, ...] = get_args(Split)

#: Threads of ``bench`` and ``calibrate`` unless told otherwise: one thread is stable
#: on a shared machine and is what the built-in cost model was calibrated with.
DEFAULT_THREADS = 1

Positive = Field(ge=1)


@validated(frozen=True)
class SpecSettings:
    """The attention shape and kernel that ``bench`` and ``calibrate`` time; validated
    (every count >= 1, ``kv_heads`` divides ``heads``)."""

    heads: Annotated[int, Positive] = 8
    kv_heads: Annotated[int, Positive] = 8
    head_dim: Annotated[int, Positive] = 64
    dtype: BenchDType = "float32"
    impl: Literal["sdpa", "eager", "flash"] = "sdpa"
    partition_len: Annotated[int | None, Positive] = None
    threads: Annotated[int | None, Positive] = DEFAULT_THREADS

    @model_validator(mode="after")
    def _kv_heads_divide(self) -> SpecSettings:
        check_kv_heads(self.heads, self.kv_heads)
        return self

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, self.heads, self.kv_heads, self.head_dim)


@validated(frozen=True)
class BenchSettings(SpecSettings):
    """What ``attnpolicy bench`` times: :class:`SpecSettings` and the batches; validated
    (every count >= 1, no more sequences than tokens, each split once)."""

    lengths: Annotated[tuple[Annotated[int, Positive], ...], Field(min_length=1)] = (
        128, 256, 512, 1024, 2048, 4096)
    seqs: Annotated[tuple[Annotated[int, Positive], ...], Field(min_length=1)] = (1, 4)
    splits: Annotated[tuple[Split, ...], Field(min_length=1)] = SPLITS
    repeats: Annotated[int, Positive] = 5
    warmup: Annotated[int, Field(ge=0)] = 1
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> BenchSettings:
        if max(self.seqs) > min(self.lengths):
            raise ValueError(f"seqs {max(self.seqs)} exceeds lengths {min(self.lengths)}: "
                             "every sequence needs a token")
        if len(set(self.splits)) < len(self.splits):
            raise ValueError(f"splits {list(self.splits)}: name each split once")
        return self


@validated(frozen=True)
class CalibrationSettings(SpecSettings):
    """What ``attnpolicy calibrate`` measures: :class:`SpecSettings` and the grid;
    validated like the config."""

    backend: Literal["aot_eager", "inductor", "eager", "none"] = "aot_eager"
    max_len: Annotated[int, Field(ge=16)] = 4096
    repeats: Annotated[int, Field(ge=1)] = 3
    quick: bool = False
    #: the pow2 bucket sizes of the grid (default: 16 up to ``max_len``)
    sizes: tuple[Annotated[int, Field(ge=16)], ...] | None = None
    #: a call's sample: its fastest run (``min``: the machine's own speed, stable on a
    #: shared machine) or its mean run (``mean``: what a replay on this machine now pays)
    statistic: Literal["min", "mean"] = "min"
    kernels: bool = False  # also time every registered kernel per call kind (KERNEL_BATCH)
    store: bool = True  # also save and load a few graphs per call kind through a DiskStore

    @model_validator(mode="after")
    def _consistent(self) -> CalibrationSettings:
        if self.impl == "flash" and self.partition_len is None:
            raise ValueError("impl 'flash' needs partition_len")
        return self

    @field_validator("sizes")
    @classmethod
    def _pow2(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return pow2_sizes(sizes)


def pow2_sizes(sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``sizes`` when they are one or more powers of two (or ``None``), else ``ValueError``."""
    if sizes is not None and (not sizes or any(n & (n - 1) for n in sizes)):
        raise ValueError("must be one or more powers of two")
    return sizes


#: Grid sizes without ``sizes`` (``quick``: the first two only).
DEFAULT_SIZES = (16, 32, 64, 128, 256, 512)


@validated(frozen=True)
class ModelCalibrationSettings:
    """What ``attnpolicy calibrate --model`` measures; validated like the config."""

    spec: str = "qwen3"
    backend: Literal["aot_eager", "inductor", "eager"] = "aot_eager"
    #: the pow2 bucket sizes of the grid (default: :data:`DEFAULT_SIZES`)
    sizes: tuple[Annotated[int, Field(ge=16)], ...] | None = None
    repeats: Annotated[int, Field(ge=1)] = 3
    threads: Annotated[int, Field(ge=1)] = 1
    clock: Literal["cpu", "wall"] = "cpu"
    quick: bool = False
    #: also the step graphs over cached context (decode, chunked prefill) of
    #: :func:`~attnpolicy.bench.calibration.graph_grid`
    steps: bool = True

    @field_validator("sizes")
    @classmethod
    def _pow2(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return pow2_sizes(sizes)
