"""What a warm set costs on a workload, in modelled seconds and bytes: the
peers' own sets and a plan's, priced by one rule with one model's step fits.

A static graph of any peer is priced as the step graph this runner compiles for it
(:func:`peer_key`, what ``run --model --graph-set`` runs), by the calibrated fits of
that key's mode (:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel`
``steps``), so a prediction and its measurement share one key:

- a ``prefill`` graph of ``batch`` prompts of ``query_tokens`` over ``context_blocks``
  blocks (vllm-gaudi's, a plan's) is a ROWS graph of ``batch`` rows, each ``query``
  long over ``blocks × block_size`` context; without context blocks (vllm-rbln's) each
  row's context spans ``max_model_len``;
- a ``decode`` graph of ``batch`` sequences over ``context_blocks`` blocks in all
  (vllm-gaudi's flat paged attention: each query reads its own blocks) is a MASK graph
  of ``batch`` rows over ``blocks × block_size`` packed context, each row masked to its
  own; without context blocks (vllm-rbln's) a ROWS graph of ``batch`` rows of one query
  each over ``max_model_len``;
- a ``mixed`` graph (tpu-inference's ragged batch, vLLM's piecewise graphs) pads only
  the step's tokens, its attention reading the real pages at run time: this runner has
  no such graph (its step graphs take a context of static size), so it is priced by
  analogy, as the MASK step fits at its padded rows over the forward's real context
  and cells, and compiles and is held as a MASK graph of its tokens (no context).

Warm-up compiles every graph of the set once, plus the model's first-compile start-up
(``warmup_seconds``; paid by the first run-time compile instead when the set is
empty). Each forward runs on the graph that serves it
(:meth:`~attnpolicy.modelling.peer_buckets.PeerWarmSet.serves`); a forward no graph
serves compiles a graph of its own shape at run time (each distinct shape once, then
reused) and runs there. Warm graph bytes hold the warm
graphs, peak graph bytes every warm graph and every graph compiled at run time
(nothing evicted), each at the runner's static-shape estimate of its key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from math import fsum
from typing import Any

from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey
from attnpolicy.modelling.bucket_schemes import vllm_sizes
from attnpolicy.modelling.peer_buckets import Forward, PeerGraph, PeerLimits, PeerWarmSet
from attnpolicy.modelling.whole_model_costs import ModelCostModel, ModelFit


def peer_key(graph: PeerGraph, limits: PeerLimits, backend: str) -> ModelKey:
    """The step graph this runner compiles for ``graph`` (see the module docstring;
    a ``mixed`` graph's is the MASK graph of its tokens it is priced as, which
    cannot serve its forwards here)."""
    b, q = graph.batch, graph.query_tokens
    span = limits.max_model_len if graph.context_blocks is None else graph.context_blocks * limits.block_size
    if graph.phase == "mixed":
        return ModelKey(MaskMode.MASK, q, 0, ((q, 0),), backend, kv=True)
    if graph.phase == "decode" and graph.context_blocks is not None:
        return ModelKey(MaskMode.MASK, b, span, ((b, span),), backend, kv=True)
    return ModelKey(MaskMode.ROWS, b * q, b * span, ((q, span),) * b, backend, kv=True)


def own_graph(forward: Forward) -> PeerGraph:
    """The graph a peer compiles at run time for a forward none of its graphs serves:
    the forward's own shape."""
    return PeerGraph(forward.phase, forward.batch, forward.query_tokens, forward.context_blocks)


def step_run_fit(model: ModelCostModel, mode: MaskMode) -> ModelFit:
    """``model``'s step graphs' run fit of ``mode`` (a :class:`ConfigError` naming the fix
    when it holds none: ROWS in a file calibrated before it)."""
    return model.fit(ModelKey(mode, 1, 0, ((1, 0),), model.backend, kv=True), "run")


def check_fits(model: ModelCostModel) -> None:
    """Nothing when ``model`` holds the step fits of every mode a peer's graph is priced
    by (ROWS and MASK); else a :class:`ConfigError` naming the mode and the fix."""
    for mode in (MaskMode.ROWS, MaskMode.MASK):
        step_run_fit(model, mode)


class Pricing:
    """One model's step fits applied to the peers' graphs (:func:`peer_key`), each
    graph's price kept."""

    def __init__(self, model: ModelCostModel, limits: PeerLimits) -> None:
        self.model, self.limits = model, limits
        self._graphs: dict[PeerGraph, tuple[float, float, int]] = {}
        check_fits(model)

    def run_fit(self, mode: MaskMode) -> ModelFit:
        """The step graphs' run fit of ``mode`` (:func:`step_run_fit`)."""
        return step_run_fit(self.model, mode)

    def key(self, graph: PeerGraph) -> ModelKey:
        return peer_key(graph, self.limits, self.model.backend)

    def run_seconds(self, graph: PeerGraph, forward: Forward) -> float:
        """``forward`` run on ``graph``: a static graph's key, a ragged graph's padded
        rows over the forward's real context and cells."""
        if graph.phase == "mixed":
            return self.run_fit(MaskMode.MASK).at(graph.query_tokens, forward.context, forward.cells)
        return self._priced(graph)[1]

    def graph(self, graph: PeerGraph) -> tuple[float, int]:
        """``graph``'s compile seconds and bytes."""
        compile_seconds, _, nbytes = self._priced(graph)
        return compile_seconds, nbytes

    def _priced(self, graph: PeerGraph) -> tuple[float, float, int]:
        priced = self._graphs.get(graph)
        if priced is None:
            key = self.key(graph)
            priced = (self.model.compile_seconds(key), self.model.run_seconds(key), self.model.graph_bytes(key))
            self._graphs[graph] = priced
        return priced

    def warmup(self, graphs: Sequence[PeerGraph]) -> tuple[float, int]:
        """A warm-up of ``graphs``: its seconds (each compile, and the first compile's
        start-up unless there is none; summed exactly, so in any order alike) and the
        graphs' bytes."""
        prices = [self.graph(g) for g in graphs]
        start = self.model.warmup_seconds if prices else 0.0
        return fsum([start, *(s for s, _ in prices)]), sum(b for _, b in prices)


@dataclass(frozen=True)
class WarmupCost:
    """One warm set on one workload: its graphs, the warm-up's modelled compile
    seconds, the forwards' run seconds, the graphs compiled at run time (distinct
    shapes no warm graph serves), the forwards they served, their compile seconds,
    padding (rows computed beyond the tokens, per token), peak graph bytes and the
    warm graphs' bytes."""

    scheme: str
    graphs: int
    warmup_seconds: float
    run_seconds: float
    runtime_compiles: int
    unserved: int
    runtime_compile_seconds: float
    tokens: int
    padded_rows: int
    peak_bytes: int
    warm_bytes: int

    @property
    def padding(self) -> float:
        return self.padded_rows / self.tokens if self.tokens else 0.0

    @property
    def total_seconds(self) -> float:
        return self.warmup_seconds + self.runtime_compile_seconds + self.run_seconds

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "graphs": self.graphs, "warmup_seconds": self.warmup_seconds,
                "run_seconds": self.run_seconds, "runtime_compiles": self.runtime_compiles,
                "unserved": self.unserved, "runtime_compile_seconds": self.runtime_compile_seconds,
                "padding": self.padding, "peak_bytes": self.peak_bytes, "warm_bytes": self.warm_bytes,
                "total_seconds": self.total_seconds}


def warmup_cost(label: str, warm: PeerWarmSet, forwards: Counter[Forward], pricing: Pricing) -> WarmupCost:
    """What ``warm`` costs serving ``forwards`` (its peer's forwards of a workload,
    counted), as the row ``label`` (see the module docstring)."""
    compiled: dict[PeerGraph, None] = {}  # compiled at run time, in order
    run = 0.0
    tokens = padded = unserved = 0
    for (f, n), at in zip(forwards.items(), warm.serving([f[:4] for f in forwards]).tolist(), strict=True):
        graph = None if at < 0 else warm.graphs[at]
        if graph is None:
            graph = own_graph(f)
            unserved += n
            compiled[graph] = None
        run += n * pricing.run_seconds(graph, f)
        tokens += n * f.tokens
        padded += n * (f.rows(graph) - f.tokens)
    warm_seconds, warm_bytes = pricing.warmup(warm.graphs)
    late = [pricing.graph(g) for g in compiled]
    start = pricing.model.warmup_seconds if compiled and not warm.graphs else 0.0  # the first compile's start-up
    return WarmupCost(label, len(warm.graphs), warm_seconds, run, len(compiled), unserved,
                      start + sum(s for s, _ in late), tokens, padded, warm_bytes + sum(b for _, b in late), warm_bytes)


def vllm_warmup(limits: PeerLimits) -> PeerWarmSet:
    """vLLM's own piecewise graphs: one ragged graph per default capture size
    (:func:`~attnpolicy.modelling.bucket_schemes.vllm_sizes`, continued in steps of 16
    up to ``max_num_batched_tokens``; vLLM itself runs steps above 512 tokens on one
    dynamically shaped graph)."""
    return PeerWarmSet.of("vllm", (PeerGraph("mixed", limits.max_num_seqs, t)
                                   for t in vllm_sizes(limits.max_num_batched_tokens)))
