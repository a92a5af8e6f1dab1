"""Sequence isolation around a masked call, outside any compiled graph.

A call that packs several sequences (MASK, flex) or masks part of one (VARLEN)
lets hidden keys into its arithmetic: a probability of 0 times an infinite value
is NaN, an additive ``-inf`` on a NaN score stays NaN, and a finite but huge key
(or query) makes ``q·k`` overflow to +inf or NaN, which the additive mask of
torch's SDPA does not hide either (``inf + -inf`` is NaN). So the common case
costs one cheap check per batch (:func:`leak_free`: K/V finite and no product near
overflow), and only a batch that fails it takes the isolating path
(:func:`isolated`): non-finite and huge key rows are zeroed before the call, every
sequence that owns a huge query or key row runs again alone (every row it does
not own zeroed), and the output rows that attend a non-finite key row are set to
NaN after it (:func:`repoisoned`), the faithful result of their own bad input.

A batch of one sequence without padding rows (``BatchLayout.is_single``) has no
neighbour to protect and is not checked: what a bad value in it does is the
kernel's own answer, as in a CAUSAL call (with torch's SDPA, every row that
attends it is non-finite, and possibly earlier rows of the same kernel block).

The checks run in eager code: inductor compiles CPU code with
``-ffinite-math-only``, so an in-graph finiteness test cannot be relied on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnpolicy.core.layout import BatchLayout

#: Headroom below the compute dtype's largest value that a q·k product must stay
#: under for a batch to skip the isolating path: far below overflow, so scaling
#: (a ``scale`` up to 2**30), the softmax's max subtraction and rounding cannot reach it.
HEADROOM = 2.0 ** -32


def score_limit(dtype: torch.dtype) -> float:
    """The largest ``|q·k|`` a batch of ``dtype`` may reach and still run as it is:
    :data:`HEADROOM` × the largest value of the dtype scores are computed in (fp32,
    fp64 for fp64 inputs, as every built-in kernel computes them)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).max * HEADROOM


def leak_free(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether no key/value row hidden from a query can reach its output: K and V are
    finite and no q·k product can come near overflow (an overflowing score is +inf
    or NaN, and an additive ``-inf`` mask does not hide it). One host synchronisation:
    fp32/fp64 bound every product by Cauchy–Schwarz from three dot products (``q·q``,
    ``k·k``, ``k·v``: the last is finite iff k and v are, unless the sum overflows);
    16-bit dtypes, whose dot products are slow on CPU, take each tensor's min and max
    instead. NaN compares False, so any non-finite value fails the test. A failed
    test only sends the batch down the isolating path, which is as exact."""
    limit = score_limit(q.dtype)
    if q.dtype in (torch.float32, torch.float64):
        qf, kf, vf = q.ravel(), k.ravel(), v.ravel()
        qq, kk, kv = (float(x) for x in torch.stack([qf.dot(qf), kf.dot(kf), kf.dot(vf)]).tolist())
        return math.isfinite(kv) and qq * kk < limit * limit
    q_lo, q_hi, k_lo, k_hi, v_lo, v_hi = (float(x) for x in torch.stack(
        [*torch.aminmax(q), *torch.aminmax(k), *torch.aminmax(v)]).float().tolist())
    if not all(map(math.isfinite, (q_lo, q_hi, k_lo, k_hi, v_lo, v_hi))):
        return False
    return max(-q_lo, q_hi) * max(-k_lo, k_hi) * q.shape[-1] < limit


def all_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``k`` and ``v`` (same shape) hold only finite values, in one reduction
    and one host synchronisation: ``k · v`` (flattened) is finite iff every product is
    (``inf · 0`` is NaN, ``inf · x`` infinite, a NaN stays NaN), unless the sum
    overflows. An overflow only sends the batch down the isolating path, which is as
    exact; fp16, whose products overflow early, sums each tensor in fp32 instead."""
    if k.dtype is torch.float16:
        return math.isfinite(float(k.sum(dtype=torch.float32)) + float(v.sum(dtype=torch.float32)))
    return math.isfinite(float(k.ravel().dot(v.ravel())))


def bad_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[T]`` True where a packed row of ``k`` or ``v`` (``[T, H, D]``) holds a
    non-finite value in any head."""
    return ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1))


def sanitised(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Packed ``x[T, H, D]`` with the rows marked in ``bad[T]`` zeroed (a new tensor)."""
    return x.masked_fill(bad[:, None, None], 0)


def poisoned_rows(layout: BatchLayout, bad: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[q_tokens]`` True for the query rows that attend a key row marked in ``bad``
    (bottom-right causal within a sequence, every key of it when bidirectional, under
    a sliding ``window`` if given; rows outside every sequence attend nothing). The
    rare path: Python over the layout."""
    rows = torch.zeros(layout.q_tokens, dtype=torch.bool)
    marked = bad.nonzero().flatten().tolist()
    for qs, ql, ks, kl in zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens):
        for t in (r - ks for r in marked if ks <= r < ks + kl):
            # query j (position p = kl - ql + j) sees key t when t <= p (causal) and
            # p - window < t (and t - window < p when bidirectional)
            lo = t if layout.causal else (-1 if window is None else t - window + 1)
            hi = kl if window is None else t + window  # positions lo <= p < hi
            j0, j1 = max(0, lo - (kl - ql)), min(ql, hi - (kl - ql))
            if j0 < j1:
                rows[qs + j0:qs + j1] = True
    return rows.to(bad.device)


def repoisoned(out: torch.Tensor, layout: BatchLayout, bad: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Packed ``out[q_tokens, Hq, D]`` with the rows that attend a ``bad`` key row
    (:func:`poisoned_rows`, under ``window``) set to NaN in every head."""
    return out.masked_fill(poisoned_rows(layout, bad, window)[:, None, None], float("nan"))


def _huge_rows(x: torch.Tensor, limit: float) -> torch.Tensor:
    """``[T]`` True where a packed row of ``x`` (``[T, H, D]``) has a head whose norm
    reaches ``sqrt(limit)`` (or overflows): only such a row can take part in a q·k
    product of ``limit`` or more (Cauchy–Schwarz)."""
    norms = torch.linalg.vector_norm(x.double(), dim=-1)  # fp64: no overflow below fp32's range
    huge: torch.Tensor = (norms >= math.sqrt(limit)).any(-1)
    return huge


def _own(starts: tuple[int, ...], lens: tuple[int, ...], tokens: int, seq: int, device: torch.device) -> torch.Tensor:
    own = torch.zeros(tokens, dtype=torch.bool, device=device)
    own[starts[seq]:starts[seq] + lens[seq]] = True
    return own


def isolated(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
             window: int | None = None) -> torch.Tensor:
    """``run(q, k, v)`` (packed in, packed ``[q_tokens, Hq, D]`` out) with every
    sequence's output depending only on its own rows, whatever the others hold
    (the rare path after a failed :func:`leak_free`):

    1. key rows holding a non-finite value, or whose norm could overflow a q·k
       product, are zeroed (value rows: the non-finite ones) and ``run`` runs once:
       a hidden zero row gets weight exactly 0, so a sequence with no such row of
       its own gets its clean answer, bit for bit;
    2. each sequence owning such a huge (finite) query or key row runs again alone,
       on inputs whose rows it does not own are zeroed: its own values give its own
       answer, as the kernel would give it in a batch of its own;
    3. the rows that attend a non-finite key row (under the call's sliding ``window``)
       are set to NaN (:func:`repoisoned`).
    """
    limit = score_limit(q.dtype)
    bad = bad_rows(k, v)
    huge_k, huge_q = _huge_rows(k, limit) & ~bad, _huge_rows(q, limit)
    out = run(q, sanitised(k, bad | huge_k), sanitised(v, bad))
    lay = layout
    rows_q, rows_k = huge_q.nonzero().flatten().tolist(), huge_k.nonzero().flatten().tolist()
    for i, (qs, ql, ks, kl) in enumerate(zip(lay.q_starts, lay.q_lens, lay.kv_starts, lay.kv_lens)):
        if not (any(qs <= r < qs + ql for r in rows_q) or any(ks <= r < ks + kl for r in rows_k)):
            continue
        own_q = _own(lay.q_starts, lay.q_lens, lay.q_tokens, i, q.device)
        own_kv = _own(lay.kv_starts, lay.kv_lens, lay.kv_tokens, i, k.device)
        alone = run(sanitised(q, ~own_q), sanitised(k, bad | ~own_kv), sanitised(v, bad | ~own_kv))
        out[own_q] = alone[own_q]
    return repoisoned(out, layout, bad, window)
