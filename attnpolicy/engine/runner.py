"""StaticModelRunner: a whole HF causal LM forward as one compiled graph per key.

Static-graph runtimes (tt-xla, RBLN, Neuron, TPU) compile the whole forward per
padded shape with the mask mode baked in. The runner does the same on torch: it
serves packed batches the way vLLM flattens them (token ids ``[T]`` plus a
:class:`~attnpolicy.core.layout.BatchLayout`), the guarded policy decides the mode,
and the forward runs as one ``torch.compile(dynamic=False, fullgraph=True)`` graph
per :class:`~attnpolicy.engine.keys.ModelKey` (the whole-model graph family,
:mod:`~attnpolicy.engine.graph_family`, says what each mode's graph is). Its graphs come
from the runtime the attention-level dispatcher uses: a
:class:`~attnpolicy.dispatch.graph_source.GraphSource` over a
:class:`~attnpolicy.cache.graph_cache.GraphCache` (bounded, evicting, exact statistics;
an evicted graph's code is released), the store, strict mode, and
(``compile_mode="background"``) one :class:`~attnpolicy.dispatch.background.Background`
worker with pad-up and switch-in. The runner itself places a batch's tokens into a
graph's rows and back, checks its inputs, and records each build's memory.

Serves prefill of causal layouts without cached context; given a
:class:`~attnpolicy.engine.kv_cache.KVCache` and each sequence's slot in it, any causal
step (prefill whose KV is kept, chunked prefill, decode, mixed) through a step graph
(a key with ``kv``), each slot's KV read and extended: one path, a prefill being a step
with no context. A layout with cached context but no cache, a slot that does not hold
a sequence's context, and a real row's token id outside the vocabulary (the input
embedding's rows) raise :class:`~attnpolicy.errors.LayoutError` before any work.

Memory per graph is measured around its build (compile and first run): the RSS
delta of the process, and on a device whose allocator reports its bytes (CUDA, XPU …,
:mod:`~attnpolicy.graphs.device_memory`) that allocator's delta, beside
the static-shape estimate the cache is bounded by
(:func:`~attnpolicy.engine.keys.estimate_bytes`).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch

from attnpolicy.cache.disk_store import DiskStore
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, check_legal
from attnpolicy.dispatch.background import Background
from attnpolicy.dispatch.graph_source import GraphSource
from attnpolicy.dispatch.stats import BackgroundStats, Counters, RuntimeStats
from attnpolicy.engine.graph_family import STATIC_ATTENTION, Inputs, ModelFamily, register
from attnpolicy.engine.keys import (
    GraphSet,
    ModelKey,
    Part,
    contexts,
    filling,
    model_key_for,
    segment,
    step_keys,
    step_parts,
    why_illegal_step,
    why_not_held,
)
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.errors import ConfigError, IllegalModeError, LayoutError
from attnpolicy.graphs import backend_setup, device_memory
from attnpolicy.graphs.compile import CompiledGraph, device_bytes
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.masks import mask_for
from attnpolicy.plugins.compilers import resolve_compiler
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard


@dataclass(frozen=True, slots=True)
class GraphMemory:
    """What one build of a graph held: the static-shape estimate, the process RSS delta
    (CPU) and the device allocator's delta (``None`` on a device that reports none, as the
    CPU), in bytes; its compile seconds."""

    key: str
    estimate_bytes: int
    rss_bytes: int
    device_bytes: int | None
    compile_seconds: float


@dataclass(frozen=True, slots=True)
class RunnerStats(RuntimeStats):
    """A snapshot of a :class:`StaticModelRunner`: :class:`RuntimeStats` (the modes
    decided), each build's memory and (``compile_mode="background"``) the background
    compiles."""

    memory: tuple[GraphMemory, ...]
    background: BackgroundStats | None = None
    #: (``compile_mode="background"``) batches run on the eager forward while their graph
    #: compiled, no resident graph able to serve them padded up
    eager_served: int = 0
    #: (``compile_mode="background"``) seconds batches waited for the worker at switch points
    stall_seconds: float = 0.0
    #: forwards run (warm-up's not) on their own graph, resident when they ran, and the others
    #: (their graph built now, or under ``compile_mode="background"`` padded up or run eagerly while
    #: it compiles): one count per forward (a batch's one; a ROWS step's one per phase), where
    #: ``cache`` counts lookups (a pad-up's and a switch-in's)
    forward_hits: int = 0
    forward_misses: int = 0


@dataclass(frozen=True, slots=True)
class Placed:
    """A batch placed in its graph: the key, the graph row and the layout row of each
    real token (in the layout's order), a step's graph rows of each sequence (in the
    layout's order, for its slot; a prefill: none), and the graph's inputs."""

    key: ModelKey
    rows: torch.Tensor
    src: torch.Tensor
    seq_rows: tuple[torch.Tensor, ...]
    inputs: Inputs

    def scatter(self, out: torch.Tensor, q_tokens: int) -> torch.Tensor:
        """The graph's logits ``out`` back in the layout's ``q_tokens`` rows (padding zero)."""
        logits = out.new_zeros(q_tokens, out.shape[-1])
        logits[self.src] = out[self.rows]
        return logits


def _segment_order(layout: BatchLayout, key: ModelKey, config: AttnPolicyConfig) -> list[int]:
    """The sequence of ``layout`` each VARLEN segment of ``key`` holds, in the key's order:
    each segment in turn the first sequence left that fits it, largest buckets first (a
    key of the sequences' own buckets: that order; a key off ``config``'s buckets, as a
    graph set's filling lays it out: sequence ``i`` in segment ``i``). A layout the
    segments cannot hold raises :class:`~attnpolicy.errors.LayoutError`."""
    ctx = contexts(layout)
    left = sorted(range(layout.num_seqs), key=lambda i: segment(layout.q_lens[i], ctx[i], config), reverse=True)
    order: list[int] = []
    for rows, context in key.segments[:layout.num_seqs]:
        i = next((i for i in left if layout.q_lens[i] <= rows and ctx[i] <= context), None)
        if i is None:
            break
        left.remove(i)
        order.append(i)
    if left:
        raise LayoutError(f"{layout.describe()} does not fit the segments of {key}")
    return order


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StaticModelRunner:
    """Serves packed batches through whole-model graphs, one per :class:`ModelKey`.

    ``model`` is an HF causal LM (its attention implementation is switched to
    :data:`STATIC_ATTENTION`; the weights are not copied). ``config`` gives the policy (and its
    guard), the buckets (``max_seq_len`` bounds a sequence's bucket,
    ``max_batch_tokens`` a MASK graph's), the backend, the cache's bounds and
    eviction, ``strict`` and ``compile_mode`` (``"background"``: a miss runs padded up
    to a larger resident graph or eagerly while its graph compiles in a worker, see
    :mod:`~attnpolicy.dispatch.background`). ``compile_counter(gm)`` sees
    every backend compile.

    ``logits(token_ids, layout)`` returns ``[layout.q_tokens, vocab]`` (padding rows
    zero); ``run`` does the same in a given mode; ``prepare`` and ``graph_for`` are its
    two halves (key and inputs, then the cached graph). Threads may share a runner: its
    decisions, counters and (``compile_mode="background"``) pending compiles are kept under
    one lock, held while a batch's graph is chosen (and a due background compile is waited
    for), never while a graph compiles synchronously or runs. The policy decides in a context
    holding the config and the attention tensor spec; it sees no graph keys (no model-level
    cost model is given to it).
    """

    def __init__(self, model: torch.nn.Module, config: AttnPolicyConfig | None = None, *,
                 compile_counter: Callable[[torch.fx.GraphModule], None] | None = None) -> None:
        self.config = cfg = config or AttnPolicyConfig()
        resolve_compiler(cfg.backend)  # an unknown backend: ConfigError, before any work
        if not hasattr(model, "config") or not hasattr(model.config, "num_attention_heads"):
            raise ConfigError(f"model must be an HF transformers model with a config, got {type(model).__name__}")
        register()
        c: Any = model.config
        c._attn_implementation = STATIC_ATTENTION
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.spec = TensorSpec(str(self.dtype).removeprefix("torch."), c.num_attention_heads,
                               c.num_key_value_heads, head_dim, device=str(self.device))
        self.guard = Guard.for_policy(cfg.policy, cfg.policy_options, on_illegal=cfg.on_illegal,
                                      fallback=MaskMode(cfg.fallback_mode))
        self._context = PolicyContext(config=cfg, spec=self.spec)
        #: token ids index the input embedding: each real row's id must be below its size
        hf: Any = model
        self._vocab: int = hf.get_input_embeddings().num_embeddings
        #: with ``store_dir``: every graph persists there, keyed by the model's code and
        #: config (``code_hash``); a miss loads it
        self.family = family = ModelFamily(self.model, cfg, compile_counter=compile_counter)
        self.cache: GraphCache[CompiledGraph] = GraphCache.from_config(
            cfg, sizeof=family.estimate_bytes, release=family.release,
            measure=lambda k, g: device_bytes(g) if isinstance(g, CompiledGraph) else None)
        self.counters = Counters()  # strict mode's and the background's
        self.source: GraphSource[ModelKey, Inputs] = GraphSource(self.cache, self.counters, family,
                                                                 builder=self._measured)
        self._memory: list[GraphMemory] = []
        self._modes: Counter[str] = Counter()
        self._batches = 0
        self._forward_hits = self._forward_misses = 0
        self._lock = threading.RLock()  # the policy, the counters, the background's pending compiles
        self._background: Background[ModelKey, Inputs] | None = (
            Background(self.source, thread_name="attnpolicy-model-compile")
            if cfg.compile_mode == "background" else None)

    @property
    def store(self) -> DiskStore | None:
        """The graph store (``store_dir``), else ``None``."""
        return self.family.store

    # -- serving -------------------------------------------------------------------
    def decide(self, layout: BatchLayout) -> Decision:
        """The guarded policy's decision for ``layout`` (a real decision: counted)."""
        return self.guard.decide(layout, self._context)

    def logits(self, token_ids: torch.Tensor, layout: BatchLayout, *, kv: KVCache | None = None,
               slots: Sequence[int] | None = None) -> torch.Tensor:
        """The logits of every row of ``layout`` (``token_ids[layout.q_tokens]`` of any
        integer dtype and stride, on the model's device or the CPU), run as the policy
        decides, through the graph of its key. With ``kv`` and ``slots`` (sequence ``i``'s
        slot in ``kv``, holding its cached context) the step runs on the step graphs and
        each slot gains the step's KV rows."""
        self._check(token_ids, layout, kv, slots)
        with self._lock:
            decision = self.decide(layout)
            self._modes[decision.mode.value] += 1
            self._batches += 1
        return self._run(token_ids, layout, step_parts(layout, decision.mode, self.config, kv=kv is not None), kv,
                         slots, background=self._background is not None, counted=True)

    def run(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode, *, kv: KVCache | None = None,
            slots: Sequence[int] | None = None) -> torch.Tensor:
        """As :meth:`logits` in a given ``mode`` (no policy; the mode must be legal)."""
        self._check(token_ids, layout, kv, slots)
        return self._run(token_ids, layout, step_parts(layout, mode, self.config, kv=kv is not None), kv, slots,
                         background=self._background is not None, counted=True)

    def serve(self, token_ids: torch.Tensor, layout: BatchLayout, graphs: GraphSet, *, kv: KVCache,
              slots: Sequence[int]) -> torch.Tensor:
        """As :meth:`logits` for a step (``kv`` and ``slots``) served from a runtime's
        graph set (no policy): each of ``graphs.parts(layout)`` runs on its graph, a key
        outside the cache compiled (after :meth:`warmup_keys`: a strict-mode violation).
        Counted per forward, by its graph's mode."""
        self._check(token_ids, layout, kv, slots)
        parts = graphs.parts(layout)
        ends = [0, *(end for _, end, _ in parts)]
        if [first for first, _, _ in parts] != ends[:-1] or ends[-1] != layout.num_seqs:
            raise LayoutError(f"graph set {graphs.name!r} gave parts {[p[:2] for p in parts]}, not the "
                              f"{layout.num_seqs} sequences of ({layout.describe()}) in order, each once")
        out = self._run(token_ids, layout, parts, kv, slots, background=self._background is not None, counted=True)
        with self._lock:
            self._modes.update(key.mode.value for _, _, key in parts)
            self._batches += 1
        return out

    def _count(self, hit: bool) -> None:
        """One forward run on its own resident graph (``hit``), or not."""
        with self._lock:
            if hit:
                self._forward_hits += 1
            else:
                self._forward_misses += 1

    def _run(self, token_ids: torch.Tensor, layout: BatchLayout, parts: Sequence[Part], kv: KVCache | None,
             slots: Sequence[int] | None, *, background: bool, counted: bool = False) -> torch.Tensor:
        """Run checked inputs (:meth:`_check`) as ``parts``: one forward per part (a ROWS
        step's decodes apart from its prefills, a graph set's runtime form), each on the
        graph of its key (``counted``: each forward's hit or miss). Every part is placed
        and its graph fetched before any runs, so a step one of whose graphs cannot be had
        (strict mode raising, a failed build) changes no slot of ``kv``."""
        def pinned(staged: Sequence[tuple[Any, ...]]) -> list[ModelKey]:  # cached graphs; else eager forwards
            return [batch.key for *_, batch, graph in staged if isinstance(graph, CompiledGraph)]

        fetched: list[tuple[int, BatchLayout, Sequence[int] | None, Placed, Callable[..., Any]]] = []
        try:
            for first, end, key in parts:
                part, q0, own = layout.sequences(first, end), layout.q_starts[first], slots and slots[first:end]
                fetched.append((q0, part, own, *self._fetch(token_ids[q0:q0 + part.q_tokens], part, key, kv, own,
                                                            background=background, counted=counted)))
        except BaseException:
            self.cache.unpin(pinned(fetched))
            raise
        logits: torch.Tensor | None = None
        try:
            for q0, part, own, batch, graph in fetched:
                with torch.no_grad():
                    out = graph(*batch.inputs)
                if batch.key.kv:  # a step: its KV rows into its slots
                    assert kv is not None and own is not None
                    out, new_k, new_v = out
                    kv.append(own, batch.seq_rows, new_k, new_v)
                rows = batch.scatter(out, part.q_tokens)
                if logits is None:
                    logits = rows.new_zeros(layout.q_tokens, rows.shape[-1])
                logits[q0:q0 + part.q_tokens] = rows
        finally:
            self.cache.unpin(pinned(fetched))
        assert logits is not None
        return logits

    def _fetch(self, token_ids: torch.Tensor, layout: BatchLayout, key: ModelKey, kv: KVCache | None,
               slots: Sequence[int] | None, *, background: bool, counted: bool
               ) -> tuple[Placed, Callable[..., Any]]:
        """One forward placed in the graph of ``key`` (or of the larger key it is padded up
        to) and that graph: cached and pinned, or the eager forward while it compiles."""
        batch = self._legal_place(token_ids, layout, key, kv, slots)
        bg = self._background
        graph: Callable[..., Any]
        if bg is not None and background:
            with self._lock:
                bg.next_batch()
                hit = batch.key in self.cache
                served = bg.route(batch.key, batch.inputs)
                if served is None:
                    graph = self.family.eager(batch.key, batch.inputs)
                else:
                    if served != batch.key:  # padded up
                        batch = self._place(token_ids, layout, served, kv, slots)
                    graph = self.graph_for(batch, pin=True)
        else:
            hit = self.cache.has_graph(batch.key)
            graph = self.graph_for(batch, pin=True)
        if counted:
            self._count(hit)
        return batch, graph

    def prepare(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode, *, kv: KVCache | None = None,
                slots: Sequence[int] | None = None) -> Placed:
        """``layout``'s tokens placed in the graph of ``mode`` (with ``kv`` and ``slots``
        as :meth:`logits`: a step's, its slots' context gathered): its key and inputs
        (inputs checked, ``mode`` legal for ``layout``; nothing compiled)."""
        self._check(token_ids, layout, kv, slots)
        return self._legal_place(token_ids, layout, model_key_for(layout, mode, self.config, kv=kv is not None),
                                 kv, slots)

    def _legal_place(self, token_ids: torch.Tensor, layout: BatchLayout, key: ModelKey, kv: KVCache | None,
                     slots: Sequence[int] | None) -> Placed:
        """Checked inputs placed in the graph of ``key`` as :meth:`_place` places them,
        once its mode is legal for ``layout``."""
        if kv is None:
            check_legal(key.mode, layout)
        elif (why := why_illegal_step(key.mode, layout)) is not None:
            raise IllegalModeError(f"mode={key.mode.value} is illegal for step ({layout.describe()}): {why}")
        if (why := why_not_held(key, layout)) is not None:
            raise LayoutError(f"graph {key} cannot hold ({layout.describe()}): {why}")
        return self._place(token_ids, layout, key, kv, slots)

    def graph_for(self, batch: Placed, *, pin: bool = False) -> CompiledGraph:
        """The compiled graph of ``batch.key`` from the cache, compiled on a miss
        (``strict`` applies after :meth:`warmup`); ``pin`` as ``GraphCache.get_or_compile``."""
        graph: CompiledGraph = self.source.get(batch.key, batch.inputs, pin=pin)
        return graph

    def keys_for(self, layout: BatchLayout, mode: MaskMode, *, kv: bool = False) -> tuple[ModelKey, ...]:
        """The graph keys ``layout``'s forwards run under in ``mode``, in order (one, but a
        ROWS step's one per phase; ``kv``: a step's, run with a KV cache;
        :func:`~attnpolicy.engine.keys.step_keys`)."""
        return step_keys(layout, mode, self.config, kv=kv)

    def _check(self, token_ids: torch.Tensor, layout: BatchLayout, kv: KVCache | None = None,
               slots: Sequence[int] | None = None) -> None:
        if not isinstance(layout, BatchLayout):
            raise LayoutError(f"layout must be a BatchLayout, got {type(layout).__name__}")
        if (not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.is_floating_point()
                or token_ids.is_complex() or token_ids.dtype is torch.bool):
            what = f"{token_ids.dtype} {tuple(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) \
                else type(token_ids).__name__
            raise LayoutError(f"token_ids must be a 1-D tensor of an integer dtype, got {what}")
        if token_ids.device != self.device and token_ids.device.type != "cpu":
            raise LayoutError(f"token_ids are on {token_ids.device}: give them on the model's device "
                              f"({self.device}) or the CPU")
        if token_ids.shape[0] != layout.q_tokens:
            raise LayoutError(f"token_ids has {token_ids.shape[0]} rows, the layout {layout.q_tokens} "
                              f"({layout.describe()})")
        if not layout.causal:
            raise LayoutError(f"layout.causal=False: the runner serves causal LMs ({layout.describe()})")
        if (kv is None) != (slots is None):
            raise LayoutError(f"kv and slots go together: got kv={type(kv).__name__}, slots={slots!r}")
        if kv is None and layout.has_context:
            raise LayoutError(f"a layout with cached context needs kv and slots (its KV), got kv_lens "
                              f"{list(layout.kv_lens)} for q_lens {list(layout.q_lens)}")
        if kv is not None and slots is not None:
            if not isinstance(kv, KVCache):
                raise LayoutError(f"kv must be a KVCache, got {type(kv).__name__}")
            kv.check(list(slots), contexts(layout), layout.q_lens)
        real = torch.zeros(layout.q_tokens, dtype=torch.bool, device=token_ids.device)
        for s, n in zip(layout.q_starts, layout.q_lens):
            real[s:s + n] = True
        bad = (real & ((token_ids < 0) | (token_ids >= self._vocab))).nonzero().flatten().tolist()
        if bad:
            shown = ", ".join(f"{int(token_ids[i])} at row {i}" for i in bad[:4])
            more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
            raise LayoutError(f"token_ids outside the vocabulary [0, {self._vocab}): {shown}{more}")

    def _place(self, token_ids: torch.Tensor, layout: BatchLayout, key: ModelKey, kv: KVCache | None,
               slots: Sequence[int] | None) -> Placed:
        """``layout`` placed in the graph of ``key`` (its own key, or one as large in every
        dimension: padded up), a step's slots' context gathered into the past inputs. The
        inputs are built here in the form every graph is compiled for, whatever the form
        of ``token_ids``: int64, contiguous, on the model's device."""
        mode = key.mode
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        ctx = contexts(layout)
        # VARLEN: each sequence in its own segment of the key; else in the layout's order
        order = _segment_order(layout, key, self.config) if mode is MaskMode.VARLEN else range(layout.num_seqs)
        row_at, col_at, row, col = [0] * layout.num_seqs, [0] * layout.num_seqs, 0, 0
        for slot_i, i in enumerate(order):
            row_at[i], col_at[i] = row, col
            if mode in (MaskMode.VARLEN, MaskMode.ROWS):  # its own span (ROWS: its row)
                row, col = row + key.segments[slot_i][0], col + key.segments[slot_i][1]
            else:
                row, col = row + layout.q_lens[i], col + ctx[i]
        t, c = key.tokens, key.context
        positions = torch.zeros(t, dtype=torch.long)
        src, rows = [], []
        mask = torch.zeros(t, c + t, dtype=torch.bool) if mode is MaskMode.MASK and key.kv else None
        valid = torch.zeros(c, dtype=torch.bool) if mode is MaskMode.VARLEN and key.kv else None
        for i in range(layout.num_seqs):
            s, n, r0, c0, ci = layout.q_starts[i], layout.q_lens[i], row_at[i], col_at[i], ctx[i]
            src.append(torch.arange(s, s + n))
            rows.append(torch.arange(r0, r0 + n))
            positions[r0:r0 + n] = torch.arange(ci, ci + n)
            if mask is not None:
                mask[r0:r0 + n, c0:c0 + ci] = True
                mask[r0:r0 + n, c + r0:c + r0 + n] = torch.ones(n, n, dtype=torch.bool).tril()
            if valid is not None:
                valid[c0:c0 + ci] = True
        if mask is not None:  # a padding row sees itself: no row of the graph is all masked
            real = torch.zeros(t, dtype=torch.bool)
            real[torch.cat(rows)] = True
            pad = (~real).nonzero().flatten()
            mask[pad, c + pad] = True
        src_t, rows_t = torch.cat(src).to(self.device), torch.cat(rows).to(self.device)
        ids = torch.zeros(t, dtype=torch.long, device=self.device)
        ids[rows_t] = token_ids[src_t]
        inputs: Inputs = (ids, positions.to(self.device))
        if not key.kv:
            if mode is MaskMode.MASK:  # the packed sequences' block-diagonal causal mask
                packed = BatchLayout.from_lens(list(layout.q_lens), causal=True)
                inputs += (mask_for(packed).materialize(t, t).to(self.device)[None, None],)
            return Placed(key, rows_t, src_t, (), inputs)
        assert kv is not None and slots is not None  # a step's (checked)
        inputs += kv.gather(slots, col_at, c)
        if mask is not None or valid is not None:
            inputs += ((mask if mask is not None else valid).to(self.device),)  # type: ignore[union-attr]
        if mode is MaskMode.ROWS and c:  # each row's context length, padding rows none
            lengths = torch.zeros(key.rows, dtype=torch.long)
            lengths[:layout.num_seqs] = torch.tensor(ctx)
            inputs += (lengths.to(self.device),)
        return Placed(key, rows_t, src_t, tuple(r.to(self.device) for r in rows), inputs)

    # -- graphs --------------------------------------------------------------------
    def _measured(self, key: ModelKey, inputs: Inputs) -> CompiledGraph:
        """The family's build of ``key``, its memory recorded (also in the background worker)."""
        rss, before = _rss(), device_memory.allocated(self.device)
        t0 = perf_counter()
        graph = self.family.build(key, inputs)
        after = device_memory.allocated(self.device)
        self._memory.append(GraphMemory(
            str(key), self.family.estimate_bytes(key), _rss() - rss,
            None if after is None or before is None else after - before, perf_counter() - t0))
        return graph

    def warmup(self, layouts: Iterable[tuple[BatchLayout, MaskMode]]) -> list[ModelKey]:
        """Compile (or load from the store) the graph of each ``(layout, mode)`` not
        cached yet (a layout with cached context: its step graph, the context zeros in a
        scratch cache; counted as misses, as requests would be; compiled now in every
        ``compile_mode``), the backend's per-process set-up started ahead (see
        :mod:`~attnpolicy.graphs.backend_setup`); afterwards ``strict`` applies to compiles."""
        return self._warm((layout, step_parts(layout, mode, self.config, kv=layout.has_context), layout.has_context)
                          for layout, mode in layouts)

    def warmup_keys(self, keys: Iterable[ModelKey]) -> list[ModelKey]:
        """As :meth:`warmup` for given keys (a graph set's), each run on the layout that
        fills it (:func:`~attnpolicy.engine.keys.filling`)."""
        return self._warm((layout, ((0, layout.num_seqs, key),), key.kv)
                          for key in keys for layout in (filling(key),))

    def _warm(self, items: Iterable[tuple[BatchLayout, tuple[Part, ...], bool]]) -> list[ModelKey]:
        """Each ``(layout, parts, kv)`` run once on zeros (``kv``: over a scratch cache
        holding its context), then strict mode on (a later warm-up's compiles are none of
        its violations)."""
        keys: list[ModelKey] = []
        warm, self.source.warm = self.source.warm, False  # a warm-up's own compiles are no violations
        setup = backend_setup.start(self.config.backend, str(self.device))
        try:
            for layout, parts, step in items:
                ids = torch.zeros(layout.q_tokens, dtype=torch.long)
                kv = KVCache.holding(self.model, contexts(layout), max(layout.kv_lens)) if step else None
                slots = None if kv is None else range(layout.num_seqs)
                self._check(ids, layout, kv, slots)
                self._run(ids, layout, parts, kv, slots, background=False)
                keys += [key for _, _, key in parts]
        except BaseException:
            self.source.warm = warm
            raise
        finally:
            setup.join()  # its seconds are the warm-up's
        self.source.warm = True
        return keys

    def stats(self) -> RunnerStats:
        with self._lock:
            bg, c = self._background, self.counters
            return RunnerStats(batches=self._batches, modes=dict(self._modes), guard_fallbacks=self.guard.fallbacks,
                               strict_violations=c.strict_violations, loaded_after_warmup=c.loaded_after_warmup,
                               cache=self.cache.stats(), disk=None if self.store is None else self.store.stats(),
                               memory=tuple(self._memory), background=None if bg is None else bg.stats(),
                               eager_served=c.background_eager,
                               stall_seconds=0.0 if bg is None else bg.waited,
                               forward_hits=self._forward_hits, forward_misses=self._forward_misses)

    def close(self) -> None:
        """Stop the background worker and drop every graph (released)."""
        if self._background is not None:
            self._background.close()
        self.cache.clear()


def eager_logits(model: torch.nn.Module, token_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """The reference: each sequence of ``layout`` run alone through ``model`` eagerly
    (its own attention implementation), as ``[layout.q_tokens, vocab]``, padding rows zero."""
    rows = []
    with torch.no_grad():
        for s, n in zip(layout.q_starts, layout.q_lens):
            out = model(input_ids=token_ids[None, s:s + n], use_cache=False).logits[0]
            rows.append((s, out))
    logits = rows[0][1].new_zeros(layout.q_tokens, rows[0][1].shape[-1])
    for s, out in rows:
        logits[s:s + out.shape[0]] = out
    return logits
