"""Whether a kernel computes what it claims: its output's shape, dtype and device on
every call (:func:`check_output`), and its math on a small probe per capability
against a float64 reference (:func:`probe`).

A probe case is one way a call kind calls a kernel: the ``causal`` kind a
mask-free causal call, the ``mask`` kind two packed sequences under their
block-diagonal mask (causal or bidirectional), the ``varlen`` kind one sequence
padded to a bucket under its bounds mask, the ``rows`` kind two sequences in two
right-padded rows (``[2, H, L, D]``: mask-free when causal without context, else
under each row's bounds mask); with or without cached context (more keys
than queries) and GQA (2 kv heads under 4 query heads, each kv head different, so a
kernel that reads one head only fails); and with each feature a kernel declares
(:mod:`attnpolicy.core.features`): a sliding window of 2, a soft cap of 0.5 (well
inside the logits' range, so an uncapped kernel fails), sinks (a different logit per
head). The reference is explicit float64 math, no kernel code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import KernelError
from attnpolicy.kernels.accuracy import TOLERANCE, MaxAbsError
from attnpolicy.kernels.masks import bounded_mask, mask_for, window_band

_HEADS, _HEAD_DIM = 4, 8
#: The features a probe turns on for each capability it checks.
PROBE_WINDOW, PROBE_SOFTCAP = 2, 0.5


@dataclass(frozen=True, slots=True)
class ProbeCase:
    """One way a call kind calls a kernel, in the words an error names it by."""

    kind: str
    causal: bool
    context: bool
    gqa: bool
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    features: Features = PLAIN

    @staticmethod
    def probing(features: Features) -> Features:
        """The probe's features for a call with ``features``: each one on that is on there."""
        return Features(None if features.window is None else PROBE_WINDOW,
                        None if features.softcap is None else PROBE_SOFTCAP, features.sinks)

    def describe(self) -> str:
        feats = "" if not self.features.any else f", {self.features.describe()}"
        return (f"{self.kind} family, {'causal' if self.causal else 'bidirectional'}, "
                f"{'with' if self.context else 'without'} cached context, "
                f"{'GQA 4:2' if self.gqa else 'no GQA'}, {str(self.dtype).removeprefix('torch.')}, "
                f"{self.device}{feats}")


def check_output(out: object, q: torch.Tensor, kernel: str, plugin: str) -> None:
    """Raise :class:`KernelError` naming ``kernel`` and ``plugin`` unless ``out`` is a
    tensor of ``q``'s shape, dtype and device (what every call must return)."""
    if isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device:
        return
    got = (f"shape {tuple(out.shape)}, {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
           else type(out).__name__)
    raise KernelError(f"kernel {kernel!r} of plugin {plugin!r} returned {got}; expected shape {tuple(q.shape)}, "
                      f"{q.dtype} on {q.device}")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Heads-first float64 attention under a boolean ``allowed[Lq, Lk]``, logits capped
    at ``softcap``, with one more key of logit ``sinks[h]`` and a zero value per head."""
    group = q.shape[0] // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, dim=0) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1) @ vv
    sink = sinks.double()[:, None, None].expand(s.shape[0], s.shape[1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ vv


def probe_layout(case: ProbeCase) -> BatchLayout:
    """The layout ``case``'s probe packs (two sequences for the mask kind, one otherwise)."""
    q_lens = [3, 5] if case.kind in ("mask", "rows") else [5]
    kv_lens = [n + 3 * case.context for n in q_lens]
    return BatchLayout.from_lens(q_lens, kv_lens, causal=case.causal)


def _inputs(case: ProbeCase, layout: BatchLayout, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    kv_heads = _HEADS // 2 if case.gqa else _HEADS
    q = torch.randn(_HEADS, rows, _HEAD_DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv_heads, cols, _HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    q[:, layout.q_tokens:] = 0  # bucket padding, as the dispatcher pads
    k[:, layout.kv_tokens:] = 0
    v[:, layout.kv_tokens:] = 0
    return tuple(t.to(case.dtype).to(case.device) for t in (q, k, v))


def probe_sinks(case: ProbeCase) -> torch.Tensor | None:
    """The probe's sink logits ``[Hq]`` (one different logit per head), or None."""
    if not case.features.sinks:
        return None
    return torch.linspace(-1.0, 2.0, _HEADS, dtype=torch.float64).to(case.dtype).to(case.device)


def probe(case: ProbeCase, run: Callable[..., torch.Tensor], kernel: str, plugin: str) -> None:
    """Call ``run(q, k, v, causal, mask, sinks)`` as ``case``'s kind does and raise
    :class:`KernelError` naming the kernel, its plugin and the case unless it matches
    the float64 reference on every row the call defines."""
    layout = probe_layout(case)
    if case.kind == "rows":
        _probe_rows(case, layout, run, kernel, plugin)
        return
    rows, cols = (layout.q_tokens, layout.kv_tokens) if case.kind != "varlen" else (8, 11)
    q, k, v = _inputs(case, layout, rows, cols)
    scale = 1 / math.sqrt(_HEAD_DIM)
    window, sinks = case.features.window, probe_sinks(case)
    if case.kind == "causal":
        allowed = mask_for(layout, window).materialize()
        mask = None if window is None else window_band(rows, cols, window, causal=True, device=case.device)
        causal = True
    elif case.kind == "mask":
        mask = allowed = mask_for(layout, window).materialize().to(case.device)
        causal = False
    else:
        lens = torch.tensor([layout.q_tokens, layout.kv_tokens], device=case.device)
        mask = allowed = bounded_mask(rows, cols, lens[0], lens[1], case.causal, window)
        causal = False
    out = _called(case, run, kernel, plugin, q, k, v, causal, mask, sinks)
    want = _reference(q, k, v, allowed.cpu(), scale, case.features.softcap,
                      None if sinks is None else sinks.cpu())[:, :layout.q_tokens]
    _compare(case, kernel, plugin, [(out[:, :layout.q_tokens], want)])


def _probe_rows(case: ProbeCase, layout: BatchLayout, run: Callable[..., torch.Tensor], kernel: str,
                plugin: str) -> None:
    """The rows probe: each sequence of ``layout`` right-padded in a row of its own."""
    rows, cols = max(layout.q_lens) + 1, max(layout.kv_lens) + 1  # a padded position in every row
    window, sinks = case.features.window, probe_sinks(case)
    ones = [_inputs(case, BatchLayout.from_lens([ql], [kl], causal=case.causal), rows, cols)
            for ql, kl in zip(layout.q_lens, layout.kv_lens)]
    q, k, v = (torch.stack(parts) for parts in zip(*ones))
    v = v * torch.arange(1, v.shape[0] + 1, device=case.device).to(v.dtype)[:, None, None, None]  # rows differ
    q_lens, kv_lens = (torch.tensor(n, device=case.device)[:, None, None] for n in (layout.q_lens, layout.kv_lens))
    allowed = bounded_mask(rows, cols, q_lens, kv_lens, case.causal, window)
    if case.causal and not case.context:  # mask-free, as a fresh causal rows graph runs
        causal, mask = True, None if window is None else window_band(rows, cols, window, causal=True,
                                                                      device=case.device)
    else:
        causal, mask = False, allowed
    out = _called(case, run, kernel, plugin, q, k, v, causal, mask, sinks)
    scale = 1 / math.sqrt(_HEAD_DIM)
    _compare(case, kernel, plugin, [
        (out[r, :, :n], _reference(q[r], k[r], v[r], allowed[r].cpu(), scale, case.features.softcap,
                                   None if sinks is None else sinks.cpu())[:, :n])
        for r, n in enumerate(layout.q_lens)])


def _called(case: ProbeCase, run: Callable[..., torch.Tensor], kernel: str, plugin: str, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """``run``'s output on the probe's inputs, checked for shape, dtype and device."""
    try:
        out = run(q, k, v, causal, mask, sinks)
    except KernelError:
        raise
    except Exception as exc:
        raise KernelError(f"kernel {kernel!r} of plugin {plugin!r} failed on its probe ({case.describe()}): "
                          f"{type(exc).__name__}: {exc}") from exc
    check_output(out, q, kernel, plugin)
    return out


def _compare(case: ProbeCase, kernel: str, plugin: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Raise :class:`KernelError` unless each (output, float64 reference) pair agrees."""
    err = MaxAbsError()
    for got, want in pairs:
        err.add(got.cpu(), want)
    tolerance = TOLERANCE[str(case.dtype).removeprefix("torch.")]
    if not err.passes(tolerance):
        raise KernelError(f"kernel {kernel!r} of plugin {plugin!r} does not compute attention for "
                          f"{case.describe()} against the float64 reference: {err.describe(tolerance)}")
