"""The Policy protocol and the read-only context a policy decides in."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.graphs.keys import GraphKey, TensorSpec

if TYPE_CHECKING:
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.graphs.costmodel import CostModel


@runtime_checkable
class Policy(Protocol):
    """Decides the mask mode of each batch.

    A policy class has class attributes ``name`` and ``description`` and is built
    with keyword options (``AttnPolicyConfig.policy_options``). ``decide`` is called
    once per batch that runs, and must be a function of the layouts and contexts it
    has seen, so that every tensor-parallel rank takes the same decision.

    A *stateful* policy (one whose answer depends on earlier batches, like
    ``cost-aware``) also implements ``preview(layout, ctx) -> Decision``: the answer
    ``decide`` would give now, without changing any state.
    :meth:`~attnpolicy.dispatch.Dispatcher.graph_keys_for` and ``warmup`` call
    ``preview`` when the policy has one, ``decide`` otherwise.

    A policy whose decision depends on the layout and the config alone may set the
    class attribute ``stateless = True``: the dispatcher then asks it once per layout
    and reuses the decision. It may also set ``modes``, the frozenset of
    :class:`MaskMode` it ever decides: the planner then adds no bucket for the packed
    rows of MASK calls a policy never makes (without it, every mode is assumed), and
    ``reads_buckets = True`` when its decisions depend on the config's buckets (the
    planner then decides again under each bucket list it weighs; a policy that asks for
    ``keys_for`` is found out without it).
    """

    name: str
    description: str

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision: ...


def _nothing_cached(key: GraphKey) -> bool:
    return False


def _no_keys(layout: BatchLayout, mode: MaskMode) -> tuple[GraphKey, ...]:
    return ()


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may look at besides the layout (read-only), for one call.

    - ``config``: the dispatcher's configuration (``None`` outside a dispatcher);
    - ``spec``: the tensor spec of this call's q/k/v (``None`` outside a dispatcher);
    - ``is_cached(key)``: whether a graph is compiled and cached now;
    - ``keys_for(layout, mode)``: the graph keys running ``layout`` in ``mode`` with
      this call's ``spec`` uses (none outside a dispatcher);
    - ``cost_model``: run/compile cost estimates, if one is configured;
    - ``derived``: a dict kept with the dispatcher's planner, where a policy may keep
      what it derives from plans and the cost model alone, never from a cache (every
      dispatcher sharing the planner sees the same one), under a key of its own.

    A dispatcher keeps one context per tensor spec, so deciding allocates nothing.
    """

    config: AttnPolicyConfig | None = None
    spec: TensorSpec | None = None
    is_cached: Callable[[GraphKey], bool] = _nothing_cached
    keys_for: Callable[[BatchLayout, MaskMode], tuple[GraphKey, ...]] = _no_keys
    cost_model: CostModel | None = None
    derived: dict[Hashable, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
