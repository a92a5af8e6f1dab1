"""attnpolicy's wrapper of the attention backend vLLM selected (imports vLLM; vllm 0.32).

:func:`wrap` builds, from one of vLLM's attention backend classes and its
:class:`HostAttention` (what attnpolicy must know of that backend: where keys and values
sit in a layer's cache, which metadata fields make a step more than plain attention, the
kernel of VARLEN steps), a subclass of that backend: its name, metadata builder,
KV-cache layout and KV-cache writes (``do_kv_cache_update`` runs before ``forward``)
are the wrapped backend's, and its implementation is the wrapped implementation with
:class:`PolicyImpl`'s ``forward`` in front. The wrapped classes stay reachable as the
wrappers' ``wrapped``. The classes vLLM's registry names
(:data:`attnpolicy.integrations.vllm.WRAPPERS`: ``AttnPolicyCPUBackend`` over
``CPU_ATTN``, ``AttnPolicyFlashAttnBackend`` over ``FLASH_ATTN``, ...) are built on
first access, over the class the slot held before
:func:`attnpolicy.integrations.vllm.register`. Every attention step goes through the
guarded policy: prefill, decode, chunked and prefix-cached prefill, mixed batches.

- **Features.** A layer's sliding window, logit soft cap and sinks, as vLLM passes them
  to every implementation's constructor (:class:`LayerFacts`), are its
  :class:`~attnpolicy.core.features.Features` (:func:`features_of`), part of its tensor
  spec and so of every graph key: attnpolicy's graphs compute them, and the wrapped
  kernel keeps computing them its own way.
- **One decision per step and KV-cache group.** The layers of one KV-cache group share
  vLLM's metadata object; a hybrid model (Gemma 2: sliding and full layers) has one
  group, so one metadata object, per kind of layer. The first layer of a group in a
  step builds its :class:`~attnpolicy.core.layout.BatchLayout` (cached context
  included: ``kv_lens`` = ``seq_lens``, ``q_lens`` from ``query_start_loc``) and asks
  the dispatcher: ``Dispatcher.prepare(layout, spec)`` for the step's first group,
  ``prepare(layout, spec, decide(layout, spec))`` for the others (their graphs stay
  pinned with the first group's), each returning the group's
  :class:`~attnpolicy.dispatch.step.Step`. Every other layer of the group looks that
  Step up and runs it; a layer of another tensor spec prepares its own in the group's
  decision. Each decision's record in the decisions log names its group (the first
  layer's name) and the group's ``window``, ``softcap`` and ``sinks``.
- **The whole step runs in the chosen mode**, mixed batches included (no split):
  VARLEN runs the wrapped backend's kernel over the whole batch (its own ``forward``,
  or the host's ``varlen`` kernel: on CPU vLLM's paged kernel,
  :class:`~attnpolicy.integrations.vllm_paged.PagedVarlenKernel`), bit-identical to
  stock: the dispatcher is built with ``host_varlen=True``, so such a step is a
  :class:`~attnpolicy.dispatch.step.HostStep`, decided and counted, with no graph of
  attnpolicy's. CAUSAL (one context-free sequence) runs attnpolicy's graph on the
  step's keys as they are; MASK and ROWS run attnpolicy's graphs on the step's packed
  tokens, keys gathered from the paged cache when some sequence has cached context (once
  per step and group, for both). ROWS puts each sequence in its own right-padded row
  (decodes and prefills in calls of their own) and scatters its rows' outputs back into
  vLLM's packed output; it builds no mask on the host. The mode is the one that runs: a
  MASK decision whose mask would exceed ``max_mask_bytes`` runs as VARLEN under
  ``on_overflow='eager'``.
- Keys of a VARLEN step enter the graph cache and its statistics deferred: no graph is
  built for them. A CAUSAL, MASK or ROWS graph compiles (or loads from the store) when
  a step that runs it is first prepared.
- The config's warm set (``warmup``) is built when the first layer is built, during
  vLLM's engine start, for the tensor spec the layers will see (the model's dtype, on
  the engine's device).
- **CUDA graphs.** A step vLLM runs under a FULL CUDA graph (the forward context's
  ``cudagraph_runtime_mode`` is FULL, or the stream is capturing) runs the wrapped
  kernel, as VARLEN, whatever the policy would choose: that is what the graph captures
  and what it replays for every batch of its descriptor (attnpolicy's graphs take the
  step's lengths on the host, which a replay would not refresh). Those steps are neither
  decided nor counted; each captured size is said once (:func:`note_full_graph`). Steps
  vLLM runs under PIECEWISE graphs (attention runs eagerly between the pieces) or
  without a graph are decided as above.
- Layers the backend cannot run (ALiBi, KV sharing, cross-attention, a window on
  bidirectional attention, a quantised KV cache, context parallelism, constructor
  arguments attnpolicy does not model) run the wrapped implementation. Those known when
  the layer is built are reported at the first forward: one warning per model naming
  them and why, ``stats().layers_elsewhere`` and a ``layers_elsewhere`` event in the
  decisions log. Steps the metadata makes more than plain attention (the host's
  :attr:`HostAttention.plain_fields`, per-request causality) and fused output
  quantisation run it too, unreported.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from vllm.config import get_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionImpl, AttentionType

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
from attnpolicy.integrations.vllm import WRAPPERS, original_path
from attnpolicy.integrations.vllm_paged import (
    GATHER_ISAS,
    KVViews,
    PagedGather,
    PagedVarlenKernel,
    cpu_views,
    flash_views,
)
from attnpolicy.workloads.layout_stream import LayoutStreamWriter

_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
log = logging.getLogger("attnpolicy.integrations.vllm")

#: The positional arguments vLLM's ``Attention`` layer passes every implementation.
_IMPL_ARGS = ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window",
              "kv_cache_dtype", "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name")
#: Further arguments attnpolicy models (the others, given a value other than the
#: implementation's default, leave the layer to it).
_MODELLED = ("sinks",)


def _differs(value: object, default: object) -> bool:
    """Whether ``value`` is not the parameter's ``default`` (a tensor always differs)."""
    if value is default:
        return False
    if isinstance(value, torch.Tensor) or default is inspect.Parameter.empty:
        return True
    return bool(value != default)


@dataclass(frozen=True)
class LayerFacts:
    """A layer as vLLM's ``Attention`` describes it to any implementation (the arguments
    of its constructor), whatever the wrapped implementation keeps of them and how."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    alibi: bool
    window: int | None  # a query sees its ``window`` last keys, itself included
    softcap: float | None
    sinks: torch.Tensor | None
    attn_type: str
    kv_sharing: str | None
    kv_cache_dtype: str
    #: other arguments given a value that is not the implementation's default: ``name=value``
    other: tuple[str, ...] = ()

    @classmethod
    def of(cls, impl_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LayerFacts:
        """The facts of the arguments ``impl_cls`` (a vLLM implementation) is built with."""
        params = inspect.signature(impl_cls.__init__).parameters
        given = {**dict(zip(_IMPL_ARGS, args)), **kwargs}

        def arg(name: str) -> Any:
            return given[name] if name in given else getattr(params.get(name), "default", None)

        other = [f"argument {i}={a!r}" for i, a in enumerate(args[len(_IMPL_ARGS):], len(_IMPL_ARGS))]
        other += [f"{name}={value!r}" for name, value in given.items() if name not in _IMPL_ARGS + _MODELLED
                  and _differs(value, getattr(params.get(name), "default", inspect.Parameter.empty))]
        window = arg("sliding_window")
        attn_type = arg("attn_type")
        return cls(num_heads=int(arg("num_heads")), num_kv_heads=int(arg("num_kv_heads") or arg("num_heads")),
                   head_size=int(arg("head_size")), scale=float(arg("scale")),
                   alibi=arg("alibi_slopes") is not None, window=None if window in (None, -1) else int(window),
                   softcap=float(arg("logits_soft_cap")) if arg("logits_soft_cap") else None, sinks=arg("sinks"),
                   attn_type=AttentionType.DECODER if attn_type is None else attn_type,
                   kv_sharing=arg("kv_sharing_target_layer_name"), kv_cache_dtype=arg("kv_cache_dtype") or "auto",
                   other=tuple(other))


def why_elsewhere(facts: LayerFacts, impl: Any) -> str | None:
    """Why the wrapper cannot run the layer of ``facts`` (built as ``impl``), or None."""
    if facts.attn_type not in _SUPPORTED_ATTN_TYPES:
        return f"attention type {facts.attn_type}"
    if facts.alibi:
        return "ALiBi"
    if facts.window is not None and facts.attn_type != AttentionType.DECODER:
        return f"sliding window {facts.window} on bidirectional attention"
    if facts.kv_sharing is not None:
        return f"KV sharing with {facts.kv_sharing}"
    if facts.kv_cache_dtype != "auto":
        return f"KV cache dtype {facts.kv_cache_dtype}"
    if getattr(impl, "dcp_world_size", 1) > 1 or getattr(impl, "pcp_world_size", 1) > 1:
        return "context parallelism (its KV cache is split across ranks)"
    if facts.other:
        return f"{type(impl).__name__} built with {', '.join(facts.other)}"
    return None


def features_of(facts: LayerFacts) -> Features:
    """The layer's window, cap and sinks as attnpolicy's features. vLLM's
    ``sliding_window=W`` lets a query see its ``W`` last keys, itself included: exactly
    ``Features.window``. ``logits_soft_cap`` 0 (or None) is no cap."""
    if facts.window is None and facts.softcap is None and facts.sinks is None:
        return PLAIN
    return Features(facts.window, facts.softcap, facts.sinks is not None)


#: The kernel of a VARLEN step: (layer, query, key, value, kv_cache, metadata, output,
#: sink logits) -> output, as :class:`PagedVarlenKernel` takes them.
VarlenKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class HostAttention:
    """What the wrapper needs to know of one of vLLM's attention backends, beyond its
    class: its metadata must hold ``query_start_loc``, ``seq_lens``, ``block_table``,
    ``causal`` and ``num_actual_tokens`` as vLLM's CPU and flash-style backends do.

    ``kv_views``: where keys and values sit in a layer's cache (for MASK and ROWS steps
    with cached context). ``plain_fields``: metadata fields that, when not None, make a
    step more than plain causal or bidirectional attention (per-request masks, prefix
    ranges): the wrapped implementation runs such a step. ``isas``: when set, the
    layer's ``isa`` must be one of them (the cache layouts ``kv_views`` reads).
    ``varlen``: the kernel of VARLEN steps, made per layer from its facts and features;
    None: the wrapped implementation's own ``forward``."""

    kv_views: KVViews
    plain_fields: tuple[str, ...] = ()
    isas: tuple[str, ...] | None = None
    varlen: Callable[[LayerFacts, Features], VarlenKernel] | None = None

    def runs(self, layer: Any, md: Any) -> bool:
        """Whether the wrapper runs this call's step itself (else the wrapped code does)."""
        if isinstance(md.causal, torch.Tensor) or any(getattr(md, name, None) is not None
                                                      for name in self.plain_fields):
            return False
        return self.isas is None or getattr(layer, "isa", None) in self.isas


def _cpu_varlen(facts: LayerFacts, features: Features) -> VarlenKernel:
    return PagedVarlenKernel(facts.scale, facts.kv_cache_dtype, facts.attn_type, features)


#: What the wrapper knows of each slot of :data:`~attnpolicy.integrations.vllm.WRAPPERS`.
HOSTS: dict[str, HostAttention] = {
    "CPU_ATTN": HostAttention(cpu_views, ("dynamic_causal",), GATHER_ISAS, _cpu_varlen),
    "FLASH_ATTN": HostAttention(flash_views, ("rswa_prefix_lens", "mm_prefix_query_range_tensor")),
    "TRITON_ATTN": HostAttention(flash_views, ("rswa_prefix_lens", "mm_prefix_range", "mm_prefix_range_tensor")),
    "FLEX_ATTENTION": HostAttention(flash_views, ("rswa_prefix_lens", "mm_prefix_range")),
}


def report_elsewhere(dispatcher: Dispatcher) -> None:
    """Warn once per model about its layers that run on the wrapped implementation
    (named, with the reason), count them in ``dispatcher``'s ``layers_elsewhere`` and
    the decisions log. The model is the forward context's; each of its wrapped layers is
    marked reported, so its other layers' first forwards report nothing again."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return
    layers: dict[str, str] = {}
    for name, layer in get_forward_context().no_compile_layers.items():
        impl = getattr(layer, "impl", None)
        if isinstance(impl, PolicyImpl) and impl.attnpolicy.unreported:
            impl.attnpolicy.unreported = False
            if impl.attnpolicy.elsewhere is not None:
                layers[name] = impl.attnpolicy.elsewhere
    if not layers:
        return
    dispatcher.counters.layers_elsewhere += len(layers)
    named = "; ".join(f"{name} ({why})" for name, why in layers.items())
    log.warning("attnpolicy: %d attention layer(s) run on vLLM's own implementation, not the policy: %s",
                len(layers), named)
    log_event({"event": "layers_elsewhere", "layers": layers})


_full_graphs: set[tuple[str, int]] = set()  # (implementation, tokens) already said
_full_lock = threading.Lock()


def note_full_graph(impl: str, num_tokens: int) -> None:
    """Say once per implementation and size that vLLM runs its steps of ``num_tokens``
    tokens under a FULL CUDA graph, on the wrapped kernel: a log line (the first one per
    implementation) and a ``full_graph`` event in the decisions log."""
    with _full_lock:
        if (impl, num_tokens) in _full_graphs:
            return
        first = not any(name == impl for name, _ in _full_graphs)
        _full_graphs.add((impl, num_tokens))
    if first:
        log.info("attnpolicy: vLLM runs steps of %d tokens (and further sizes, each in the decisions log) under "
                 "FULL CUDA graphs: they run %s's own kernel as captured, not the policy; the policy decides "
                 "the steps outside FULL graphs", num_tokens, impl)
    log_event({"event": "full_graph", "implementation": impl, "num_tokens": num_tokens, "mode": "varlen"})


def under_full_graph(query: torch.Tensor) -> bool:
    """Whether this call runs under a FULL CUDA graph (captured now, or a run of vLLM's
    for a FULL descriptor), where the step's lengths are not the host's to read."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL:
        return True
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def runtime_limits() -> RuntimeLimits:
    """The limits of the vLLM engine being built (``get_current_vllm_config()``)."""
    cfg = get_current_vllm_config()
    return RuntimeLimits(max_model_len=cfg.model_config.max_model_len,
                         max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                         max_num_seqs=cfg.scheduler_config.max_num_seqs,
                         block_size=cfg.cache_config.block_size)


def run_spec(facts: LayerFacts, features: Features) -> TensorSpec:
    """The tensor spec the layer of ``facts`` will run on: the engine's model dtype, the
    layer's heads, head size and scale, on the engine's device (what ``TensorSpec.of``
    gives at run time: ``cuda:0`` for the current CUDA device)."""
    cfg = get_current_vllm_config()
    device = str(torch.empty(0, device=cfg.device_config.device).device)
    return TensorSpec(str(cfg.model_config.dtype).removeprefix("torch."), facts.num_heads, facts.num_kv_heads,
                      facts.head_size, facts.scale, device, features)


def layout_for(md: Any) -> BatchLayout:
    """The step's layout: ``q_lens`` from ``query_start_loc``, ``kv_lens`` = ``seq_lens``
    (cached context + new tokens); one read from the device where they live there."""
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

    def __init__(self, md: Any, spec: TensorSpec, step: Step) -> None:
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

    def of(self, md: Any) -> _Current | None:
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


class _Layer:
    """attnpolicy's state of one wrapped layer (one attribute on the implementation, so
    no name of the wrapped implementation's is shadowed)."""

    def __init__(self, impl: Any, facts: LayerFacts, host: HostAttention) -> None:
        self.facts = facts
        self.limits = runtime_limits()
        self.config: AttnPolicyConfig = fit_to_runtime(from_env(), self.limits, "ATTNPOLICY_CONFIG")
        self.dispatcher: Dispatcher = dispatcher_for(self.config, host_varlen=True)
        self.features = features_of(facts)
        self.varlen = None if host.varlen is None else host.varlen(facts, self.features)
        #: why the wrapped implementation runs this layer (None: attnpolicy runs it)
        self.elsewhere = why_elsewhere(facts, impl)
        self.spec: TensorSpec | None = None  # of this layer's tensors, for dtype self.dtype
        self.dtype: torch.dtype | None = None
        self.sinks: dict[torch.dtype, torch.Tensor] = {}  # the sink logits by dtype
        self.stream: LayoutStreamWriter | Literal[False] | None = False  # False: not looked up yet
        self.unreported = True  # the model's layers that run elsewhere are reported at a first forward

    def sink_logits(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The layer's sink logits in ``dtype`` (None without sinks)."""
        sinks = self.facts.sinks
        if sinks is None:
            return None
        if dtype not in self.sinks:
            self.sinks[dtype] = sinks.to(dtype)
        return self.sinks[dtype]

    def kernel_sinks(self) -> torch.Tensor | None:
        """The sink logits for the host's ``varlen`` kernel: bf16 or fp32, as vLLM's CPU
        backend casts them."""
        sinks = self.facts.sinks
        if sinks is None or sinks.dtype in (torch.bfloat16, torch.float32):
            return sinks
        return self.sink_logits(torch.float32)


class PolicyImpl(AttentionImpl):
    """The implementation half of a wrapper (:func:`wrap`): put in front of the wrapped
    implementation, it runs every step of the layers it supports through attnpolicy's
    guarded policy and leaves the rest to the wrapped implementation."""

    #: what the wrapper knows of the wrapped backend
    host: ClassVar[HostAttention]
    #: the wrapped implementation class
    wrapped: ClassVar[type]
    #: class-level, shared by every layer: the current step's groups
    _current: ClassVar[_StepGroups] = _StepGroups()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attnpolicy = ours = _Layer(self, LayerFacts.of(self.wrapped, args, kwargs), self.host)
        if ours.elsewhere is None and ours.config.warmup:  # part of engine start (once per dispatcher and spec)
            ours.dispatcher.warmup(run_spec(ours.facts, ours.features))

    def _step_for(self, layer: Any, md: Any, spec: TensorSpec) -> tuple[Step, _Current]:
        """The Step of ``md`` for tensors of ``spec`` and its group: prepared by the
        group's first layer in this step, looked up by every other one (a layer of
        another spec prepares its own in the group's decision)."""
        ours = self.attnpolicy
        dispatcher = ours.dispatcher
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
        stream = ours.stream
        if stream is False:
            stream = ours.stream = layout_stream(dispatcher, spec, ours.limits)
        if stream is not None:  # the step's layout, as its first group runs it
            mode = step.decision.mode
            stream.write_step(layout, mode, dispatcher.context_for(spec).keys_for(layout, mode),
                              dispatcher.cache.counters())
        return step, group

    def _varlen(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, md: Any, output: torch.Tensor) -> torch.Tensor:
        """The step on the wrapped backend's kernel: the host's ``varlen`` kernel, or the
        wrapped implementation's own ``forward``."""
        ours = self.attnpolicy
        if ours.varlen is None:
            return super().forward(layer, query, key, value, kv_cache, md, output)
        return ours.varlen(layer, query, key, value, kv_cache, md, output, ours.kernel_sinks())

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        md = attn_metadata
        ours = self.attnpolicy
        if ours.unreported:
            report_elsewhere(ours.dispatcher)
        if (md is None or ours.elsewhere is not None or output_scale is not None
                or output_block_scale is not None or key is None or value is None
                or key.shape != value.shape or not self.host.runs(layer, md)):
            return super().forward(layer, query, key, value, kv_cache, md, output,
                                   output_scale, output_block_scale)
        if under_full_graph(query):
            note_full_graph(self.wrapped.__name__, int(query.shape[0]))
            return self._varlen(layer, query, key, value, kv_cache, md, output)
        spec = ours.spec
        if spec is None or query.dtype is not ours.dtype:
            spec = ours.spec = TensorSpec.of(query, key, ours.facts.scale, ours.features)
            ours.dtype = query.dtype
            if ours.config.warmup:  # a spec not warmed at construction (another dtype): warmed now
                ours.dispatcher.warmup(spec)
        current = self._current
        group = current.of(md)
        step = group.steps.get(spec) if group is not None else None
        if step is None:
            step, group = self._step_for(layer, md, spec)
        if isinstance(step, HostStep):
            return self._varlen(layer, query, key, value, kv_cache, md, output)
        layout = step.layout
        n = layout.q_tokens
        if layout.has_context:  # MASK or ROWS with cached context: the keys live in the paged cache
            assert group is not None
            if group.gather is None:
                group.gather = PagedGather(md.block_table, layout.kv_lens, kv_cache.shape[2],
                                           views=self.host.kv_views)
            k, v = group.gather(kv_cache)
        else:
            k, v = key[:n], value[:n]
        out = step.run(query[:n], k, v, ours.sink_logits(query.dtype))
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


def wrap(backend: Any, host: HostAttention, name: str | None = None) -> Any:
    """A subclass of vLLM attention backend ``backend`` whose implementation is
    ``backend``'s with :class:`PolicyImpl` in front (named ``name``, default
    ``AttnPolicy`` + the backend's name; its implementation's name ends in ``Impl``
    instead of ``Backend``). Everything else is ``backend``'s: its name (the enum slot
    vLLM maps it back to), metadata builder, KV-cache shape and layout. ``wrapped`` is
    ``backend`` on the class, the wrapped implementation on its implementation."""
    name = name or f"AttnPolicy{backend.__name__}"
    base = backend.get_impl_cls()
    impl_name = _impl_name(name)
    impl = type(impl_name, (PolicyImpl, base), {
        "__module__": __name__, "__qualname__": impl_name, "host": host, "wrapped": base,
        "__doc__": f"{base.__name__} with its steps run through attnpolicy's guarded policy (see PolicyImpl)."})

    def get_impl_cls() -> Any:
        return impl

    return type(name, (backend,), {
        "__module__": __name__, "__qualname__": name, "wrapped": backend, "host": host,
        "get_impl_cls": staticmethod(get_impl_cls),
        "__doc__": f"vLLM's {backend.__name__} with attnpolicy's guarded policy in front of its implementation."})


def _impl_name(backend_name: str) -> str:
    return backend_name.removesuffix("Backend") + "Impl"


_built: dict[tuple[str, str], Any] = {}
_built_lock = threading.Lock()


def wrapper_for(slot: str) -> Any:
    """attnpolicy's wrapper of the class ``slot`` held before ``register``
    (:func:`~attnpolicy.integrations.vllm.original_path`), built once per class."""
    path = original_path(slot)
    with _built_lock:
        if (slot, path) not in _built:
            _built[(slot, path)] = wrap(resolve_obj_by_qualname(path), HOSTS[slot], WRAPPERS[slot])
        return _built[(slot, path)]


def __getattr__(name: str) -> Any:
    """The wrapper classes vLLM's registry names (:data:`WRAPPERS`) and their
    implementations, built on first access."""
    for slot, backend in WRAPPERS.items():
        if name == backend:
            return wrapper_for(slot)
        if name == _impl_name(backend):
            return wrapper_for(slot).get_impl_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
