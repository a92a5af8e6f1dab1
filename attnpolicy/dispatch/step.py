"""A prepared batch: what :meth:`Dispatcher.prepare` returns and ``run`` computes.

A :class:`Step` holds everything one batch needs: its layout, the decision that
runs, its plan, its graphs (fetched from the cache, pinned until the batch has
run), the mask cache its MASK calls read, and the figures it adds to the
dispatcher's counters. The step of a repeated layout is kept whole: preparing it
again touches the graph cache once and reuses the rest. A :class:`HostStep` is a
batch the host runs on a kernel of its own (vLLM's paged kernel runs VARLEN):
decided, counted and requested from the cache like any other, with no graph of
attnpolicy's to run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, Decision, MaskMode
from attnpolicy.dispatch.batch_plan import BatchPlan, BatchPlanner
from attnpolicy.dispatch.stats import Counters
from attnpolicy.errors import KernelError, LayoutError
from attnpolicy.graphs.execute import GraphFn, check_inputs, execute
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels.mask_cache import MaskCache
from attnpolicy.kernels.masks import layout_mask


class Step:
    """One batch, prepared: ``run(q, k, v)`` returns its attention (see
    :meth:`Dispatcher.attend <attnpolicy.dispatch.dispatcher.Dispatcher.attend>` for
    the tensors). ``decision`` is the one that runs (VARLEN for a MASK decision whose
    mask is over ``max_mask_bytes``); iterating gives its ``(call, graph)`` pairs,
    one per graph invocation. A layout prepared again may return the same Step,
    its graphs refreshed from the cache: run a Step before the next ``prepare``
    without a decision (which drops the graphs of the steps before it)."""

    __slots__ = ("asked", "counters", "decision", "direct", "fell_back", "form", "graphs", "layout", "masks",
                 "mode_name", "n_calls", "padded_tokens", "plan", "spec", "values", "whole_mask")

    def __init__(self, layout: BatchLayout, spec: TensorSpec, asked: Decision, plan: BatchPlan,
                 masks: MaskCache) -> None:
        self.layout = layout
        self.spec = spec
        self.plan = plan
        self.fell_back = plan.mode is not asked.mode
        self.asked = asked
        self.retake(asked)
        self.mode_name = plan.mode.value  # the stats key (an Enum's value is a Python property)
        self.n_calls = plan.n_calls
        self.padded_tokens = plan.padded_tokens
        self.masks = masks
        self.graphs: list[tuple[Call, GraphFn]] = []
        self.values: tuple[Any, ...] = ()  # the cache's values behind ``graphs``
        self.direct: Callable[..., torch.Tensor] | None = None
        self.whole_mask: tuple[int, int] | None = None
        #: the dispatcher's counters: a plugin kernel's bad output (KernelError) counts there
        self.counters: Counters | None = None
        #: what ``run`` takes: q, k, v's dtype and device, q's shape, k's and v's shape
        self.form = (getattr(torch, spec.dtype), torch.device(spec.device),
                     (layout.q_tokens, spec.heads, spec.head_dim), (layout.kv_tokens, spec.kv_heads, spec.head_dim))

    def retake(self, asked: Decision) -> None:
        """Serve ``asked``, a decision of this step's mode (its reason may differ), from
        now on: the plan and graphs stay, as they depend on the mode alone. ``asked`` is
        the policy's decision (replayed when the step is reused); ``decision`` the one
        that runs."""
        if asked.mode is not self.asked.mode:
            raise ValueError(f"a step asked in {self.asked.mode.value} cannot serve a {asked.mode.value} decision")
        self.asked = asked
        self.decision = asked if not self.fell_back else Decision(
            self.plan.mode, f"{asked.reason}; its mask exceeds max_mask_bytes: ran {self.plan.mode.value}")

    def use(self, graphs: list[tuple[Call, GraphFn]], values: tuple[Any, ...]) -> None:
        """Run ``graphs`` from now on (``values``: the cache's values behind them).

        A single call over every row, unpadded (CAUSAL of one sequence; MASK of one
        sequence, which has no neighbour to isolate) is run directly by :meth:`run`:
        exactly what :func:`~attnpolicy.graphs.execute.execute` does for it, without
        the general path's branches."""
        self.graphs, self.values = graphs, values
        self.direct = self.whole_mask = None
        layout = self.layout
        if len(graphs) != 1 or not layout.is_single or layout.is_padded:
            return
        call, graph = graphs[0]
        if (isinstance(graph, FlexGraph) or call.q_bucket != layout.q_tokens or call.kv_bucket != layout.kv_tokens
                or call.kind not in (CallKind.CAUSAL, CallKind.MASK)):
            return
        self.direct = graph
        if call.kind is CallKind.MASK:
            self.whole_mask = (call.q_bucket, call.kv_bucket)

    def forget(self) -> None:
        """Drop the graphs (the next fetch takes them from the cache again): a step
        kept for reuse holds no graph the cache has evicted since."""
        self.graphs, self.values = [], ()
        self.direct = self.whole_mask = None

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            sinks: torch.Tensor | None = None, *, checked: bool = False) -> torch.Tensor:
        """The batch's attention over packed ``q``, ``k``, ``v``, with the sink logits
        ``sinks[Hq]`` when the spec's features have sinks (cast and made contiguous as
        :func:`~attnpolicy.graphs.execute.graph_sinks` does). Tensors that do not fit the
        layout, or whose dtype, device, heads or head_dim are not the spec's, raise
        :class:`~attnpolicy.errors.LayoutError` naming the field (the graphs run without
        guards); ``checked``: the caller made the spec from these tensors and checked them
        (as ``Dispatcher.attend`` does). A plugin kernel's output of the wrong shape, dtype
        or device raises :class:`~attnpolicy.errors.KernelError`, counted in
        ``kernel_violations``."""
        if not checked and not self.fits(q, k, v):
            self.refuse(q, k, v)
        direct = self.direct
        try:
            if (direct is None or torch.is_grad_enabled() or not q.is_contiguous() or not k.is_contiguous()
                    or not v.is_contiguous() or sinks is not None):
                return execute(q, k, v, self.layout, self.graphs, self.masks, self.spec.features, sinks)
            ins = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            shape = self.whole_mask
            if shape is not None:
                mask = layout_mask(self.masks, self.layout, *shape, q.device, self.spec.features.window)
                return direct(*ins, mask).transpose(0, 1)
            return direct(*ins).transpose(0, 1)
        except KernelError:
            if self.counters is not None:
                self.counters.kernel_violations += 1
            raise

    def fits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``q``, ``k``, ``v`` are tensors of this step's :attr:`form`."""
        dtype, device, q_shape, kv_shape = self.form
        try:
            return (q.dtype is dtype and k.dtype is dtype and v.dtype is dtype and q.shape == q_shape
                    and k.shape == kv_shape and v.shape == kv_shape
                    and q.device == device and k.device == device and v.device == device)
        except AttributeError:  # not tensors: refuse says what they are
            return False

    def refuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> NoReturn:
        """Raise :class:`LayoutError` naming the first field in which ``q``, ``k``, ``v``
        differ from the layout or the spec (call when :meth:`fits` is false)."""
        check_inputs(q, k, v, self.layout)  # tensors that do not fit the layout, or each other
        spec, (dtype, device, _, _) = self.spec, self.form
        for name, field, got, want in (("q", "dtype", q.dtype, dtype), ("q", "device", q.device, device),
                                       ("q", "heads", q.shape[1], spec.heads),
                                       ("k", "heads", k.shape[1], spec.kv_heads),
                                       ("q", "head_dim", q.shape[2], spec.head_dim)):
            if got != want:
                raise LayoutError(f"{name} has {field} {got}, but this step's graphs were compiled for {want} "
                                  "(prepare the step with TensorSpec.of(q, k))")
        raise LayoutError(f"q, k, v do not fit this step's graphs ({spec})")

    def __iter__(self) -> Iterator[tuple[Call, GraphFn]]:
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)


class HostStep(Step):
    """A batch the host runs on its own kernel: decided, counted and its graph keys
    requested from the cache (hits, misses, recency, evictions) exactly as a
    :class:`Step`'s, without a graph to build, run or pin: a missing key enters the
    cache deferred (under ``compile_mode="background"`` too: none is compiled in the
    worker).

    ``keys``: each call's key in order (``None``: runs uncompiled)."""

    __slots__ = ("keys",)

    def __init__(self, layout: BatchLayout, spec: TensorSpec, asked: Decision, plan: BatchPlan,
                 masks: MaskCache, keys: list[GraphKey | None]) -> None:
        super().__init__(layout, spec, asked, plan, masks)
        self.keys = keys

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            sinks: torch.Tensor | None = None, *, checked: bool = False) -> torch.Tensor:
        raise RuntimeError(f"this {self.mode_name} step of {self.layout.describe()} runs on the host's own "
                           "kernel (a dispatcher built with host_varlen=True): the host calls it")


def new_step(planner: BatchPlanner, layout: BatchLayout, spec: TensorSpec, asked: Decision, masks: MaskCache, *,
             host_varlen: bool) -> Step:
    """The step of decision ``asked`` for ``layout``, planned by ``planner``: a
    :class:`HostStep` when ``host_varlen`` and the mode that runs is VARLEN (planned
    sequence by sequence when the policy chose VARLEN: decode layouts never repeat,
    their sequences' shapes do), else a :class:`Step`."""
    if host_varlen and asked.mode is MaskMode.VARLEN:
        seqs = planner.seq_plans(layout, spec)
        return HostStep(layout, spec, asked, BatchPlan.of_seqs(seqs, layout), masks, [key for key, _ in seqs])
    plan = planner.plan(layout, asked.mode, spec)
    if host_varlen and plan.mode is MaskMode.VARLEN:
        return HostStep(layout, spec, asked, plan, masks, [key if call.compiled else None for call, key in plan.calls])
    return Step(layout, spec, asked, plan, masks)
