"""attnpolicy: pluggable, measurable attention mask-mode policies and a bounded graph cache.

Data flow of one call: BatchLayout → Policy (+ Guard) → Decision → BatchPlan
(calls, GraphKeys) → GraphCache → Step → compiled graph(q, k, v[, mask]) → output.
"""

from __future__ import annotations

import importlib
from typing import Any

from attnpolicy.core.version import __version__ as __version__

_EXPORTS = {
    "BatchLayout": "attnpolicy.core.layout",
    "MaskMode": "attnpolicy.core.modes",
    "CallKind": "attnpolicy.core.modes",
    "Decision": "attnpolicy.core.modes",
    "is_legal": "attnpolicy.core.modes",
    "legal_modes": "attnpolicy.core.modes",
    "why_illegal": "attnpolicy.core.modes",
    "why_not_causal": "attnpolicy.core.modes",
    "attend": "attnpolicy.graphs.execute",
    "GraphKey": "attnpolicy.graphs.keys",
    "TensorSpec": "attnpolicy.graphs.keys",
    "GraphCache": "attnpolicy.cache.graph_cache",
    "CacheStats": "attnpolicy.cache.cache_types",
    "KeyStats": "attnpolicy.cache.cache_types",
    "MaskCache": "attnpolicy.kernels.mask_cache",
    "Buckets": "attnpolicy.graphs.buckets",
    "AttnPolicyConfig": "attnpolicy.config",
    "Dispatcher": "attnpolicy.dispatch",
    "Policy": "attnpolicy.policies.base",
    "DispatcherStats": "attnpolicy.dispatch",
    "Step": "attnpolicy.dispatch",
    "PolicyContext": "attnpolicy.policies.base",
    "hookimpl": "attnpolicy.plugins.hookspecs",
}

__all__ = [
    "AttnPolicyConfig",
    "BatchLayout",
    "Buckets",
    "CacheStats",
    "CallKind",
    "Decision",
    "Dispatcher",
    "DispatcherStats",
    "GraphCache",
    "GraphKey",
    "KeyStats",
    "MaskCache",
    "MaskMode",
    "Policy",
    "PolicyContext",
    "Step",
    "TensorSpec",
    "attend",
    "hookimpl",
    "is_legal",
    "legal_modes",
    "why_illegal",
    "why_not_causal",
]


def __getattr__(name: str) -> Any:
    """Import exported names lazily, so ``import attnpolicy`` stays cheap."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnpolicy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
