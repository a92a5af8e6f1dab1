"""Which registered kernel runs each planned call: the config's choice per call
kind, checked against the kernel's declared capabilities (see
:mod:`attnpolicy.plugins.kernels`)."""

from __future__ import annotations

from collections.abc import Mapping

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import Call, TensorSpec
from attnpolicy.plugins.kernels import (
    KERNEL_KINDS,
    KernelInfo,
    check_kernel_names,
    get_kernel,
    impls_for,
    why_unfit,
)


def call_traits(call: Call, layout: BatchLayout) -> tuple[bool, bool]:
    """The causality and cached context a call's graph serves, as its key and its
    kernel see them: a MASK call's from its layout (one mask covers the batch), a
    ROWS call's from its rows, another call's from its own sequence (context: more
    keys than queries)."""
    if call.kind is CallKind.MASK:
        return layout.causal, layout.has_context
    if call.kind is CallKind.ROWS:
        return call.causal, call.context
    return call.causal, call.kv_len > call.q_len


class KernelChoice:
    """Which registered implementation runs each call: the config's choice per call kind
    (``kernels``, else ``attn_impl``), checked against the implementation's
    capabilities; ``auto`` takes the fastest fit the cost model measured (``calibrate``),
    else the first fit in registration order."""

    def __init__(self, kernels: Mapping[str, str], default: str, *, compiled: bool,
                 measured: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """``kernels``: the config's choice per call kind (``auto`` allowed); ``default``:
        the implementation of kinds not listed; ``compiled``: whether graphs are
        compiled (backend other than ``none``); ``measured``: seconds per call kind and
        kernel from ``calibrate --kernels``, for ``auto``."""
        check_kernel_names(dict(kernels))
        self._choice = {f: kernels.get(f, default) for f in KERNEL_KINDS}
        self._compiled = compiled
        self._measured = measured or {}
        self._chosen: dict[tuple[CallKind, bool, bool, TensorSpec], str] = {}

    @property
    def rules(self) -> tuple[dict[str, str], bool, Mapping[str, Mapping[str, float]]]:
        """What the choice depends on (the choice per kind, compiled, the measured
        seconds): two choices with equal rules choose alike."""
        return self._choice, self._compiled, self._measured

    def impl(self, call: Call, layout: BatchLayout, spec: TensorSpec) -> str:
        """The implementation for ``call`` (remembered per call kind, causality, context
        and spec: the capabilities it depends on)."""
        causal, context = call_traits(call, layout)
        memo_key = (call.kind, causal, context, spec)
        name = self._chosen.get(memo_key)
        if name is None:
            name = self._chosen[memo_key] = self._choose(call.kind.value, causal, context, layout, spec)
        return name

    def _choose(self, kind: str, causal: bool, context: bool, layout: BatchLayout, spec: TensorSpec) -> str:
        gqa = spec.heads != spec.kv_heads

        def unfit(info: KernelInfo) -> str | None:
            return why_unfit(info, causal=causal, context=context, dtype=spec.dtype, gqa=gqa,
                             device=spec.device, compiled=self._compiled, features=spec.features)

        choice = self._choice[kind]
        if choice != "auto":
            why = unfit(get_kernel(kind, choice))
            if why is not None:
                raise ConfigError(f"kernel {choice!r} cannot serve this {kind} call ({layout.describe()}): "
                                  f"it does not support {why}")
            return choice
        measured = self._measured.get(kind, {})
        fits = [info.name for info in impls_for(kind) if unfit(info) is None]
        if not fits:
            raise ConfigError(f"no registered {kind} kernel can serve this call ({layout.describe()}, "
                              f"{spec.dtype}, gqa={gqa}, device {spec.device}, {spec.features.describe()})")
        return min(fits, key=lambda name: measured.get(name, float("inf")))
