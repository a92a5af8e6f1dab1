"""Built-in policies, registered through the same hook third-party plugins use.

They return shared, pre-built :class:`Decision` objects (reasons are cached), so
deciding allocates nothing: the guard calls ``decide`` once per attention call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, why_not_causal
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.policies.base import PolicyContext

_CAUSAL = Decision(MaskMode.CAUSAL, "single unpadded causal sequence")


@lru_cache(maxsize=4096)
def cached_decision(mode: MaskMode, reason: str) -> Decision:
    """A shared, immutable ``Decision(mode, reason)``."""
    return Decision(mode, reason)


class AlwaysMask:
    """Every batch runs one call with a dense mask (the behaviour of runtimes without a policy)."""

    stateless = True  # the decision is a function of the layout: dispatchers reuse it

    name = "always-mask"
    modes = frozenset({MaskMode.MASK})
    description = "MASK for every batch: one call with a dense mask (always legal)"

    _decision = Decision(MaskMode.MASK, "always mask")

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        return self._decision


class AlwaysCausal:
    """CAUSAL for every batch: right only when every batch is one unpadded causal
    sequence (a runtime with ``max_num_seqs=1`` and no prefix caching). On a packed,
    padded, bidirectional or context batch CAUSAL is illegal: the guard raises, or
    falls back to its safe mode and counts the fallback."""

    stateless = True  # the decision is a function of the layout: dispatchers reuse it

    name = "always-causal"
    modes = frozenset({MaskMode.CAUSAL})
    description = ("CAUSAL for every batch (max_num_seqs=1 runtimes); on any other "
                   "batch the guard raises or falls back to its safe mode")

    _decision = Decision(MaskMode.CAUSAL, "always causal")

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        return self._decision


class _CausalWhenLegal:
    """CAUSAL when it is legal, ``otherwise`` when it is not."""

    stateless = True  # the decision is a function of the layout: dispatchers reuse it

    otherwise: MaskMode

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        why = why_not_causal(layout)
        if why is None:
            return _CAUSAL
        return cached_decision(self.otherwise, why)


class Dynamic(_CausalWhenLegal):
    """CAUSAL for a single unpadded causal sequence, a dense MASK otherwise."""

    name = "dynamic"
    modes = frozenset({MaskMode.CAUSAL, MaskMode.MASK})
    description = "CAUSAL when legal (one unpadded causal sequence), MASK otherwise"
    otherwise = MaskMode.MASK


class Varlen(_CausalWhenLegal):
    """CAUSAL when legal, otherwise one call per sequence: no host-built mask, and
    causal sequences without context reuse the CAUSAL graph of their length bucket."""

    name = "varlen"
    modes = frozenset({MaskMode.CAUSAL, MaskMode.VARLEN})
    description = "CAUSAL when legal, otherwise VARLEN: one call per sequence, no host-built mask"
    otherwise = MaskMode.VARLEN


BUILTIN_POLICIES = (AlwaysMask, AlwaysCausal, Dynamic, Varlen)


@hookimpl
def attnpolicy_register_policies(register: Callable[[type], None]) -> None:
    for cls in BUILTIN_POLICIES:
        register(cls)
