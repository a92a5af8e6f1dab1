"""Attention kernels: the math of one call, per implementation.

Tensor layout of a single call: ``q[Hq, Lq, D]``, ``k, v[Hkv, Lk, D]`` (heads first,
as torch's SDPA takes them), ``Hkv`` dividing ``Hq`` (GQA). ``causal`` is aligned
bottom-right (query ``j`` sees keys ``0 .. Lk - Lq + j``), ``mask`` is boolean
``[Lq, Lk]`` with True = attend; both may be given (a sliding window arrives
as part of the mask). A ROWS call adds a leading rows dimension: ``q[R, Hq, Lq, D]``,
``k, v[R, Hkv, Lk, D]`` and a mask ``[Lq, Lk]`` shared by the rows or ``[R, Lq, Lk]``
of its own per row; every kernel takes both forms. Two optional keywords (:mod:`attnpolicy.core.features`):
``softcap`` (logits ``s`` become ``softcap · tanh(s / softcap)``) and ``sinks``
(``[Hq]`` sink logits: one virtual key per head with that logit and a zero value).

Implementations (RBLN's names in brackets):

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``; sinks as one
  extra zero key and value whose logit comes from a float mask; a soft cap cannot go
  through fused SDPA (it caps the logits inside the kernel), so a capped call
  computes the ``eager`` math;
- ``eager`` ["eager"]: explicit ``softmax(q kᵀ · scale) v`` in fp32 (fp64 for fp64
  inputs);
- ``flash`` ["flash_attn"]: keys in partitions of ``partition_len`` tokens combined
  with an exact online softmax (running max and sum), in fp32 (fp64 for fp64 inputs).

Isolation: with a ``mask`` (and ``isolate``, the default), a query row depends only
on the key/value rows it attends. A masked-out key whose k or v row holds NaN or
±inf, or a key so large that ``q·k`` overflows, would otherwise leak into every row
(a zero probability times inf is NaN; an additive -inf on a NaN or +inf score is
NaN), so such key/value rows are zeroed before the product and every query row
that *attends* one of them (in any head) is set to NaN afterwards: a sequence's own
bad values still poison its own rows, as in torch's SDPA, and never another's. It is
one branch-free computation, without a host synchronisation, and costs ~10 small ops
per call. Compiled graphs pass ``isolate=False``: the dispatcher isolates around
them once per batch, in eager code, and only when its check fails
(:mod:`attnpolicy.kernels.isolation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnpolicy.kernels.conformance import check_output
from attnpolicy.kernels.isolation import score_limit


def _causal_allowed(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    q_idx = torch.arange(lq, device=device)[:, None]
    k_idx = torch.arange(lk, device=device)[None, :]
    return k_idx <= q_idx + (lk - lq)


def _allowed(lq: int, lk: int, causal: bool, mask: torch.Tensor | None,
             device: torch.device) -> torch.Tensor | None:
    """The combined boolean mask, or None when every key is allowed."""
    if causal and lq > 1:
        tri = _causal_allowed(lq, lk, device)
        return tri if mask is None else mask & tri
    return mask


def _over_heads(mask: torch.Tensor | None, axes: int) -> torch.Tensor | None:
    """``mask`` with ``axes`` unit axes before its last two when it has one per row
    (``[R, Lq, Lk]``), so it broadcasts over the heads of a rows call; else as it is."""
    if mask is None or mask.dim() == 2:
        return mask
    return mask.reshape(*mask.shape[:-2], *(1,) * axes, *mask.shape[-2:])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64: never less precise than the input."""
    return torch.promote_types(dtype, torch.float32)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
          partition_len: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None
          ) -> torch.Tensor:
    # SDPA's fused CPU/CUDA kernels take [batch, heads, L, D]; 3-D input falls back
    # to the (several times slower) math path, so add a batch dimension (a rows call has one).
    if softcap is not None:
        return _eager(q, k, v, causal, mask, scale, partition_len, softcap, sinks)
    gqa = q.shape[-3] != k.shape[-3]
    if q.dim() == 3:
        out = _sdpa(q[None], k[None], v[None], causal, None if mask is None else mask[None], scale, partition_len,
                    sinks=sinks)
        return out[0]
    if sinks is not None:
        return _sdpa_sinks(q, k, v, causal, mask, scale, sinks, gqa)
    if mask is None and causal and q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    allowed = _over_heads(_allowed(q.shape[-2], k.shape[-2], causal, mask, q.device), 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def _sdpa_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                scale: float, sinks: torch.Tensor, gqa: bool) -> torch.Tensor:
    """SDPA (on ``[R, H, L, D]``) with one extra key per head: k = v = 0 there, so its
    logit is the float mask's value, the head's sink logit (masked keys get -inf in the
    same mask)."""
    rows, hq, lq, _ = q.shape
    lk = k.shape[-2]
    zero = k.new_zeros(rows, k.shape[1], 1, k.shape[-1])
    bias = q.new_zeros(rows, hq, lq, lk + 1)
    allowed = _over_heads(_allowed(lq, lk, causal, mask, q.device), 1)
    if allowed is not None:
        bias[..., :lk].masked_fill_(~allowed, float("-inf"))
    bias[..., lk] = sinks.to(q.dtype)[:, None]
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], -2), torch.cat([v, zero], -2),
                                          attn_mask=bias, scale=scale, enable_gqa=gqa)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _grouped(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q as ``[..., Hkv, G·Lq, D]`` in the compute dtype: each kv head's G query heads
    stacked along the rows, so one batched matmul per kv head serves them all and K/V
    are never repeated or broadcast-copied (GQA without materialising K/V per query head)."""
    *lead, hq, lq, d = q.shape
    return q.to(_compute_dtype(q.dtype)).reshape(*lead, k.shape[-3], hq // k.shape[-3] * lq, d)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
           partition_len: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None
           ) -> torch.Tensor:
    *lead, hq, lq, d = q.shape
    hkv, lk = k.shape[-3], k.shape[-2]
    qg = _grouped(q, k)
    scores = _capped((qg @ k.to(qg.dtype).transpose(-1, -2) * scale).reshape(*lead, hkv, hq // hkv, lq, lk),
                     softcap)
    allowed = _over_heads(_allowed(lq, lk, causal, mask, q.device), 2)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).reshape(*lead, hkv, -1, lk)
    else:  # the sink is one more column of the softmax, dropped after it
        sink = sinks.to(qg.dtype).reshape(hkv, hq // hkv, 1, 1).expand(*lead, hkv, hq // hkv, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :lk].reshape(*lead, hkv, -1, lk)
    return (probs @ v.to(qg.dtype)).reshape(*lead, hq, lq, d).to(q.dtype)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
           partition_len: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None
           ) -> torch.Tensor:
    *lead, hq, lq, d = q.shape
    hkv, lk = k.shape[-3], k.shape[-2]
    g = hq // hkv
    qg = _grouped(q, k)
    kf, vf = k.to(qg.dtype), v.to(qg.dtype)
    allowed = _over_heads(_allowed(lq, lk, causal, mask, q.device), 2)
    if sinks is None:
        run_max = torch.full((*lead, hkv, g, lq, 1), float("-inf"), dtype=qg.dtype, device=q.device)
        run_sum = torch.zeros_like(run_max)
    else:  # the sink is a partition of its own, seen first: max = its logit, sum = 1, no value
        run_max = sinks.to(qg.dtype).reshape(hkv, g, 1, 1).expand(*lead, hkv, g, lq, 1).clone()
        run_sum = torch.ones_like(run_max)
    acc = torch.zeros(*lead, hkv, g, lq, d, dtype=qg.dtype, device=q.device)
    assert partition_len is not None  # attention() resolves it
    for start in range(0, lk, partition_len):
        end = min(start + partition_len, lk)
        s = _capped((qg @ kf[..., start:end, :].transpose(-1, -2) * scale).reshape(*lead, hkv, g, lq, end - start),
                    softcap)
        if allowed is not None:
            s = s.masked_fill(~allowed[..., start:end], float("-inf"))
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max)
        alpha = torch.exp(run_max - safe_max)
        run_sum = run_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + (p.reshape(*lead, hkv, g * lq, end - start) @ vf[..., start:end, :]).reshape(
            *lead, hkv, g, lq, d)
        run_max = new_max
    return (acc / run_sum).reshape(*lead, hq, lq, d).to(q.dtype)


_IMPL_FNS: dict[str, Callable[..., torch.Tensor]] = {"sdpa": _sdpa, "eager": _eager, "flash": _flash}
#: The implementations defined here; plugin kernels are added to ``_IMPL_FNS`` by name.
BUILTIN_IMPLS = frozenset(_IMPL_FNS)
_BUILTIN_FNS = dict(_IMPL_FNS)
#: The plugin that registered each plugin kernel (named in its errors).
_PLUGIN_OF: dict[str, str] = {}


def register_impl(name: str, fn: Callable[..., torch.Tensor], plugin: str = "") -> None:
    """Make ``fn`` (signature of ``_sdpa``) available as ``attention(..., impl=name)``;
    kernel plugins register through :mod:`attnpolicy.plugins.kernels`. Every call of a
    plugin's kernel has its output checked (:func:`~attnpolicy.kernels.conformance.check_output`)."""
    _IMPL_FNS[name] = fn
    _PLUGIN_OF[name] = plugin


def _finite_rows(k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` with their bad rows zeroed, and ``poisoned[Lq]``: the query
    rows that attend at least one such row (in any head). A row is bad if it holds a
    non-finite value or a key large enough for ``q·k`` to near overflow (which an
    additive mask would not hide: ``inf + -inf`` is NaN); the rows attending it get
    NaN as for a non-finite key."""
    # a row's largest magnitude is finite iff the row is (NaN propagates through amax);
    # cheaper than isfinite(...).all(-1) over every element
    # (a key row under sqrt(limit) in norm cannot overflow with a query row under it;
    # a larger query row only spoils its own output)
    k_max = k.abs().amax(-1).double()  # [Hkv, Lk]
    ok = (k_max * math.sqrt(k.shape[-1]) < math.sqrt(score_limit(k.dtype))) & torch.isfinite(v.abs().amax(-1))
    k = k.masked_fill(~ok[..., None], 0)
    v = v.masked_fill(~ok[..., None], 0)
    # boolean [Lq, Lk] work only, no float copy of the mask
    poisoned = (allowed & ~ok.all(0)).any(-1)
    return k, v, poisoned


def check_scale(scale: object) -> None:
    """Raise ``ValueError`` unless ``scale`` is None or a finite number > 0."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (or None for 1/sqrt(head_dim)), got {scale!r}")


#: A kernel bound to its implementation, scale, partition length and soft cap:
#: ``run(q, k, v, causal, mask, sinks=None)`` (no isolation).
BoundKernel = Callable[..., torch.Tensor]


def bind(impl: str = "sdpa", *, scale: float | None = None, partition_len: int | None = None,
         softcap: float | None = None) -> BoundKernel:
    """``impl`` with its arguments checked once (what a graph calls: no per-call
    lookups or checks). ``scale`` None is ``1/sqrt(head_dim)``; ``flash`` without a
    ``partition_len`` takes all keys in one partition. A kernel gets the ``softcap``
    and ``sinks`` keywords only when they are set (a plugin that does not declare
    them is never chosen for such a call)."""
    fn = _IMPL_FNS.get(impl)
    if fn is None:
        raise ValueError(f"impl must be one of {tuple(_IMPL_FNS)}, got {impl!r}")
    if partition_len is not None and partition_len < 1:
        raise ValueError(f"partition_len must be >= 1, got {partition_len}")
    check_scale(scale)
    fixed = None if scale is None else float(scale)
    whole = impl == "flash" and partition_len is None
    extra = {} if softcap is None else {"softcap": float(softcap)}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        s = 1.0 / math.sqrt(q.shape[-1]) if fixed is None else fixed
        part = k.shape[-2] if whole else partition_len
        if sinks is None:
            return fn(q, k, v, causal, mask, s, part, **extra)
        return fn(q, k, v, causal, mask, s, part, **extra, sinks=sinks)
    if fn is _BUILTIN_FNS.get(impl):
        return run  # built-ins are checked by the conformance test, not per call
    plugin = _PLUGIN_OF.get(impl, "")

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # shapes, dtypes and devices are static in a compiled graph: there the check
        # runs once, when the graph is traced, and a violation fails its compile
        out = run(q, k, v, causal, mask, sinks)
        check_output(out, q, impl, plugin)
        return out
    return checked


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str = "sdpa",
              causal: bool = False, mask: torch.Tensor | None = None,
              scale: float | None = None, partition_len: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              isolate: bool = True) -> torch.Tensor:
    """One attention call on ``[H, L, D]`` tensors (see the module docstring; with
    ``isolate=False`` a masked call leaves isolation to the caller)."""
    run = bind(impl, scale=scale, partition_len=partition_len, softcap=softcap)
    if mask is None or not isolate:
        return run(q, k, v, causal, mask, sinks)
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, mask, q.device)
    assert allowed is not None  # a mask was given
    k, v, poisoned = _finite_rows(k, v, allowed)
    return run(q, k, v, causal, mask, sinks).masked_fill(poisoned[:, None], float("nan"))
