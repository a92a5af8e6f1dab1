"""HF transformers integration: ``attn_implementation="attnpolicy"``.

:func:`register` adds :func:`dispatched_attention` to transformers' ``AttentionInterface``
and transformers' own ``sdpa_mask`` to ``AttentionMaskInterface`` under the same
name, so models build the same boolean masks (padding, causal, packed sequences
from ``position_ids`` restarts) as with ``"sdpa"`` — without a registered mask
function transformers would pass no mask at all and drop padding and packing.

:func:`dispatched_attention` turns HF's ``[batch, heads, len, head_dim]`` tensors and mask
into packed tensors and a :class:`~attnpolicy.core.layout.BatchLayout`
(:mod:`attnpolicy.integrations.hf_layout`) and runs the dispatcher, with the
layer's sliding window (``sliding_window``: Mistral, Gemma 2/3, Qwen2 long-context,
GPT-OSS), logit soft cap (``softcap``: Gemma 2) and sinks (``s_aux``: GPT-OSS) as
the call's features (:mod:`attnpolicy.core.features`). Calls it cannot express
exactly run transformers' ``sdpa_attention_forward`` instead and are counted in
:func:`fallbacks` under a reason that names the layer's features: masks that are
not a block structure (custom patterns), non-boolean masks, dropout, position
biases, paged caches, and non-causal calls of encoder-decoder models
(cross-attention rows cannot be told from padding).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Any

import torch

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import LayoutError
from attnpolicy.integrations.environment import from_env
from attnpolicy.integrations.hf_layout import layout_from_mask, layout_without_mask
from attnpolicy.integrations.runtime import dispatcher_for, install_decision_log

log = logging.getLogger(__name__)

ATTENTION_NAME = "attnpolicy"
_UNSUPPORTED_KWARGS = ("position_bias", "cache")

_dispatcher: Dispatcher | None = None
_fallbacks: Counter[str] = Counter()


def register(config: AttnPolicyConfig | None = None) -> Dispatcher:
    """Register ``"attnpolicy"`` with transformers and return the dispatcher it uses.

    ``config`` defaults to the environment (:func:`attnpolicy.integrations.environment.from_env`);
    ``ATTNPOLICY_DECISIONS_LOG`` is honoured as in the vLLM integration.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    global _dispatcher
    _dispatcher = dispatcher_for(config if config is not None else from_env())
    AttentionInterface.register(ATTENTION_NAME, dispatched_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    install_decision_log()
    return _dispatcher


def dispatcher() -> Dispatcher:
    """The dispatcher :func:`dispatched_attention` runs (from the environment if :func:`register`
    was not called with a config)."""
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = dispatcher_for(from_env())
    return _dispatcher


def fallbacks() -> dict[str, int]:
    """How many calls ran transformers' SDPA instead, by reason."""
    return dict(_fallbacks)


class _MaskLayouts:
    """Layouts derived from the last mask tensors seen: the layers of a forward share
    one mask per attention type (full and sliding-window layers alternate in Gemma 2
    and GPT-OSS, so the last ``KEEP`` masks are kept)."""

    KEEP = 2

    def __init__(self) -> None:
        self._masks: list[tuple[weakref.ref[torch.Tensor], dict[tuple[bool, int | None], BatchLayout | str]]] = []

    def get(self, mask: torch.Tensor, causal: bool, window: int | None) -> BatchLayout | str:
        layouts = next((found for ref, found in self._masks if ref() is mask), None)
        if layouts is None:
            layouts = {}
            self._masks = [(weakref.ref(mask), layouts), *self._masks[:self.KEEP - 1]]
        key = (causal, window)
        if key not in layouts:
            layouts[key] = _derive(mask, causal, window)
        return layouts[key]


def _derive(mask: torch.Tensor, causal: bool, window: int | None) -> BatchLayout | str:
    """The layout of a 4-D HF mask (under a sliding ``window``), or why there is none."""
    if mask.dtype != torch.bool:
        return f"{mask.dtype} mask"
    if mask.dim() != 4:
        return f"{mask.dim()}-D mask"
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        return "per-head mask"
    try:
        return layout_from_mask(mask[:, 0], causal=causal, window=window)
    except LayoutError as exc:
        return f"mask pattern: {exc}"


_mask_layouts = _MaskLayouts()


def _features(kwargs: dict[str, Any], sinks: torch.Tensor | None) -> Features | str:
    """The call's features from HF's keywords, or why they cannot be read."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is None and softcap is None and sinks is None:
        return PLAIN
    try:
        return Features(window, softcap, sinks is not None)
    except LayoutError as exc:
        return str(exc)


def _plan(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float, features: Features,
          kwargs: dict[str, Any]) -> tuple[BatchLayout, int | None] | str:
    """(layout, key length to crop to or None), or the reason to fall back."""
    if dropout:
        return "dropout"
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return name
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    config = getattr(module, "config", None)
    if not causal and getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder non-causal attention"
    batch, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None:
        layout = _mask_layouts.get(attention_mask, causal, features.window)
        return layout if isinstance(layout, str) else (layout, None)
    if features.window is not None and features.window < lk:
        return "no mask for a window shorter than the keys"
    if causal and 1 < lq < lk:  # as HF's SDPA: is_causal is top-left, so keys are cropped
        return layout_without_mask(batch, lq, lq, causal=True), lq
    if lq > lk:
        return f"more queries ({lq}) than keys ({lk}) without a mask"
    return layout_without_mask(batch, lq, lk, causal=causal and lq > 1), None


def dispatched_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query [B, Hq, Lq, D]``, ``key/value
    [B, Hkv, Lk, D]`` → ``([B, Lq, Hq, D], None)``. Padding rows come back zero."""
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    features = _features(kwargs, sinks)
    plan = features if isinstance(features, str) else _plan(module, query, key, attention_mask, dropout,
                                                             features, kwargs)
    if isinstance(plan, str):
        if not isinstance(features, str) and features.any:
            plan = f"{features.describe()} with {plan}"
        _fallbacks[plan] += 1
        log.debug("attnpolicy: %s runs transformers' sdpa (%s)", type(module).__name__, plan)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    assert isinstance(features, Features)  # a reason: fell back above
    layout, crop = plan
    if crop is not None:
        key, value = key[:, :, :crop], value[:, :, :crop]
    batch, heads, lq, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * lq, heads, dim)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
    window = features.window
    if window is not None and window >= layout.max_kv_len:
        window = None  # no key is outside it: the plain graphs serve the call exactly
    out = dispatcher().attend(q, k, v, layout, scale=scaling, window=window, softcap=features.softcap,
                              sinks=sinks)  # cast to q's dtype by attend
    return out.reshape(batch, lq, heads, -1), None
