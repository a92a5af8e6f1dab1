"""StaticModelRunner: a whole HF causal LM forward as one compiled graph per key.

Static-graph runtimes (tt-xla, RBLN, Neuron, TPU) compile the whole forward per
padded shape with the mask mode baked in. The runner does the same on torch: it
serves packed batches the way vLLM flattens them (token ids ``[T]`` plus a
:class:`~attnpolicy.core.layout.BatchLayout`), the guarded policy decides the mode,
and the forward runs as one ``torch.compile(dynamic=False, fullgraph=True)`` graph
per :class:`ModelKey`, held in a :class:`~attnpolicy.cache.graph_cache.GraphCache`
(bounded, evicting, exact statistics; an evicted graph's code is released).

What each mode's graph is (real rows packed back to back, layout padding dropped):

- ``CAUSAL``: one sequence padded at its end to its token bucket; no mask input,
  attention is SDPA with ``is_causal`` (trailing padding cannot reach a real row).
- ``MASK``: every sequence packed, padded to the bucket of the total; the dense
  block-diagonal mask ``[1, 1, B, B]`` is a graph input, so one graph serves every
  layout of that bucket.
- ``VARLEN``: each sequence padded to its own bucket, in a segment of its own;
  inside the one graph every segment runs its own causal SDPA call (no mask). The
  key is the tuple of per-sequence buckets, sorted largest first (sequences are
  reordered into it), so permutations of one batch share a graph. VARLEN graphs
  need no mask and compute no cross-sequence scores, at the price of one graph per
  combination of buckets.

Inside a graph attention is a plain kernel call (:func:`attnpolicy.kernels.attention.bind`,
``sdpa``) on the graph's inputs; the Python dispatcher is not involved. The model's
attention implementation is set to :data:`NAME`, registered with transformers'
``AttentionInterface`` (no mask function: HF builds no mask, the runner's 4-D mask
arrives as-is). Serves prefill of causal layouts without cached context; other
layouts, and a real row's token id outside the vocabulary (the input embedding's
rows), raise :class:`~attnpolicy.errors.LayoutError` before any work.

Memory per graph is measured around its build (compile and first run): the RSS
delta of the process, and on CUDA the ``torch.cuda.memory_allocated`` delta, beside
the static-shape estimate the cache is bounded by (:func:`estimate_bytes`).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import partial
from time import perf_counter
from typing import Any

import torch

from attnpolicy.cache.code_identity import graph_code, module_code
from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore, StoreStats, source_hash
from attnpolicy.cache.graph_cache import CacheStats, GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, check_legal
from attnpolicy.dispatch.graph_source import after_warm_up, warn_loaded
from attnpolicy.engine.model_background import ModelBackground, ModelBackgroundStats
from attnpolicy.errors import ConfigError, LayoutError, StrictModeError
from attnpolicy.graphs import aot, backend_setup
from attnpolicy.graphs.compile import CompiledGraph, compile_graph, compile_lock, release_graph
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.attention import bind
from attnpolicy.kernels.masks import mask_for
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard

#: The attention implementation name the runner gives the model.
NAME = "attnpolicy-static"
#: The keyword argument that carries a VARLEN graph's segments to the attention calls.
SEGMENTS_KWARG = "attnpolicy_segments"


@dataclass(frozen=True, slots=True)
class ModelKey:
    """One whole-model graph: its mode, padded rows and (VARLEN) per-sequence segments."""

    mode: MaskMode
    tokens: int
    segments: tuple[int, ...]
    backend: str

    def __str__(self) -> str:
        shape = "+".join(map(str, self.segments)) if self.mode is MaskMode.VARLEN else str(self.tokens)
        return f"model/{self.mode.value}/t{shape}/{self.backend}"


@dataclass(frozen=True, slots=True)
class GraphMemory:
    """What one build of a graph held: the static-shape estimate, the process RSS delta
    (CPU) and the CUDA allocator delta (``None`` off CUDA), in bytes; its compile seconds."""

    key: str
    estimate_bytes: int
    rss_bytes: int
    cuda_bytes: int | None
    compile_seconds: float


@dataclass(frozen=True, slots=True)
class RunnerStats:
    """A snapshot of a :class:`StaticModelRunner`: batches, modes decided, guard
    fallbacks, strict-mode violations, the graph cache, each build's memory and
    (``compile_mode="background"``) the background compiles."""

    batches: int
    modes: dict[str, int]
    guard_fallbacks: int
    strict_violations: int
    cache: CacheStats
    memory: tuple[GraphMemory, ...]
    disk: StoreStats | None = None  # the graph store's, with ``store_dir``
    background: ModelBackgroundStats | None = None
    #: graphs loaded from the store after warm-up (no compile: no strict violation),
    #: counted under strict "warn" and "raise"
    loaded_after_warmup: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Placed:
    """A batch placed in its graph: the key, the graph row and the layout row of each
    real token (in the layout's order), and the graph's inputs (ids, positions and,
    for MASK, the mask)."""

    key: ModelKey
    rows: torch.Tensor
    src: torch.Tensor
    inputs: tuple[torch.Tensor, ...]

    def scatter(self, out: torch.Tensor, q_tokens: int) -> torch.Tensor:
        """The graph's output ``out`` back in the layout's ``q_tokens`` rows (padding zero)."""
        logits = out.new_zeros(q_tokens, out.shape[-1])
        logits[self.src] = out[self.rows]
        return logits


def static_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function of the runner's graphs (batch 1):
    ``attention_mask`` ``[1, 1, T, T]`` (True = attend) or ``None`` (causal); with
    ``attnpolicy_segments`` one causal call per segment of rows."""
    run = bind("sdpa", scale=scaling)  # traced once per graph: no memo for Dynamo to guard on
    q, k, v = query[0], key[0], value[0]
    segments: tuple[int, ...] | None = kwargs.get(SEGMENTS_KWARG)
    if attention_mask is not None:
        out = run(q, k, v, False, attention_mask[0, 0])
    elif segments is None:
        out = run(q, k, v, True, None)
    else:
        parts, start = [], 0
        for n in segments:
            parts.append(run(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n], True, None))
            start += n
        out = torch.cat(parts, dim=1)
    return out.transpose(0, 1)[None], None


def register() -> None:
    """Register :func:`static_attention` with transformers as :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, static_attention)


def model_key_for(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig) -> ModelKey:
    """The whole-model graph key ``layout`` runs under in ``mode`` with ``config``'s
    buckets and backend (pure: no model needed; the runner and the simulator share it)."""
    if mode is MaskMode.VARLEN:
        segments = tuple(sorted((config.bucket(n) for n in layout.q_lens), reverse=True))
        return ModelKey(mode, sum(segments), segments, config.backend)
    real = sum(layout.q_lens)
    tokens = config.bucket(real) if mode is MaskMode.CAUSAL else config.batch_bucket(real)
    return ModelKey(mode, tokens, (tokens,), config.backend)


def estimate_bytes(key: ModelKey, model_config: Any, itemsize: int = 4) -> int:
    """A static-shape estimate of what one graph holds while it runs: its inputs (ids,
    positions, a MASK graph's boolean mask), its logits, and one layer's activations
    (hidden states, q/k/v, MLP)."""
    c, t = model_config, key.tokens
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    inputs = 16 * t + (t * t if key.mode is MaskMode.MASK else 0)
    layer = t * (2 * c.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * c.intermediate_size)
    return inputs + itemsize * (t * c.vocab_size + layer)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StaticModelRunner:
    """Serves packed batches through whole-model graphs, one per :class:`ModelKey`.

    ``model`` is an HF causal LM (its attention implementation is switched to
    :data:`NAME`; the weights are not copied). ``config`` gives the policy (and its
    guard), the buckets (``max_seq_len`` bounds a sequence's bucket,
    ``max_batch_tokens`` a MASK graph's), the backend, the cache's bounds and
    eviction, ``strict`` and ``compile_mode`` (``"background"``: a miss runs padded up
    to a larger resident graph or eagerly while its graph compiles in a worker, see
    :mod:`~attnpolicy.engine.model_background`). ``compile_counter(gm)`` sees
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
        if not hasattr(model, "config") or not hasattr(model.config, "num_attention_heads"):
            raise ConfigError(f"model must be an HF transformers model with a config, got {type(model).__name__}")
        register()
        c: Any = model.config
        c._attn_implementation = NAME
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.spec = TensorSpec(str(self.dtype).removeprefix("torch."), c.num_attention_heads,
                               c.num_key_value_heads, head_dim, device=str(self.device))
        self.guard = Guard.for_policy(cfg.policy, cfg.policy_options, on_illegal=cfg.on_illegal,
                                      fallback=MaskMode(cfg.fallback_mode))
        self._context = PolicyContext(config=cfg, spec=self.spec)
        self._itemsize = itemsize = param.element_size()
        #: token ids index the input embedding: each real row's id must be below its size
        hf: Any = model
        self._vocab: int = hf.get_input_embeddings().num_embeddings
        self.cache: GraphCache[CompiledGraph] = GraphCache.from_config(
            cfg, sizeof=lambda key: estimate_bytes(key, c, itemsize),
            release=lambda key, graph: release_graph(graph))
        self._counter = compile_counter
        self._memory: list[GraphMemory] = []
        self._modes: Counter[str] = Counter()
        self._batches = self._strict_violations = self._loaded_after_warmup = 0
        self._lock = threading.RLock()  # the policy, the counters, the background's pending compiles
        self.warm = False
        #: with ``store_dir``: every graph persists there, keyed by the model's code and
        #: config (``code_hash``); a miss loads it
        self.store = DiskStore(cfg.store_dir, cfg.max_disk_bytes) if cfg.store_dir is not None else None
        self._code, self._unstored = (model_code(model, c.to_json_string(), self.dtype, self.device)
                                      if self.store is not None else ("", ""))
        self._background: ModelBackground[ModelKey] | None = (
            ModelBackground(self) if cfg.compile_mode == "background" else None)

    # -- serving -------------------------------------------------------------------
    def decide(self, layout: BatchLayout) -> Decision:
        """The guarded policy's decision for ``layout`` (a real decision: counted)."""
        return self.guard.decide(layout, self._context)

    def logits(self, token_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The logits of every row of ``layout`` (``token_ids[layout.q_tokens]`` of any
        integer dtype and stride, on the model's device or the CPU), run as the policy
        decides, through the graph of its key."""
        self._check(token_ids, layout)
        with self._lock:
            decision = self.decide(layout)
            self._modes[decision.mode.value] += 1
            self._batches += 1
        return self.run(token_ids, layout, decision.mode)

    def run(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode) -> torch.Tensor:
        """As :meth:`logits` in a given ``mode`` (no policy; the mode must be legal)."""
        return self._run(token_ids, layout, mode, background=self._background is not None)

    def _run(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode, *,
             background: bool) -> torch.Tensor:
        batch = self.prepare(token_ids, layout, mode)
        bg = self._background
        graph: Callable[..., torch.Tensor]
        if bg is not None and background:
            with self._lock:
                bg.tick()
                if batch.key in self.cache:
                    graph = self.graph_for(batch, pin=True)
                else:
                    batch, graph = bg.serve(batch, lambda key: self._place(token_ids, layout, mode, key))
        else:
            graph = self.graph_for(batch, pin=True)
        pinned = isinstance(graph, CompiledGraph)  # a cached graph (pinned), else the eager forward
        try:
            with torch.no_grad():
                out = graph(*batch.inputs)
        finally:
            if pinned:
                self.cache.unpin([batch.key])
        return batch.scatter(out, layout.q_tokens)

    def prepare(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode) -> Placed:
        """``layout``'s tokens placed in the graph of ``mode``: its key and inputs
        (inputs checked, ``mode`` legal for ``layout``; nothing compiled)."""
        self._check(token_ids, layout)
        check_legal(mode, layout)
        return self._place(token_ids, layout, mode)

    def graph_for(self, batch: Placed, *, pin: bool = False) -> CompiledGraph:
        """The compiled graph of ``batch.key`` from the cache, compiled on a miss
        (``strict`` applies after :meth:`warmup`); ``pin`` as ``GraphCache.get_or_compile``."""
        key = batch.key
        load: Callable[[], CompiledGraph | None] | None = partial(self.load, key) if self._stored(key) else None
        seconds = None
        if self.warm and self.config.strict != "off" and key not in self.cache:
            loaded, seconds = after_warm_up(key, load, self.strict, self.loaded_after_warm_up)
            load = None if loaded is None else lambda: loaded
        return self.cache.get_or_compile(key, lambda: self.build(key, batch.inputs), pin=pin, seconds=seconds,
                                         load=load)

    def key_for(self, layout: BatchLayout, mode: MaskMode) -> ModelKey:
        """The graph key ``layout`` runs under in ``mode`` (:func:`model_key_for`)."""
        return model_key_for(layout, mode, self.config)

    def _check(self, token_ids: torch.Tensor, layout: BatchLayout) -> None:
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
        if layout.has_context:
            raise LayoutError(f"the runner serves prefill without cached context, got kv_lens "
                              f"{list(layout.kv_lens)} for q_lens {list(layout.q_lens)}")
        real = torch.zeros(layout.q_tokens, dtype=torch.bool, device=token_ids.device)
        for s, n in zip(layout.q_starts, layout.q_lens):
            real[s:s + n] = True
        bad = (real & ((token_ids < 0) | (token_ids >= self._vocab))).nonzero().flatten().tolist()
        if bad:
            shown = ", ".join(f"{int(token_ids[i])} at row {i}" for i in bad[:4])
            more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
            raise LayoutError(f"token_ids outside the vocabulary [0, {self._vocab}): {shown}{more}")

    def _place(self, token_ids: torch.Tensor, layout: BatchLayout, mode: MaskMode,
               key: ModelKey | None = None) -> Placed:
        """``layout`` placed in the graph of ``key`` (default: its own key; else one
        that dominates it, as :func:`~attnpolicy.engine.model_background.dominates`).
        The inputs are built here in the form every graph is compiled for, whatever the
        form of ``token_ids``: int64, contiguous, on the model's device."""
        key = key or self.key_for(layout, mode)
        token_ids = token_ids.to(device=self.device, dtype=torch.long)
        order = range(layout.num_seqs)
        if mode is MaskMode.VARLEN:  # largest bucket first, as the key's segments
            order = sorted(order, key=lambda i: -self.config.bucket(layout.q_lens[i]))  # type: ignore[assignment]
        src, rows, positions = [], [], torch.zeros(key.tokens, dtype=torch.long)
        start = 0
        for slot, i in enumerate(order):
            s, n = layout.q_starts[i], layout.q_lens[i]
            src.append(torch.arange(s, s + n))
            rows.append(torch.arange(start, start + n))
            span = key.segments[slot] if mode is MaskMode.VARLEN else n
            positions[start:start + span] = torch.arange(span)
            start += span
        src_t, rows_t = torch.cat(src).to(self.device), torch.cat(rows).to(self.device)
        ids = torch.zeros(key.tokens, dtype=torch.long, device=self.device)
        ids[rows_t] = token_ids[src_t]
        inputs: tuple[torch.Tensor, ...] = (ids, positions.to(self.device))
        if mode is MaskMode.MASK:
            packed = BatchLayout.from_lens(list(layout.q_lens), causal=True)
            mask = mask_for(packed).materialize(key.tokens, key.tokens)
            inputs += (mask.to(self.device)[None, None],)
        return Placed(key, rows_t, src_t, inputs)

    # -- graphs --------------------------------------------------------------------
    def forward(self, key: ModelKey) -> Callable[..., torch.Tensor]:
        """The uncompiled forward of ``key``'s graph (its inputs as :attr:`Placed.inputs`)."""
        model = self.model
        if key.mode is MaskMode.MASK:
            def masked(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                            use_cache=False)
                return out.logits[0]
            return masked
        extra = {SEGMENTS_KWARG: key.segments} if key.mode is MaskMode.VARLEN else {}

        def unmasked(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False, **extra)
            return out.logits[0]
        return unmasked

    def _stored(self, key: ModelKey) -> bool:
        return self.store is not None and key.backend != "none" and self._code is not None

    def holds(self, key: ModelKey) -> bool:
        """Whether the store holds an artifact of ``key`` now (not verified: a load may
        still fail and compile)."""
        return self.store is not None and self._stored(key) and self.store.holds(self._identity(key))

    def _identity(self, key: ModelKey) -> ArtifactIdentity:
        assert self._code is not None  # only stored keys have an identity
        return ArtifactIdentity(f"{type(self.model).__name__}/{key}", aot.MECHANISM, key.backend,
                                str(self.device), str(self.dtype).removeprefix("torch."), self._code)

    def _bound(self, key: ModelKey) -> tuple[Any, ...]:
        """The leading inputs of ``key``'s stored graph: the model, and a VARLEN graph's
        segments (static: baked into the graph, pinned by the key)."""
        return (self.model, key.segments) if key.mode is MaskMode.VARLEN else (self.model,)

    def _aot_graph(self, compiled: Any, key: ModelKey) -> CompiledGraph:
        """A graph compiled ahead of time (or loaded) taking the model first, as the
        cache holds graphs: called directly (it checks no guards)."""
        graph = CompiledGraph(partial(compiled, *self._bound(key)), None, key.backend)
        graph.direct = True
        return graph

    def load(self, key: ModelKey) -> CompiledGraph | None:
        """The graph of ``key`` from the store (``None``: no store, not there or not
        valid); no runner state touched: also runs in the background worker."""
        if self.store is None or not self._stored(key):
            return None
        with compile_lock():  # taken before the store's file lock, as by every load and save
            loaded = self.store.load(self._identity(key), aot.load_graph)
        return None if loaded is None else self._aot_graph(loaded, key)

    def _compiled(self, key: ModelKey, inputs: tuple[torch.Tensor, ...]) -> CompiledGraph:
        """The graph of ``key`` compiled now: ahead of time and saved when it is stored."""
        if self.store is None or not self._stored(key):
            if self.store is not None and key.backend != "none":
                self.store.refuse(f"model {type(self.model).__name__}", self._unstored)
            # no guards, as a stored graph: its key pins what they check, and a check made
            # while the background worker (or any thread) traces fails (see compile_graph)
            return compile_graph(self.forward(key), self.config.backend, counter=self._counter,
                                 example_inputs=inputs, guards=False)
        fn = _FORWARDS[key.mode]
        with torch.no_grad(), compile_lock():
            compiled = aot.aot_compile_graph(fn, key.backend, (*self._bound(key), *inputs))
            self.store.save(self._identity(key), partial(aot.save_graph, compiled), suffix=aot.SUFFIX)
        return self._aot_graph(compiled, key)

    def build(self, key: ModelKey, inputs: tuple[torch.Tensor, ...]) -> CompiledGraph:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        rss, allocated = _rss(), torch.cuda.memory_allocated(self.device) if cuda else 0
        t0 = perf_counter()
        graph = self._compiled(key, inputs)
        if cuda:
            torch.cuda.synchronize(self.device)
        self._memory.append(GraphMemory(
            str(key), estimate_bytes(key, self.model.config, self._itemsize),
            _rss() - rss, torch.cuda.memory_allocated(self.device) - allocated if cuda else None,
            perf_counter() - t0))
        return graph

    def strict(self, key: ModelKey, *, done: bool = False) -> None:
        """A compile after warm-up: counted, then warned or raised (``strict``; ``done``:
        the worker has compiled it already, a stored graph it could not load: warned)."""
        with self._lock:
            self._strict_violations += 1
        message = f"graph {key} compiled after warm-up (strict={self.config.strict!r})"
        if self.config.strict == "raise" and not done:
            raise StrictModeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def loaded_after_warm_up(self, key: ModelKey) -> None:
        """A load from the store after warm-up (no compile: ``strict`` allows it): counted,
        the first one warned about."""
        with self._lock:
            self._loaded_after_warmup += 1
            first = self._loaded_after_warmup == 1
        if first:
            warn_loaded(key, self.config.strict)

    def warmup(self, layouts: Iterable[tuple[BatchLayout, MaskMode]]) -> list[ModelKey]:
        """Compile (or load from the store) the graph of each ``(layout, mode)`` not
        cached yet (counted as misses, as requests would be; compiled now in every
        ``compile_mode``), the backend's per-process set-up started ahead (see
        :mod:`~attnpolicy.graphs.backend_setup`); afterwards ``strict`` applies to compiles."""
        keys = []
        setup = backend_setup.start(self.config.backend, str(self.device))
        try:
            for layout, mode in layouts:
                self._run(torch.zeros(layout.q_tokens, dtype=torch.long), layout, mode, background=False)
                keys.append(self.key_for(layout, mode))
        finally:
            setup.join()  # its seconds are the warm-up's
        self.warm = True
        return keys

    def stats(self) -> RunnerStats:
        with self._lock:
            bg = self._background.stats() if self._background is not None else None
            return RunnerStats(self._batches, dict(self._modes), self.guard.fallbacks, self._strict_violations,
                               self.cache.stats(), tuple(self._memory),
                               None if self.store is None else self.store.stats(), bg, self._loaded_after_warmup)

    def close(self) -> None:
        """Stop the background worker and drop every graph (released)."""
        if self._background is not None:
            self._background.close()
        self.cache.clear()


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


def model_code(model: torch.nn.Module, config: str, dtype: torch.dtype,
               device: torch.device) -> tuple[str | None, str]:
    """``(code_hash, "")`` of ``model``'s stored graphs: attnpolicy's graph code (the
    kernels every attention call binds), this runner, the model's module with the
    modules of its package it reaches and that package's installed version
    (:mod:`~attnpolicy.cache.code_identity`), the model ``config`` (its JSON), dtype and device;
    ``(None, why)`` when the model's code has no source to hash."""
    try:
        return source_hash(graph_code(), sys.modules[__name__], module_code(type(model).__module__),
                           config, str(dtype), str(device)), ""
    except ConfigError as e:
        return None, f"model {type(model).__name__}: {e}"


#: The forward a stored graph of each mode is compiled from (see :meth:`StaticModelRunner._bound`).
_FORWARDS: dict[MaskMode, Callable[..., torch.Tensor]] = {
    MaskMode.CAUSAL: _causal_forward, MaskMode.MASK: _masked_forward, MaskMode.VARLEN: _varlen_forward}


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
