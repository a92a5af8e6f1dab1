"""attnpolicy: pluggable, measurable attention mask-mode policies and a bounded graph cache.

Data flow of one call: BatchLayout → Policy (+ Guard) → Decision → plan_calls →
GraphKey → GraphCache → compiled graph(q, k, v[, mask]) → output.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BatchLayout": "attnpolicy.layout",
    "MaskMode": "attnpolicy.modes",
    "Decision": "attnpolicy.modes",
    "legal_modes": "attnpolicy.modes",
    "why_illegal": "attnpolicy.modes",
    "attend": "attnpolicy.kernels",
    "GraphKey": "attnpolicy.keys",
    "GraphCache": "attnpolicy.cache",
    "Buckets": "attnpolicy.buckets",
    "AttnPolicyConfig": "attnpolicy.config",
    "Dispatcher": "attnpolicy.dispatcher",
    "PolicyContext": "attnpolicy.policy",
    "hookimpl": "attnpolicy.hookspecs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import exported names lazily, so ``import attnpolicy`` stays cheap."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnpolicy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
