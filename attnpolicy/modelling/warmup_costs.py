"""What a warm set costs on a workload, in modelled seconds and bytes: the
peers' own sets and a plan's, priced by one rule with one model's step fits.

A whole-model graph of any peer is priced as this machine's calibrated MASK step
graph (:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` ``steps``)
at three features of its shape: the query ``rows`` it computes, the cached
``context`` columns it holds and the attention score ``cells`` it computes per layer
(:meth:`ModelFit.at <attnpolicy.modelling.whole_model_costs.ModelFit.at>`). So two
sets differ only by their shapes: how many graphs, how much padding.

- A ``prefill`` graph of ``batch`` prompts of ``query_tokens`` over ``context_blocks``
  blocks (vllm-gaudi's, a plan's) holds ``batch × query`` rows over ``batch ×
  blocks × block_size`` context and computes ``batch × query × (blocks × block_size +
  query)`` cells; without context blocks (vllm-rbln's) its context spans
  ``max_model_len``.
- A ``decode`` graph of ``batch`` sequences over ``context_blocks`` blocks in all
  (vllm-gaudi's flat paged attention: each query reads its own blocks) holds ``batch``
  rows over ``blocks × block_size`` context and computes that context plus ``batch``
  cells; without context blocks (vllm-rbln's) each sequence spans ``max_model_len``.
- A ``mixed`` graph (tpu-inference's ragged batch, vLLM's piecewise graphs) pads only
  the step's tokens: its attention reads the real pages at run time, so a forward
  runs at its padded rows but its real context and cells; the graph compiles and is
  held as a prefill of its tokens (no context in its shapes).

Warm-up compiles every graph of the set once, plus the model's first-compile start-up
(``warmup_seconds``; paid by the first run-time compile instead when the set is
empty). Each forward runs on the graph that serves it
(:meth:`~attnpolicy.modelling.peer_buckets.PeerWarmSet.serves`); a forward no graph
serves compiles a graph of its own shape at run time (each distinct shape once, then
reused) and runs there. Warm graph bytes hold the warm
graphs, peak graph bytes every warm graph and every graph compiled at run time
(nothing evicted), each at the runner's static-shape estimate of its MASK step key.
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
from attnpolicy.modelling.whole_model_costs import ModelCostModel


@dataclass(frozen=True)
class Shape:
    """A priced shape: query rows, cached context columns, attention cells per layer."""

    rows: int
    context: int
    cells: int


def graph_shape(graph: PeerGraph, limits: PeerLimits) -> Shape:
    """The static shape ``graph`` compiles and holds (see the module docstring)."""
    b, q = graph.batch, graph.query_tokens
    if graph.phase == "mixed":
        return Shape(q, 0, q * q)
    if graph.phase == "prefill":
        span = limits.max_model_len if graph.context_blocks is None else graph.context_blocks * limits.block_size
        return Shape(b * q, b * span, b * q * (span + q))
    context = (b * limits.max_model_len if graph.context_blocks is None
               else graph.context_blocks * limits.block_size)
    return Shape(b, context, context + b)


def run_shape(graph: PeerGraph, forward: Forward, limits: PeerLimits) -> Shape:
    """The shape ``forward`` runs at on ``graph``: a ragged graph's padded rows over the
    forward's real context and cells, any other graph's static shape."""
    if graph.phase == "mixed":
        return Shape(graph.query_tokens, forward.context, forward.cells)
    return graph_shape(graph, limits)


def own_graph(forward: Forward) -> PeerGraph:
    """The graph a peer compiles at run time for a forward none of its graphs serves:
    the forward's own shape."""
    return PeerGraph(forward.phase, forward.batch, forward.query_tokens, forward.context_blocks)


class Pricing:
    """One model's step fits (MASK) applied to shapes, each graph's price kept."""

    def __init__(self, model: ModelCostModel, limits: PeerLimits) -> None:
        steps = model.step_fits()
        self.model, self.limits = model, limits
        self.compile_fit, self.run_fit = steps.compile["mask"], steps.run["mask"]
        self._graphs: dict[PeerGraph, tuple[float, int]] = {}

    def run_seconds(self, shape: Shape) -> float:
        return self.run_fit.at(shape.rows, shape.context, shape.cells)

    def graph(self, graph: PeerGraph) -> tuple[float, int]:
        """``graph``'s compile seconds and bytes."""
        priced = self._graphs.get(graph)
        if priced is None:
            s = graph_shape(graph, self.limits)
            key = ModelKey(MaskMode.MASK, s.rows, s.context, ((s.rows, s.context),), self.model.backend, kv=True)
            priced = (self.compile_fit.at(s.rows, s.context, s.cells), self.model.graph_bytes(key))
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
    limits = pricing.limits
    compiled: dict[PeerGraph, None] = {}  # compiled at run time, in order
    run = 0.0
    tokens = padded = unserved = 0
    for (f, n), at in zip(forwards.items(), warm.serving([f[:4] for f in forwards]).tolist(), strict=True):
        graph = None if at < 0 else warm.graphs[at]
        if graph is None:
            graph = own_graph(f)
            unserved += n
            compiled[graph] = None
        shape = run_shape(graph, f, limits)
        run += n * pricing.run_seconds(shape)
        tokens += n * f.tokens
        padded += n * (shape.rows - f.tokens)
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
