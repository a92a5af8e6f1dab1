"""Graph functions and their execution: what a compiled graph of each kind
computes (:func:`graph_fn`; a :class:`~attnpolicy.graphs.flexgraph.FlexGraph` runs a
whole MASK batch itself), how packed tensors become its inputs, and how outputs are
scattered back (:func:`execute`). :func:`check_inputs` validates the tensors against
the layout; :func:`attend` runs a layout in a mode uncompiled (the reference path)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.core.names import DTYPES, IMPLS
from attnpolicy.errors import LayoutError
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.flexgraph import FlexGraph
from attnpolicy.graphs.keys import Call
from attnpolicy.kernels.attention import BoundKernel, bind, check_scale
from attnpolicy.kernels.flex import BlockMaskCache, flex_graph
from attnpolicy.kernels.isolation import isolated, leak_free
from attnpolicy.kernels.mask_cache import MaskCache
from attnpolicy.kernels.masks import bounded_mask, layout_mask, mask_for, real_rows, window_band

GraphFn = Callable[..., torch.Tensor] | FlexGraph


def graph_fn(call: Call, impl: str, scale: float | None, partition_len: int | None,
             features: Features = PLAIN) -> GraphFn:
    """The Python function a graph of ``call``'s kind computes (what gets compiled).

    - CAUSAL: ``f(q, k, v)``, mask-free, ``is_causal`` (a sliding window: a band built
      in the graph);
    - MASK: ``f(q, k, v, mask)`` with a dense boolean mask built on the host (the
      window is in the mask);
    - VARLEN: ``f(q, k, v, lens)``, one sequence; bounds (and the window) are applied
      in the graph from the bounds tensor;
    - ROWS: ``f(q, k, v, q_lens, kv_lens)`` over ``[R, H, L, D]`` rows, one sequence a
      row (see :func:`_rows_graph`): mask-free for fresh causal rows, else bound per
      row in the graph from the lengths tensors;
    - MASK with impl ``flex``: a :class:`FlexGraph` (block mask instead of a dense one;
      here with a one-entry block-mask cache, the dispatcher passes its own).

    ``features``' soft cap is bound into the kernel; with sinks every function takes
    the sink logits ``[Hq]`` as one more, last, input.

    MASK, VARLEN and ROWS graphs do not isolate sequences themselves: :func:`execute`
    does, around them (see :mod:`attnpolicy.kernels.isolation`). Each kind's
    functions are closures over one code object; ``compile.py`` gives every compiled
    graph a fresh code object of its own.
    """
    if call.kind is CallKind.MASK and impl == "flex":
        return FlexGraph(flex_graph(scale, features.softcap, features.sinks), BlockMaskCache(1), features.window)
    run = bind(impl, scale=scale, partition_len=partition_len, softcap=features.softcap)
    window = features.window
    rows, cols, causal = call.q_bucket, call.kv_bucket, call.causal
    if call.kind is CallKind.CAUSAL:
        def causal_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            band = None if window is None else window_band(rows, cols, window, causal=True, device=q.device)
            return run(q, k, v, True, band)

        def causal_sink_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
            band = None if window is None else window_band(rows, cols, window, causal=True, device=q.device)
            return run(q, k, v, True, band, sinks)
        return causal_sink_graph if features.sinks else causal_graph
    if call.kind is CallKind.MASK:
        def mask_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return run(q, k, v, False, mask)

        def mask_sink_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            sinks: torch.Tensor) -> torch.Tensor:
            return run(q, k, v, False, mask, sinks)
        return mask_sink_graph if features.sinks else mask_graph

    if call.kind is CallKind.ROWS:
        return _rows_graph(run, rows, cols, causal and not call.context, causal, window, features.sinks)

    def varlen_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return run(q, k, v, False, bounded_mask(rows, cols, lens[0], lens[1], causal, window))

    def varlen_sink_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                          sinks: torch.Tensor) -> torch.Tensor:
        return run(q, k, v, False, bounded_mask(rows, cols, lens[0], lens[1], causal, window), sinks)
    return varlen_sink_graph if features.sinks else varlen_graph


def _rows_graph(run: BoundKernel, rows: int, cols: int, mask_free: bool, causal: bool, window: int | None,
                sinks: bool) -> GraphFn:
    """A ROWS graph: ``f(q, k, v, q_lens, kv_lens)`` over ``[R, H, L, D]`` rows and the
    ``[R]`` lengths of each row. ``mask_free`` (causal rows without cached context):
    ``is_causal``, the lengths unread (right padding keeps every valid query on valid
    keys; a window is a band built in the graph); otherwise each row's keys are bound
    in the graph from its lengths (:func:`bounded_mask`)."""
    def bounds(q: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        if mask_free:
            return None if window is None else window_band(rows, cols, window, causal=True, device=q.device)
        return bounded_mask(rows, cols, q_lens[:, None, None], kv_lens[:, None, None], causal, window)

    def rows_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor,
                   kv_lens: torch.Tensor) -> torch.Tensor:
        return run(q, k, v, mask_free, bounds(q, q_lens, kv_lens))

    def rows_sink_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor,
                        kv_lens: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return run(q, k, v, mask_free, bounds(q, q_lens, kv_lens), sinks)
    return rows_sink_graph if sinks else rows_graph


def graph_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
                 call: Call, masks: MaskCache | None = None, window: int | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """Slice, pad to the call's buckets and transpose packed tensors into graph inputs.

    A ROWS call gathers its sequences into rows (:func:`rows_inputs`). A MASK call
    takes the whole packed tensors, padding rows included: garbage there (an
    uninitialised buffer: NaN, inf) is isolated by :func:`execute` like any key row
    the mask hides. Masks (under ``window``), bounds and zero padding blocks come
    from ``masks`` (built fresh without one); sink logits are appended by the caller."""
    if call.kind is CallKind.ROWS:
        return rows_inputs(q, k, v, layout, call, masks)
    if call.q_bucket == call.q_len == q.shape[0] and call.kv_bucket == call.kv_len == k.shape[0]:
        ins = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # whole tensors, unpadded
    else:
        ins = (_rows(q, call.q_start, call.q_len, call.q_bucket, masks),
               _rows(k, call.kv_start, call.kv_len, call.kv_bucket, masks),
               _rows(v, call.kv_start, call.kv_len, call.kv_bucket, masks))
    kind = call.kind
    if kind is CallKind.CAUSAL:
        return ins
    if kind is CallKind.MASK:
        if masks is None:
            return (*ins, mask_for(layout, window).dense(call.q_bucket, call.kv_bucket, str(q.device)))
        return (*ins, layout_mask(masks, layout, call.q_bucket, call.kv_bucket, q.device, window))
    device = str(q.device)

    def bounds() -> torch.Tensor:  # VARLEN; kept per device: no transfer per call
        return torch.tensor([call.q_len, call.kv_len], device=device)
    lens = bounds() if masks is None else masks.small(("lens", call.q_len, call.kv_len, device), bounds)
    return (*ins, lens)


def rows_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, call: Call,
                masks: MaskCache | None = None) -> tuple[torch.Tensor, ...]:
    """A ROWS call's inputs: ``q[R, Hq, Lq, D]``, ``k, v[R, Hkv, Lk, D]`` (its sequences
    gathered one a row, right-padded with zeros, rows beyond them zero) and the rows'
    lengths ``q_lens[R]``, ``kv_lens[R]`` (0 for the rows beyond them). One gather per
    tensor; its indices and the lengths are kept in ``masks`` (each its own tensor: no
    two inputs of a compiled graph share storage)."""
    q_idx, q_lens = _row_index("q", layout.q_starts, layout.q_lens, call, call.q_bucket, q, masks)
    kv_idx, kv_lens = _row_index("kv", layout.kv_starts, layout.kv_lens, call, call.kv_bucket, k, masks)
    return (_gathered(q, q_idx, call.rows, call.q_bucket), _gathered(k, kv_idx, call.rows, call.kv_bucket),
            _gathered(v, kv_idx, call.rows, call.kv_bucket), q_lens, kv_lens)


def _gathered(x: torch.Tensor, index: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Rows of packed ``x[T, H, D]`` at ``index`` (``T``: a zero row), as ``[rows, H, length, D]``."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded.index_select(0, index).view(rows, length, *x.shape[1:]).transpose(1, 2)


def _row_index(which: str, starts: tuple[int, ...], lens: tuple[int, ...], call: Call, length: int,
               x: torch.Tensor, masks: MaskCache | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row of each ``(row, position)`` of a ROWS call's ``[rows, length]``
    (``x``'s token count, its zero row, where a row has no token there), and the rows'
    lengths (``which``: ``"q"`` or ``"kv"``, kept apart)."""
    first, end, pad = call.seq_start, call.seq_start + call.seqs, (0,) * (call.rows - call.seqs)
    device = str(x.device)

    def row_lens() -> torch.Tensor:
        return torch.tensor([*lens[first:end], *pad], device=device)

    def index() -> torch.Tensor:
        pos = torch.arange(length)
        n, at = torch.tensor([*lens[first:end], *pad]), torch.tensor([*starts[first:end], *pad])
        return torch.where(pos < n[:, None], at[:, None] + pos, x.shape[0]).flatten().to(device)
    if masks is None:
        return index(), row_lens()
    key = (which, starts[first:end], lens[first:end], call.rows, device)
    return (masks.small(("rows-index", *key, length, x.shape[0]), index),
            masks.small(("rows-lens", *key), row_lens))


def _rows(x: torch.Tensor, start: int, n: int, bucket: int, masks: MaskCache | None) -> torch.Tensor:
    """Rows ``[start, start + n)`` of packed ``x``, padded with zero rows to ``bucket``,
    heads first. No copy unless padding is needed (then one ``cat`` with a zero block,
    kept in ``masks``: never written, ``cat`` copies it)."""
    if n != x.shape[0]:
        x = x[start:start + n]
    if bucket > n:
        shape = (bucket - n, x.shape[1], x.shape[2])

        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=x.dtype, device=x.device)
        pad = zeros() if masks is None else masks.small(("zeros", *shape, x.dtype, x.device), zeros)
        x = torch.cat([x, pad])
    return x.transpose(0, 1)


def execute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
            graphs: Sequence[tuple[Call, GraphFn]], masks: MaskCache | None = None,
            features: Features = PLAIN, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Run each planned call through its graph and scatter the outputs into a packed
    ``[q_tokens, Hq, D]`` tensor (padding rows zero), in no-grad mode (graphs are
    compiled for inference). Inputs are made contiguous so every graph sees the
    strides it was compiled for; masks come from ``masks``.

    Isolation: a batch with a masked call (MASK, VARLEN) whose K/V hold a non-finite
    value, or whose q·k could overflow, takes the isolating path of
    :mod:`attnpolicy.kernels.isolation`; one cheap check per batch decides, so an
    ordinary batch pays only that check. A batch of one unpadded sequence has no
    neighbour to protect and is not checked: what a bad value in it does is the
    kernel's own answer, as in a CAUSAL call. Under a sliding window CAUSAL graphs
    mask too (keys behind the window), so they are checked like the others. Flex
    graphs isolate themselves the same way.

    ``features`` are those the graphs were built for (their window shapes the masks
    and the isolation); ``sinks[Hq]`` (when they take sinks) goes to every graph, as
    :func:`graph_sinks` makes it."""
    if features.sinks != (sinks is not None):
        raise LayoutError("sinks must be given exactly when the graphs take them (features.sinks="
                          f"{features.sinks}), got {'a tensor' if sinks is not None else None}")
    if sinks is not None:
        sinks = graph_sinks(sinks, q)
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _execute(q.contiguous(), k.contiguous(), v.contiguous(), layout, graphs, masks, features, sinks)
    return _execute(q.contiguous(), k.contiguous(), v.contiguous(), layout, graphs, masks, features, sinks)


def graph_sinks(sinks: object, q: torch.Tensor) -> torch.Tensor:
    """``sinks`` in the form every graph over ``q`` is compiled for: a contiguous ``[Hq]``
    tensor of ``q``'s dtype on ``q``'s device. Another real dtype (fp64, bf16, an integer
    one) is cast and a strided or expanded tensor copied, only when needed; anything else
    raises :class:`LayoutError` naming ``sinks`` and what it got."""
    if (isinstance(sinks, torch.Tensor) and sinks.dtype is q.dtype and sinks.shape == q.shape[1:2]
            and sinks.device == q.device and sinks.is_contiguous()):
        return sinks  # the common case: as compiled, no copy
    if not isinstance(sinks, torch.Tensor):
        raise LayoutError(f"sinks must be a tensor [Hq={q.shape[1]}] of sink logits, got {type(sinks).__name__}")
    if sinks.shape != q.shape[1:2]:
        raise LayoutError(f"sinks must have shape [Hq={q.shape[1]}], got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise LayoutError(f"sinks are on {sinks.device}, q on {q.device}: give them on q's device")
    if sinks.dtype is torch.bool or sinks.is_complex():
        raise LayoutError(f"sinks must be real sink logits, got dtype {sinks.dtype}")
    return sinks.to(q.dtype).contiguous()  # each a no-op when already so


def _execute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
             graphs: Sequence[tuple[Call, GraphFn]], masks: MaskCache | None, features: Features,
             sinks: torch.Tensor | None) -> torch.Tensor:
    call, first = graphs[0]
    if len(graphs) == 1:
        if isinstance(first, FlexGraph):
            return first.run(q, k, v, layout, call, sinks)
        masked = call.kind is not CallKind.CAUSAL
    else:
        masked = any(call.kind is not CallKind.CAUSAL for call, _ in graphs)
    masked = masked or features.window is not None  # a window masks CAUSAL graphs too
    if masked and not layout.is_single and not leak_free(q, k, v):
        return isolated(lambda q, k, v: _run(q, k, v, layout, graphs, masks, features.window, sinks),
                        q, k, v, layout, features.window)
    return _run(q, k, v, layout, graphs, masks, features.window, sinks)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
         graphs: Sequence[tuple[Call, GraphFn]], masks: MaskCache | None, window: int | None,
         sinks: torch.Tensor | None) -> torch.Tensor:
    extra = () if sinks is None else (sinks,)
    call, first = graphs[0]
    if len(graphs) == 1 and call.q_len == layout.q_tokens and call.kind in (CallKind.CAUSAL, CallKind.MASK):
        # one call over every query row (MASK, or CAUSAL of one unpadded sequence)
        out = first(*graph_inputs(q, k, v, layout, call, masks, window), *extra)  # type: ignore[operator]
        if call.q_bucket != call.q_len:
            out = out[:, :call.q_len]
        if call.kind is CallKind.MASK and layout.is_padded:
            real = real_rows(layout.q_starts, layout.q_lens, layout.q_tokens, str(out.device), masks)
            return out.transpose(0, 1).masked_fill(~real[:, None, None], 0)
        return out.transpose(0, 1)
    # every real row is written by exactly one call: only padding rows need zeros
    out = q.new_zeros(q.shape) if layout.q_tokens != layout.total_tokens else torch.empty_like(q)
    for call, each in graphs:
        o = each(*graph_inputs(q, k, v, layout, call, masks, window), *extra)  # type: ignore[operator]
        if call.kind is CallKind.ROWS:
            _scatter_rows(out, o, layout, call)
            continue
        n = call.q_len
        out[call.q_start:call.q_start + n].copy_((o if call.q_bucket == n else o[:, :n]).transpose(0, 1))
    return out


def _scatter_rows(out: torch.Tensor, o: torch.Tensor, layout: BatchLayout, call: Call) -> None:
    """Write a ROWS call's output ``o[R, Hq, Lq, D]`` into packed ``out``: each
    sequence's valid positions of its row (padded positions and rows dropped)."""
    rows = o.transpose(1, 2)
    for row, seq in enumerate(range(call.seq_start, call.seq_start + call.seqs)):
        start, n = layout.q_starts[seq], layout.q_lens[seq]
        out[start:start + n].copy_(rows[row, :n])


#: The dtypes attention computes in (fp16/bf16/fp32 in fp32, fp64 in fp64).
TORCH_DTYPES = tuple(getattr(torch, name) for name in DTYPES)


def _fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout) -> bool:
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k, T) and isinstance(v, T)):
        return False
    qs, ks = q.shape, k.shape
    return (len(qs) == 3 and len(ks) == 3 and ks == v.shape and qs[0] == layout.q_tokens
            and ks[0] == layout.kv_tokens and qs[2] == ks[2] and ks[1] > 0 and qs[2] > 0
            and qs[1] % ks[1] == 0 and q.dtype == k.dtype == v.dtype and q.dtype in TORCH_DTYPES
            and q.device == k.device == v.device)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
                 scale: object = None) -> None:
    """Raise :class:`LayoutError` naming the field if the tensors do not fit the layout
    (or ``ValueError`` for a ``scale`` that is not None or a finite number > 0)."""
    if scale is not None:
        check_scale(scale)
    if _fits(q, k, v, layout):  # the common case in one expression; the checks below say what is wrong
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise LayoutError(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
        if t.dtype not in TORCH_DTYPES:
            raise LayoutError(f"{name} has dtype {t.dtype}; attention takes "
                              f"{', '.join(str(d) for d in TORCH_DTYPES)}")
        if t.shape[1] < 1 or t.shape[2] < 1:
            raise LayoutError(f"{name} must have at least one head and head_dim >= 1, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise LayoutError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != layout.q_tokens:
        raise LayoutError(f"q has {q.shape[0]} tokens but layout.q_tokens={layout.q_tokens}")
    if k.shape[0] != layout.kv_tokens:
        raise LayoutError(f"k has {k.shape[0]} tokens but layout.kv_tokens={layout.kv_tokens}")
    if q.shape[2] != k.shape[2]:
        raise LayoutError(f"head_dim differs: q has {q.shape[2]}, k has {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise LayoutError(f"kv heads ({k.shape[1]}) must divide q heads ({q.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise LayoutError(f"dtype differs: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise LayoutError(f"device differs: q {q.device}, k {k.device}, v {v.device}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
           mode: MaskMode | str, impl: str = "sdpa", *, scale: float | None = None,
           partition_len: int | None = None, window: int | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over packed ``q[q_tokens, Hq, D]``, ``k, v[kv_tokens, Hkv, D]``, uncompiled,
    under a sliding ``window``, a ``softcap`` and ``sinks[Hq]`` if given
    (:mod:`attnpolicy.core.features`).

    Returns ``[q_tokens, Hq, D]``; padding rows are zero. Raises
    :class:`~attnpolicy.errors.IllegalModeError` if ``mode`` is illegal for the layout.
    """
    features = Features(window, softcap, sinks is not None)
    mode = MaskMode(mode)
    if impl not in IMPLS and not (impl == "flex" and mode is MaskMode.MASK):
        raise ValueError(f"impl must be one of {IMPLS} (or 'flex' in mode mask), got {impl!r}")
    if partition_len is not None and partition_len < 1:
        raise ValueError(f"partition_len must be >= 1, got {partition_len}")
    check_inputs(q, k, v, layout, scale)
    graphs = [(call, graph_fn(call, impl, scale, partition_len, features)) for call in plan_calls(layout, mode)]
    return execute(q, k, v, layout, graphs, features=features, sinks=sinks)
