"""How far outputs are from their reference, for every check of the package (a
kernel's probe, ``run --check`` at the attention and the model level, the report's
validation): one tolerance per dtype (:data:`TOLERANCE`) and one measure
(:class:`MaxAbsError`), under which a non-finite value on either side fails the check
whatever the error of the rest (``max(err, nan)`` would keep ``err``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest absolute error against the float64 reference a check accepts, per dtype.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 3e-2, "float16": 5e-3}


@dataclass
class MaxAbsError:
    """The largest absolute error of the values finite on both sides, over every pair
    :meth:`add` saw, and how many values were non-finite on either side."""

    value: float = 0.0
    non_finite: int = 0

    def add(self, got: torch.Tensor, want: torch.Tensor) -> None:
        """Count ``got`` against its reference ``want`` (same shape), in float64."""
        diff = got.double() - want.double()
        finite = got.isfinite() & want.isfinite()
        self.non_finite += int(finite.numel() - finite.sum())
        if bool(finite.any()):
            self.value = max(self.value, float(diff[finite].abs().max()))

    def passes(self, tolerance: float) -> bool:
        """No value non-finite, and the largest error within ``tolerance``."""
        return not self.non_finite and self.value <= tolerance

    def describe(self, tolerance: float) -> str:
        """The error and ``tolerance`` in words, the non-finite values first."""
        err = f"max abs err {self.value:.3g} (tolerance {tolerance:g})"
        if not self.non_finite:
            return err
        return f"{self.non_finite} non-finite values in the outputs or their reference; of the rest, {err}"
