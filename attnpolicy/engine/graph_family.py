"""The whole-model graph family: an HF causal LM's forward as one graph per
:class:`~attnpolicy.engine.keys.ModelKey`.

A prefill is a step with no context. A key with ``kv`` is a *step* graph: the KV cache
is a graph input and output. The runner keeps each running sequence's keys and values in
a slot of a :class:`~attnpolicy.engine.kv_cache.KVCache`; a step gathers its sequences'
past into the graph's padded ``past_k``/``past_v`` inputs ``[layers, kv_heads, C,
head_dim]`` and the graph returns, beside the logits, every layer's new key and value
rows ``[layers, kv_heads, T, head_dim]``, which the runner writes back into the slots.
Gathered spans rather than block tables: a static graph then takes two dense tensors
whose shape the key fixes, and reads only the context its key pads to; block tables
(vLLM, Gaudi) save that copy but need a paged kernel inside the graph, which no portable
SDPA graph has. A key without ``kv`` is a prefill whose KV is not kept: ids and
positions in, logits out.

What each mode's graph is (``T`` rows, ``C`` context columns, ``C = 0`` without ``kv``;
real rows packed back to back, layout padding dropped):

- ``CAUSAL``: one sequence, its context exact (no padding inside it), its rows padded at
  the end to their bucket; a mask-free causal call (bottom-right aligned: trailing
  padding reaches no real row). A step graph is keyed by the exact context length:
  mask-free needs it.
- ``MASK``: every sequence's rows packed, padded to the batch bucket of their total,
  every context packed, padded to the batch bucket of its total; the host-built mask is
  a graph input (a prefill's dense block-diagonal ``[1, 1, T, T]``, a step's ``[T, C +
  T]``: each row sees its own sequence's context and its own earlier rows), so one graph
  serves every layout of its buckets.
- ``VARLEN``: each sequence padded to its own (rows, context) buckets, in a span of its
  own; one causal call per sequence, seeing only its own span (a step's mask input
  ``[C]`` marks the real context positions). The key is the tuple of per-sequence
  buckets, sorted largest first (sequences are reordered into it), so permutations of
  one batch share a graph, at the price of one graph per combination of buckets.
- ``ROWS``: one sequence per row of a ``[R, L]`` batch (R the row bucket of the sequences,
  L the bucket of the longest rows), right-padded, each row's context in a span of the
  bucket of the longest context; spare rows are padding. A prefill (or a step without
  context) is one mask-free causal call over all rows; a step bounds each row's keys
  inside the graph from a lengths input ``[R]`` (each row's context), never a host-built
  mask. One graph per (rows, length, context) buckets, whatever the sequences' mix.

Inside a graph attention is a plain kernel call (:func:`attnpolicy.kernels.attention.bind`,
``sdpa``) on the graph's inputs, a ROWS graph's rows batched into its heads (a kernel's
``[heads, L, D]`` as ``[rows·heads, L, D]``: GQA's grouping of query heads onto key heads
holds row by row); the Python dispatcher is not involved. The model's
attention implementation is :data:`STATIC_ATTENTION`, registered with transformers'
``AttentionInterface`` (no mask function: HF builds no mask, the 4-D mask arrives as-is).
A graph padded up serves a key it dominates (:func:`~attnpolicy.engine.keys.dominates`);
a stored graph is keyed by the model's code and config (:func:`model_code`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch

from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore, source_hash
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.code_identity import graph_code, module_code
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey, dominates, estimate_bytes
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import aot
from attnpolicy.graphs.compile import Capture, CompiledGraph, compile_graph, compile_lock, release_graph
from attnpolicy.kernels.attention import bind
from attnpolicy.plugins.compilers import resolve_compiler, why_unstored

#: The attention implementation name the runner gives the model.
STATIC_ATTENTION = "attnpolicy-static"
#: The keyword argument that carries a VARLEN graph's segments to the attention calls.
SEGMENTS_KWARG = "attnpolicy_segments"
#: The keyword argument that carries a step's cached context (:class:`Past`) to the attention calls.
PAST_KWARG = "attnpolicy_past"
#: A graph's inputs: ids ``[T]``, positions ``[T]``, (``kv``) past keys and values, and
#: the mask (a prefill's MASK; a step's MASK and VARLEN) or a ROWS step's context lengths.
Inputs = tuple[torch.Tensor, ...]


class Past(NamedTuple):
    """A step's cached context inside its graph: every layer's past keys and values
    ``[layers, kv_heads, C, head_dim]`` (each sequence's context in a span of its own),
    what of it each row may see, and the list each layer appends its new key and value
    rows to (the graph's KV outputs).

    ``segments`` ``None``: ``mask`` ``[T, C + T]`` (True = attend) over past then new
    rows (MASK), or ``mask`` ``None``: one sequence whose context is all of ``C``,
    causal (CAUSAL). Else ``((rows, context), ...)`` per sequence, in order: one call
    per sequence over its own span of past and rows, ``mask`` ``[C]`` the real past
    positions (VARLEN: no score across sequences)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    segments: tuple[tuple[int, int], ...] | None
    new: list[tuple[torch.Tensor, torch.Tensor]]


def _with_past(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: Past,
               run: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One layer's attention of new rows ``q, k, v`` (``[heads, T, D]``) over ``past``."""
    past.new.append((k, v))
    pk, pv = past.k[layer], past.v[layer]
    if past.segments is None:
        return run(q, torch.cat([pk, k], 1), torch.cat([pv, v], 1), past.mask is None, past.mask)
    parts, rows, ctx = [], 0, 0
    for n, c in past.segments:
        seen = torch.cat([past.mask[ctx:ctx + c].expand(n, c),  # type: ignore[index]
                          torch.ones(n, n, dtype=torch.bool, device=q.device).tril()], 1)
        parts.append(run(q[:, rows:rows + n], torch.cat([pk[:, ctx:ctx + c], k[:, rows:rows + n]], 1),
                         torch.cat([pv[:, ctx:ctx + c], v[:, rows:rows + n]], 1), False, seen))
        rows, ctx = rows + n, ctx + c
    return torch.cat(parts, dim=1)


class RowsPast(NamedTuple):
    """A ROWS step's cached context inside its graph: every layer's past keys and values
    ``[layers, kv_heads, R·C, head_dim]`` (row ``r``'s context at columns ``r·C:``), each
    row's context length ``[R]`` (``None``: no context, ``C = 0``) and the list each layer
    appends its new key and value rows ``[kv_heads, R·L, head_dim]`` to."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor | None
    new: list[tuple[torch.Tensor, torch.Tensor]]


def _rows_with_past(layer: int, rows: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: RowsPast,
                    run: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One layer's attention of ``rows`` rows batched into the heads (``q`` ``[rows·heads,
    L, D]``, ``k, v`` ``[rows·kv_heads, L, D]``) over ``past``: each row sees the first
    ``lengths[r]`` columns of its context and its own earlier rows (a mask per row built
    in the graph from the lengths, the kernel's ROWS form); mask-free causal without context."""
    kv_heads, length = k.shape[0] // rows, k.shape[1]

    def by_head(x: torch.Tensor) -> torch.Tensor:  # [rows·kv_heads, n, D] -> [kv_heads, rows·n, D]
        return x.reshape(rows, kv_heads, *x.shape[1:]).transpose(0, 1).flatten(1, 2)

    def by_row(x: torch.Tensor) -> torch.Tensor:  # [kv_heads, rows·C, D] -> [rows·kv_heads, C, D]
        return x.reshape(x.shape[0], rows, -1, x.shape[-1]).transpose(0, 1).flatten(0, 1)

    past.new.append((by_head(k), by_head(v)))
    if past.lengths is None:
        return run(q, k, v, True, None)
    pk, pv = by_row(past.k[layer]), by_row(past.v[layer])
    context = pk.shape[1]
    seen = torch.cat([(torch.arange(context, device=q.device) < past.lengths[:, None])[:, None].expand(
        rows, length, context), torch.ones(length, length, dtype=torch.bool, device=q.device).tril().expand(
        rows, length, length)], 2)
    def rows_first(x: torch.Tensor) -> torch.Tensor:  # [rows·heads, n, D] -> [rows, heads, n, D]
        return x.reshape(rows, -1, *x.shape[1:])

    # the kernels' ROWS form: one mask [rows, L, C + L] per row, shared by its heads
    return run(rows_first(q), rows_first(torch.cat([pk, k], 1)), rows_first(torch.cat([pv, v], 1)), False,
               seen).flatten(0, 1)


def static_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function of the runner's graphs (batch 1, or a ROWS
    graph's rows, batched into the heads): ``attention_mask`` ``[1, 1, T, T]`` (True =
    attend) or ``None`` (causal, every row); with ``attnpolicy_segments`` one causal call
    per segment of rows; with ``attnpolicy_past`` (a :class:`Past`, or a ROWS step's
    :class:`RowsPast`) over a step's cached context, the new key and value rows recorded."""
    run = bind("sdpa", scale=scaling)  # traced once per graph: no memo for Dynamo to guard on
    rows = query.shape[0]
    q, k, v = query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1)
    past: Past | RowsPast | None = kwargs.get(PAST_KWARG)
    segments: tuple[int, ...] | None = kwargs.get(SEGMENTS_KWARG)
    layer: int = module.layer_idx  # type: ignore[assignment]
    if isinstance(past, RowsPast):
        out = _rows_with_past(layer, rows, q, k, v, past, run)
    elif past is not None:
        out = _with_past(layer, q, k, v, past, run)
    elif attention_mask is not None:
        out = run(q, k, v, False, attention_mask[0, 0])
    elif segments is None:
        out = run(q, k, v, True, None)
    else:
        parts, start = [], 0
        for n in segments:
            parts.append(run(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n], True, None))
            start += n
        out = torch.cat(parts, dim=1)
    return out.reshape(rows, -1, *out.shape[1:]).transpose(1, 2), None


def register() -> None:
    """Register :func:`static_attention` with transformers as :data:`STATIC_ATTENTION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(STATIC_ATTENTION, static_attention)


def _causal_forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A CAUSAL graph's forward, the model its first input (so its artifact holds no weights)."""
    return model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]


def _masked_forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """A MASK graph's forward, the model its first input."""
    out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, use_cache=False)
    return out.logits[0]


def _varlen_forward(model: torch.nn.Module, segments: tuple[int, ...], ids: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """A VARLEN graph's forward, the model its first input and its segments (Python ints,
    constants of the graph) its second."""
    out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False, **{SEGMENTS_KWARG: segments})
    return out.logits[0]


def _step_forward(model: torch.nn.Module, segments: tuple[tuple[int, int], ...] | None, ids: torch.Tensor,
                  positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step graph's forward, the model and (VARLEN) its segments first (constants of
    the graph): ``(logits [T, vocab], new keys, new values [layers, kv_heads, T, D])``."""
    new: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                **{PAST_KWARG: Past(past_k, past_v, mask, segments, new)})
    return out.logits[0], torch.stack([k for k, _ in new]), torch.stack([v for _, v in new])


def _rows_forward(model: torch.nn.Module, rows: int, ids: torch.Tensor, positions: torch.Tensor,
                  past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                  lengths: torch.Tensor | None = None) -> Any:
    """A ROWS graph's forward, the model and its row count first (a constant of the graph):
    ids and positions ``[rows·L]`` as ``[rows, L]``; logits ``[rows·L, vocab]``, and with
    ``past_k``/``past_v`` (a step's, :class:`RowsPast`) the new keys and values
    ``[layers, kv_heads, rows·L, D]`` as :func:`_step_forward`'s."""
    new: list[tuple[torch.Tensor, torch.Tensor]] = []
    past = {} if past_k is None or past_v is None else {PAST_KWARG: RowsPast(past_k, past_v, lengths, new)}
    logits = model(input_ids=ids.view(rows, -1), position_ids=positions.view(rows, -1), use_cache=False,
                   **past).logits.flatten(0, 1)
    if not past:
        return logits
    return logits, torch.stack([k for k, _ in new]), torch.stack([v for _, v in new])


#: The forward a prefill graph of each mode is compiled from (see :meth:`ModelFamily.bound`).
_FORWARDS: dict[MaskMode, Callable[..., torch.Tensor]] = {
    MaskMode.CAUSAL: _causal_forward, MaskMode.MASK: _masked_forward, MaskMode.VARLEN: _varlen_forward}


def model_code(model: torch.nn.Module, config: str, dtype: torch.dtype,
               device: torch.device) -> tuple[str | None, str]:
    """``(code_hash, "")`` of ``model``'s stored graphs: attnpolicy's graph code (the
    kernels every attention call binds), this module, the model's module with the
    modules of its package it reaches and that package's installed version
    (:mod:`~attnpolicy.core.code_identity`), the model ``config`` (its JSON), dtype and device;
    ``(None, why)`` when the model's code has no source to hash."""
    try:
        return source_hash(graph_code(), sys.modules[__name__], module_code(type(model).__module__),
                           config, str(dtype), str(device)), ""
    except ConfigError as e:
        return None, f"model {type(model).__name__}: {e}"


class ModelFamily:
    """The whole-model graphs of ``model`` (:class:`~attnpolicy.dispatch.family.GraphFamily`),
    keyed by :class:`ModelKey`, built from a placed batch's inputs.

    With ``config.store_dir`` every graph on a backend (not ``"none"``) of a model whose
    code has a source to hash persists there, compiled ahead of time and keyed by the
    model's code and config (:func:`model_code`); a miss loads it, eviction releases it.
    A background miss no resident graph serves runs the eager forward.
    ``compile_counter(gm)`` sees every backend compile. The compiler is
    ``config.backend`` with ``config.backend_options``; a compiler that stores nothing
    compiles every graph."""

    eager_misses = True  # a background miss no resident graph serves runs the eager forward

    def __init__(self, model: torch.nn.Module, config: AttnPolicyConfig, *,
                 compile_counter: Callable[[torch.fx.GraphModule], None] | None = None) -> None:
        self.config = config
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._itemsize = param.element_size()
        self._counter = compile_counter
        self._store = DiskStore(config.store_dir, config.max_disk_bytes) if config.store_dir is not None else None
        c: Any = model.config
        self._code, self._unstored = (model_code(model, c.to_json_string(), self.dtype, self.device)
                                      if self._store is not None else ("", ""))

    @property
    def store(self) -> DiskStore | None:
        return self._store

    @staticmethod
    def rows(key: ModelKey) -> int:
        return key.tokens

    def estimate_bytes(self, key: ModelKey) -> int:
        return estimate_bytes(key, self.model.config, self._itemsize)

    @staticmethod
    def pad_up(key: ModelKey, resident: Sequence[ModelKey]) -> ModelKey | None:
        """The smallest resident key (by rows, context, then segments) that :func:`dominates` ``key``
        (a pure rule: the simulator's whole-model graphs pad up by it too)."""
        larger = [k for k in resident if isinstance(k, ModelKey) and dominates(k, key)]
        return min(larger, key=lambda k: (k.tokens, k.context, k.segments)) if larger else None

    def identity(self, key: ModelKey) -> ArtifactIdentity | None:
        """What makes ``key``'s stored artifact valid; ``None`` on backend ``"none"``, for
        a model whose code has no source to hash or a compiler that stores nothing."""
        stored = None if key.backend == "none" else self._stored(key)
        return stored if isinstance(stored, ArtifactIdentity) else None

    def _stored(self, key: ModelKey) -> ArtifactIdentity | tuple[str, str, str]:
        """The identity of compiled ``key``'s stored artifact, else ``(name, why, counter)``
        as the store's ``refuse`` takes it."""
        if self._code is None:
            return f"model {type(self.model).__name__}", self._unstored, "unidentified"
        compiler, why, counter = why_unstored(resolve_compiler(key.backend), self.config.backend_options)
        if compiler is None:
            return f"compiler {key.backend!r}", why, counter
        return ArtifactIdentity(f"{type(self.model).__name__}/{key}", aot.MECHANISM, key.backend,
                                str(self.device), str(self.dtype).removeprefix("torch."), self._code,
                                compiler=compiler)

    def load(self, key: ModelKey) -> CompiledGraph | None:
        """The graph of ``key`` from the store (``None``: no store, not stored, not there
        or not valid)."""
        store, ident = self._store, self.identity(key)
        if store is None or ident is None:
            return None
        with compile_lock():  # taken before the store's file lock, as by every load and save
            loaded = store.load(ident, aot.load_graph)
        return None if loaded is None else self._aot_graph(loaded, key, None)

    def build(self, key: ModelKey, request: Inputs) -> CompiledGraph:
        """The graph of ``key`` compiled for ``request`` (its inputs): ahead of time and
        saved when it is stored."""
        store, options = self._store, self.config.backend_options
        if store is not None and key.backend != "none":
            stored = self._stored(key)
            if isinstance(stored, ArtifactIdentity):
                capture = Capture()
                with torch.no_grad(), compile_lock():
                    compiled = aot.aot_compile_graph(self.forward(key), key.backend, (*self.bound(key), *request),
                                                     options=options, counter=self._counter, capture=capture)
                    store.save(stored, partial(aot.save_graph, compiled), suffix=aot.SUFFIX)
                return self._aot_graph(compiled, key, capture)
            store.refuse(*stored)
        # no guards, as a stored graph: its key pins what they check, and a check made
        # while the background worker (or any thread) traces fails (see compile_graph)
        return compile_graph(self.eager(key, request), self.config.backend, options=options,
                             counter=self._counter, example_inputs=request, guards=False)

    def release(self, key: ModelKey, graph: Any) -> None:
        if isinstance(graph, CompiledGraph):
            release_graph(graph)

    def forward(self, key: ModelKey) -> Callable[..., Any]:
        """The module-level function ``key``'s stored graph is compiled from: the model
        first, then :meth:`bound`'s other leading inputs, then the request."""
        if key.mode is MaskMode.ROWS:
            return _rows_forward
        return _step_forward if key.kv else _FORWARDS[key.mode]

    def bound(self, key: ModelKey) -> tuple[Any, ...]:
        """The leading inputs of ``key``'s stored graph: the model, then a step's segments
        (VARLEN, else ``None``), a VARLEN prefill's rows per segment (static: baked into
        the graph, pinned by the key); a ROWS graph's row count."""
        if key.mode is MaskMode.ROWS:
            return self.model, key.rows
        varlen = key.mode is MaskMode.VARLEN
        if key.kv:
            return self.model, key.segments if varlen else None
        return (self.model, tuple(t for t, _ in key.segments)) if varlen else (self.model,)

    def eager(self, key: ModelKey, request: Inputs) -> Callable[..., Any]:
        """The uncompiled forward of ``key``'s graph (its inputs as ``request``)."""
        forward, bound = self.forward(key), self.bound(key)

        def uncompiled(*inputs: torch.Tensor) -> Any:
            return forward(*bound, *inputs)
        return uncompiled

    def _aot_graph(self, compiled: Any, key: ModelKey, capture: Capture | None) -> CompiledGraph:
        """A graph compiled ahead of time (``capture``: what its backend returned) or loaded
        (``None``) taking the model first, as the cache holds graphs: called directly (it
        checks no guards)."""
        graph = CompiledGraph(partial(compiled, *self.bound(key)), None, key.backend, capture=capture,
                              compiler=resolve_compiler(key.backend))
        graph.direct = True
        return graph
