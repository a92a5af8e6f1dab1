"""Built-in policies, registered through the same hook third-party plugins use.

They return shared, pre-built :class:`Decision` objects (reasons are cached), so
deciding allocates nothing: the guard calls ``decide`` once per attention call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, why_not_causal
from attnpolicy.errors import BucketOverflowError
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.policies.base import PolicyContext

_CAUSAL = Decision(MaskMode.CAUSAL, "single unpadded causal sequence")


@lru_cache(maxsize=4096)
def cached_decision(mode: MaskMode, reason: str) -> Decision:
    """A shared, immutable ``Decision(mode, reason)``."""
    return Decision(mode, reason)


class _Always:
    """The same decision (``_decision``) for every batch."""

    stateless = True  # the decision is a function of the layout: dispatchers reuse it

    _decision: Decision

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        return self._decision


class AlwaysMask(_Always):
    """Every batch runs one call with a dense mask (the behaviour of runtimes without a policy)."""

    name = "always-mask"
    modes = frozenset({MaskMode.MASK})
    description = "MASK for every batch: one call with a dense mask (always legal)"

    _decision = Decision(MaskMode.MASK, "always mask")


class AlwaysCausal(_Always):
    """CAUSAL for every batch: right only when every batch is one unpadded causal
    sequence (a runtime with ``max_num_seqs=1`` and no prefix caching). On a packed,
    padded, bidirectional or context batch CAUSAL is illegal: the guard raises, or
    falls back to its safe mode and counts the fallback."""

    name = "always-causal"
    modes = frozenset({MaskMode.CAUSAL})
    description = ("CAUSAL for every batch (max_num_seqs=1 runtimes); on any other "
                   "batch the guard raises or falls back to its safe mode")

    _decision = Decision(MaskMode.CAUSAL, "always causal")


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
    """CAUSAL for a single unpadded causal sequence, a dense MASK otherwise; with the
    option ``rows`` (a fraction ≥ 0), ROWS instead of MASK for a batch whose rows calls
    pad at most ``rows`` × its tokens (the query rows its row and length buckets add,
    under the config's buckets: the same at the attention level and the model level)."""

    name = "dynamic"
    modes = frozenset({MaskMode.CAUSAL, MaskMode.MASK})
    description = ("CAUSAL when legal (one unpadded causal sequence), MASK otherwise "
                   "(option rows: ROWS when its padding is at most that fraction of the batch's tokens)")
    otherwise = MaskMode.MASK
    reads_buckets = False

    def __init__(self, rows: float | None = None) -> None:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, (int, float))
                                 or not math.isfinite(rows) or rows < 0):
            raise ValueError(f"rows must be a finite fraction >= 0 of the batch's tokens (or None), got {rows!r}")
        self.rows = rows
        if rows is not None:  # its padding is the config's buckets'
            self.modes = frozenset({MaskMode.CAUSAL, MaskMode.MASK, MaskMode.ROWS})
            self.reads_buckets = True

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        decision = super().decide(layout, ctx)
        if self.rows is None or decision.mode is MaskMode.CAUSAL:
            return decision
        cfg = ctx.config
        if cfg is None:  # outside a dispatcher or a runner: no buckets to pad to
            return decision
        try:
            calls = plan_calls(layout, MaskMode.ROWS, cfg.bucket, rows_bucket=cfg.rows_bucket,
                               max_rows=cfg.row_buckets[-1])
        except BucketOverflowError:  # a sequence beyond the largest bucket: no rows graph to pad to
            return decision
        padded = sum(call.rows * call.q_bucket for call in calls) - layout.total_tokens
        if padded <= self.rows * layout.total_tokens:
            return cached_decision(MaskMode.ROWS, f"{decision.reason}; rows pad {padded} tokens")
        return decision


class Varlen(_CausalWhenLegal):
    """CAUSAL when legal, otherwise one call per sequence: no host-built mask, and
    causal sequences without context reuse the CAUSAL graph of their length bucket."""

    name = "varlen"
    modes = frozenset({MaskMode.CAUSAL, MaskMode.VARLEN})
    description = "CAUSAL when legal, otherwise VARLEN: one call per sequence, no host-built mask"
    otherwise = MaskMode.VARLEN


class AlwaysRows(_Always):
    """ROWS for every batch: each sequence in its own right-padded row (always legal),
    the form static-graph runtimes run."""

    name = "always-rows"
    modes = frozenset({MaskMode.ROWS})
    description = "ROWS for every batch: one sequence a row of a right-padded [rows, length] batch (always legal)"

    _decision = Decision(MaskMode.ROWS, "always rows")


BUILTIN_POLICIES = (AlwaysMask, AlwaysCausal, Dynamic, Varlen, AlwaysRows)


@hookimpl
def attnpolicy_register_policies(register: Callable[[type], None]) -> None:
    for cls in BUILTIN_POLICIES:
        register(cls)
