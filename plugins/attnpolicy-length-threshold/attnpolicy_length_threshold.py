"""attnpolicy plugin: the ``length-threshold`` policy.

Below ``threshold`` tokens a dense mask costs next to nothing, and running every
short batch as MASK avoids compiling CAUSAL graphs for short lengths. From
``threshold`` on, the mask grows as L², so the policy picks CAUSAL when it is legal
and VARLEN (one mask-free call per sequence) otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

from attnpolicy import BatchLayout, Decision, MaskMode, PolicyContext, hookimpl, is_legal


class LengthThreshold:
    """MASK while the longest sequence (keys included) is shorter than ``threshold``."""

    name = "length-threshold"
    description = ("MASK when the longest sequence is below `threshold` tokens (default 512), "
                   "else CAUSAL when legal, VARLEN otherwise")

    def __init__(self, threshold: int = 512) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an integer >= 1, got {threshold!r}")
        self.threshold = threshold
        # decide() runs once per attention call: build its answers once.
        self._short = Decision(MaskMode.MASK, f"longest sequence < {threshold} tokens")
        self._causal = Decision(MaskMode.CAUSAL, f"single causal sequence >= {threshold} tokens")
        self._varlen = Decision(MaskMode.VARLEN, f"longest sequence >= {threshold} tokens")

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        if layout.max_kv_len < self.threshold:
            return self._short
        if is_legal(MaskMode.CAUSAL, layout):
            return self._causal
        return self._varlen


@hookimpl
def attnpolicy_register_policies(register: Callable[[type], None]) -> None:
    register(LengthThreshold)
