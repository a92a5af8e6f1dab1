"""The names each setting accepts, defined once.

Each is a ``Literal`` type (for pydantic fields and mypy) and a tuple of its values
(for argparse ``choices`` and run-time checks), and the defaults the config shares
with lower layers. This module imports nothing but
``typing``, so every layer may use it.
"""

from __future__ import annotations

from typing import Literal, get_args

#: The built-in compilers (``"none"``: nothing is compiled). A config's ``backend`` may
#: also name a plugin's compiler, a Dynamo backend or a ``module:function`` path
#: (:mod:`attnpolicy.plugins.compilers`); cost models are calibrated for the built-ins.
Backend = Literal["inductor", "aot_eager", "eager", "none"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

#: Attention implementations (see :mod:`attnpolicy.kernels.attention`).
Impl = Literal["sdpa", "eager", "flash"]
IMPLS: tuple[Impl, ...] = get_args(Impl)

#: Tensor dtypes a graph may be specialised on.
DType = Literal["float32", "float16", "bfloat16", "float64"]
DTYPES: tuple[DType, ...] = get_args(DType)

#: What the guard does with an illegal, raising or garbage decision.
OnIllegal = Literal["raise", "fallback"]
ON_ILLEGAL: tuple[OnIllegal, ...] = get_args(OnIllegal)

#: The mode the guard falls back to (each is legal for every layout).
FallbackMode = Literal["mask", "varlen", "rows"]
FALLBACK_MODES: tuple[FallbackMode, ...] = get_args(FallbackMode)

#: What happens to a length above the largest bucket.
OnOverflow = Literal["raise", "eager"]
ON_OVERFLOW: tuple[OnOverflow, ...] = get_args(OnOverflow)

#: What happens when a graph fails to compile.
OnCompileError = Literal["raise", "eager"]
ON_COMPILE_ERROR: tuple[OnCompileError, ...] = get_args(OnCompileError)

#: What the graph cache does with one graph larger than its whole byte budget.
Oversize = Literal["raise", "uncached"]
OVERSIZE: tuple[Oversize, ...] = get_args(Oversize)

#: What a compile after warm-up does.
Strict = Literal["off", "warn", "raise"]
STRICT: tuple[Strict, ...] = get_args(Strict)

#: Where a graph that is not resident compiles: in the batch that needs it, or in a
#: background thread while the batch runs on a resident larger bucket (pad-up).
CompileMode = Literal["sync", "background"]
COMPILE_MODES: tuple[CompileMode, ...] = get_args(CompileMode)

#: The default bound of a Dispatcher's dense-mask cache and of one MASK call's mask:
#: 256 MiB, a 16k × 16k boolean mask (config field ``max_mask_bytes``).
DEFAULT_MAX_MASK_BYTES = 256 * 2**20
