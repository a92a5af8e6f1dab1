"""Prompt and decode graphs planned together under one budget, with coverage, in the
two forms the hosts run:

- the gaudi form (:class:`Grid`) runs engine steps as vllm-gaudi does (each prompt or
  prefill chunk alone, the step's decodes as one batch:
  :func:`~attnpolicy.modelling.peer_buckets.step_forwards` ``"gaudi"``), so its graphs
  are vllm-gaudi buckets and its warm set a bucketing file vllm-gaudi runs
  (``VLLM_BUCKETING_FROM_FILE``): prompt graphs ``(1, query, context blocks)`` for
  every planned query size × context size, decode graphs ``(batch, 1, blocks)`` for
  every planned batch × blocks size (those vllm-gaudi keeps,
  :func:`~attnpolicy.modelling.peer_buckets.gaudi_decode_bucket`);
- the ragged form (:class:`RaggedGrid`) runs a step as one forward padded on its
  tokens only (tpu-inference, vLLM's piecewise graphs): a list of token paddings.

**Coverage.** Each list starts at the configured maxima: a prompt of
``max_num_batched_tokens`` (at most ``max_model_len``) query tokens over
⌈(max_model_len − 1) / block⌉ context blocks, a decode of ``max_num_seqs``
sequences over ``max_num_seqs`` × ⌈max_model_len / block⌉ blocks (:func:`top_grid`);
tpu-inference's cover of ``max_num_batched_tokens`` (:func:`ragged_top`). So every step
within the maxima is served after warm-up (padded up) and nothing compiles at run
time. Where the budget cannot hold a phase's largest graph, that phase is left
uncovered: its forwards compile at run time, and :attr:`PeerPlan.outside` says so
with their count and modelled cost.

**Search.** Greedy: from the maxima, add the one size (a prompt query or context, a
decode batch or blocks size, a token padding; among the workload's own values) that lowers the
modelled total most (warm-up compiles plus every forward's run,
:mod:`~attnpolicy.modelling.warmup_costs`) while the graph count, graph bytes and
warm-up seconds stay within the budget; stop when no size lowers it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations, product
from typing import Any, Self

import numpy as np

from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    TPU_MIN_TOKEN_BUCKET,
    Forward,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    WorkloadForwards,
    gaudi_decode_graphs,
)
from attnpolicy.modelling.warmup_costs import Pricing, WarmupCost, warmup_cost
from attnpolicy.planning.bucket_search import ALIGN

#: The most candidate values per dimension (quantiles of the workload's own, by weight).
CANDIDATES = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Budget:
    """What a warm set may take: graphs, graph bytes, warm-up seconds (``None``: unbounded)."""

    max_graphs: int | None = None
    max_bytes: int | None = None
    warmup_seconds: float | None = None

    def why_over(self, graphs: int, nbytes: int, seconds: float) -> str | None:
        """Which bound a set of ``graphs``, ``nbytes`` and ``seconds`` breaks, or ``None``."""
        if self.max_graphs is not None and graphs > self.max_graphs:
            return f"{graphs} graphs > max_graphs {self.max_graphs}"
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return f"{nbytes} bytes > max_bytes {self.max_bytes}"
        if self.warmup_seconds is not None and seconds > self.warmup_seconds:
            return f"{seconds:.4g} warm-up s > warmup_seconds {self.warmup_seconds:.4g}"
        return None

    def over(self, cost: WarmupCost) -> str | None:
        """Which bound the warm set priced as ``cost`` breaks, or ``None``."""
        return self.why_over(cost.graphs, cost.warm_bytes, cost.warmup_seconds)

    def over_graphs(self, graphs: Sequence[PeerGraph], pricing: Pricing) -> str | None:
        """Which bound a warm-up of ``graphs`` priced by ``pricing`` breaks, or ``None``."""
        seconds, nbytes = pricing.warmup(graphs)
        return self.why_over(len(graphs), nbytes, seconds)

    def describe(self) -> str:
        """The bounds set, as ``max_graphs 4, warmup_seconds 2.5`` (empty: unbounded)."""
        return ", ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                         for name, value in self.to_json().items() if value is not None)

    def to_json(self) -> dict[str, Any]:
        return {"max_graphs": self.max_graphs, "max_bytes": self.max_bytes, "warmup_seconds": self.warmup_seconds}


class _Sizes:
    """A grid's sizes per dimension, changed by copy (each dimension ascending, each size once)."""

    def with_size(self, dimension: str, value: int) -> Self:
        return self.with_sizes(dimension, (*getattr(self, dimension), value))

    def with_sizes(self, dimension: str, values: Sequence[int]) -> Self:
        return replace(self, **{dimension: tuple(sorted(set(values)))})  # type: ignore[type-var]


@dataclass(frozen=True)
class Grid(_Sizes):
    """vllm-gaudi's form: the planned prompt query tokens and context blocks, decode
    batches and blocks, each ascending (an empty phase: uncovered)."""

    queries: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    blocks: tuple[int, ...]

    #: the phases and the dimension whose emptiness leaves each uncovered
    PHASES = (("prefill", "queries"), ("decode", "batches"))

    def graphs(self, limits: PeerLimits) -> tuple[PeerGraph, ...]:
        prompt = [PeerGraph("prefill", 1, q, c) for q, c in product(self.queries, self.contexts)]
        return (*prompt, *gaudi_decode_graphs(limits, self.batches, self.blocks))

    def phase(self, phase: str) -> Grid:
        """This grid's sizes of ``phase`` alone."""
        if phase == "prefill":
            return Grid(self.queries, self.contexts, (), ())
        return Grid((), (), self.batches, self.blocks)

    def to_json(self) -> dict[str, list[int]]:
        return {name: list(getattr(self, name)) for name in ("queries", "contexts", "batches", "blocks")}


@dataclass(frozen=True)
class RaggedGrid(_Sizes):
    """The ragged form (tpu-inference, vLLM's piecewise graphs): the planned token
    paddings of a whole step, ascending, each a graph of ``max_num_seqs`` requests."""

    tokens: tuple[int, ...]

    PHASES = (("mixed", "tokens"),)

    def graphs(self, limits: PeerLimits) -> tuple[PeerGraph, ...]:
        return tuple(PeerGraph("mixed", limits.max_num_seqs, t) for t in self.tokens)

    def phase(self, phase: str) -> RaggedGrid:
        return self

    def to_json(self) -> dict[str, list[int]]:
        return {"tokens": list(self.tokens)}


AnyGrid = Grid | RaggedGrid


@dataclass(frozen=True)
class PeerPlan:
    """The planned grid, its warm set, its cost on the workload it was planned on,
    the budget, and what falls outside it (empty: every step within the maxima served)."""

    grid: AnyGrid
    warm: PeerWarmSet
    cost: WarmupCost
    budget: Budget
    outside: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"grid": self.grid.to_json(), "budget": self.budget.to_json(), "cost": self.cost.to_json(),
                "outside": list(self.outside)}


def _quantiles(values: Counter[int], k: int) -> list[int]:
    """At most ``k`` of ``values`` (weighted by count), evenly spaced in cumulative weight, the largest kept."""
    ordered = sorted(values)
    if len(ordered) <= k:
        return ordered
    weights = np.cumsum([values[v] for v in ordered], dtype=float)
    marks = np.linspace(0, weights[-1], k + 1)[1:]
    return sorted({ordered[int(i)] for i in np.searchsorted(weights, marks, side="left").clip(0, len(ordered) - 1)})


def _arrays(rows: Sequence[tuple[int, ...]], width: int) -> tuple[np.ndarray, ...]:
    """``rows`` as one int64 array per column (empty arrays for no rows)."""
    if not rows:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(width))
    return tuple(np.array(column, dtype=np.int64) for column in zip(*rows))


class RunPricing:
    """The forwards as arrays, and the modelled run seconds of a grid's serving (as
    :func:`~attnpolicy.modelling.warmup_costs.warmup_cost` prices it, vectorised: a
    prompt on its ROWS graph of one row, a decode batch on its MASK graph, a ragged
    forward on the MASK fits at its padded rows)."""

    def __init__(self, forwards: Counter[Forward], limits: PeerLimits, pricing: Pricing) -> None:
        self.limits = limits
        self.rows_fit, self.mask_fit = pricing.run_fit(MaskMode.ROWS), pricing.run_fit(MaskMode.MASK)
        items = forwards.items()
        self.pq, self.pc, self.pw = _arrays([(f.query_tokens, f.context_blocks or 0, n) for f, n in items
                                             if f.phase == "prefill"], 3)
        self.db, self.dn, self.dw = _arrays([(f.batch, f.context_blocks or 0, n) for f, n in items
                                             if f.phase == "decode"], 3)
        self.rt, self.rc, self.rx, self.rw = _arrays([(f.tokens, f.context, f.cells, n) for f, n in items
                                                      if f.phase == "mixed"], 4)

    def seconds(self, grid: AnyGrid) -> float:
        """Every covered phase's run seconds on ``grid`` (an uncovered phase is priced elsewhere)."""
        if isinstance(grid, RaggedGrid):
            if not grid.tokens or not self.rt.size:
                return 0.0
            tokens = np.array(grid.tokens)
            return float(np.dot(self.rw, self.mask_fit.at(tokens[np.searchsorted(tokens, self.rt)], self.rc,
                                                           self.rx)))
        return self._prompt_seconds(grid) + self._decode_seconds(grid)

    def _prompt_seconds(self, grid: Grid) -> float:
        if not self.pq.size or not grid.queries:
            return 0.0
        queries, contexts = np.array(grid.queries), np.array(grid.contexts)
        q = queries[np.searchsorted(queries, self.pq)]
        span = contexts[np.searchsorted(contexts, self.pc)] * self.limits.block_size
        return float(np.dot(self.pw, self.rows_fit.at(q, span, q * (span + q))))

    def _decode_seconds(self, grid: Grid) -> float:
        if not self.db.size or not grid.batches:
            return 0.0
        batches = np.array(grid.batches)
        served = batches[np.searchsorted(batches, self.db)]
        per_seq = _cdiv(self.limits.max_model_len, self.limits.block_size)
        n = np.empty_like(self.dn)
        for b in grid.batches:  # the blocks vllm-gaudi keeps for batch b (gaudi_decode_bucket)
            at = served == b
            if at.any():
                kept = np.array(sorted({min(k, b * per_seq) for k in grid.blocks if k >= b}))
                n[at] = kept[np.searchsorted(kept, self.dn[at])]
        span = n * self.limits.block_size
        return float(np.dot(self.dw, self.mask_fit.at(served, span, served * (span + served))))


def _candidates(forwards: Counter[Forward], top: AnyGrid) -> dict[str, list[int]]:
    """Each dimension's candidate sizes: the workload's own values (query tokens and
    step tokens aligned up to a multiple of 16), at most :data:`CANDIDATES` of them,
    within the top."""
    counted: dict[str, Counter[int]] = {name: Counter() for name in ("queries", "contexts", "batches", "blocks",
                                                                     "tokens")}
    for f, n in forwards.items():
        if f.phase == "prefill":
            counted["queries"][_cdiv(f.query_tokens, ALIGN) * ALIGN] += n
            counted["contexts"][f.context_blocks or 0] += n
        elif f.phase == "decode":
            counted["batches"][f.batch] += n
            counted["blocks"][max(f.context_blocks or 0, f.batch)] += n
        else:
            counted["tokens"][_cdiv(f.tokens, ALIGN) * ALIGN] += n
    options = {}
    for name, values in counted.items():
        have = getattr(top, name, ())
        if have:
            options[name] = [v for v in _quantiles(values, CANDIDATES) if v < have[-1] and v not in have]
    return options


def top_grid(limits: PeerLimits) -> Grid:
    """The grid of the maxima alone: a prompt of ``max_num_batched_tokens`` (at most
    ``max_model_len``) query tokens over ⌈(max_model_len − 1) / block⌉ context blocks
    (the most vllm-gaudi keeps), a decode of ``max_num_seqs`` sequences over
    ``max_num_seqs`` × ⌈max_model_len / block⌉ blocks."""
    block, mml = limits.block_size, limits.max_model_len
    return Grid((min(limits.max_num_batched_tokens, mml),), (_cdiv(mml - 1, block),), (limits.max_num_seqs,),
                (limits.max_num_seqs * _cdiv(mml, block),))


def ragged_top(limits: PeerLimits) -> RaggedGrid:
    """The ragged form's largest padding: tpu-inference's cover of
    ``max_num_batched_tokens``, the power of two at or above it (at least 16), which
    its generator always yields."""
    return RaggedGrid((max(TPU_MIN_TOKEN_BUCKET, 1 << (limits.max_num_batched_tokens - 1).bit_length()),))


def plan_forms(forwards: WorkloadForwards, pricing: Pricing, budget: Budget,
               max_sizes: int = 16) -> tuple[PeerPlan, PeerPlan]:
    """The plan in both forms under ``budget``: vllm-gaudi's (its forwards) and the
    ragged one (tpu-inference's forwards, every step one)."""
    return (plan_warmup(forwards.of("gaudi"), forwards.limits, pricing, budget, max_sizes),
            plan_warmup(forwards.of("tpu"), forwards.limits, pricing, budget, max_sizes))


def plan_warmup(forwards: Counter[Forward], limits: PeerLimits, pricing: Pricing, budget: Budget,
                max_sizes: int = 16) -> PeerPlan:
    """The warm set of the module docstring for ``forwards`` (vllm-gaudi's forwards
    of the workload's steps, counted: the gaudi form; or tpu-inference's, every step one
    ragged forward: the ragged form, token paddings only) under ``limits`` and
    ``budget``, at most ``max_sizes`` sizes per dimension."""
    phases = {f.phase for f in forwards}
    if "mixed" in phases and phases != {"mixed"}:
        raise ConfigError(f"plan_warmup plans one runtime's forwards: vllm-gaudi's (prefill, decode) or a "
                          f"ragged runtime's (mixed), got {', '.join(sorted(phases))}")
    top: AnyGrid = ragged_top(limits) if "mixed" in phases else top_grid(limits)
    work = RunPricing(forwards, limits, pricing)

    def priced(grid: AnyGrid) -> tuple[float, str | None]:
        graphs = grid.graphs(limits)
        seconds, nbytes = pricing.warmup(graphs)
        return seconds + work.seconds(grid), budget.why_over(len(graphs), nbytes, seconds)

    grid, outside = _covering(top, priced, forwards, limits)
    if not outside:  # every phase covered: search; else its forwards are priced as run-time compiles
        grid = _search(grid, _candidates(forwards, grid), priced, max_sizes)
    warm = PeerWarmSet.of("plan", grid.graphs(limits))
    cost = warmup_cost("plan", warm, forwards, pricing)
    if outside:
        serving = (f"serving them: {cost.runtime_compiles} graphs compiled at run time, "
                   f"{cost.runtime_compile_seconds:.4g} modelled s")
        outside = (*outside, serving)
    return PeerPlan(grid, warm, cost, budget, outside)


def _covering(top: AnyGrid, priced: Callable[[AnyGrid], tuple[float, str | None]], forwards: Counter[Forward],
              limits: PeerLimits) -> tuple[AnyGrid, tuple[str, ...]]:
    """The largest part of ``top`` within the budget (every phase's largest graph, else
    as many phases as fit, in order) and, for each phase left out, why."""
    names = [name for _, name in top.PHASES]
    for keep in range(len(names), -1, -1):
        for kept in combinations(names, keep):
            grid = top
            for name in names:
                if name not in kept:
                    grid = grid.with_sizes(name, ())
            if priced(grid)[1] is None:
                break
        else:
            continue
        break
    outside = []
    for phase, name in top.PHASES:
        if not getattr(grid, name):
            largest = top.phase(phase)
            n = sum(c for f, c in forwards.items() if f.phase == phase)
            why = priced(largest)[1] or f"with the other phase's: {priced(top)[1]}"
            outside.append(f"{phase}: its largest graph {largest.graphs(limits)[0]} is over the budget "
                           f"({why}); its {n} forwards compile at run time")
    return grid, tuple(outside)


def _search(grid: AnyGrid, options: dict[str, list[int]], priced: Callable[[AnyGrid], tuple[float, str | None]],
            max_sizes: int) -> AnyGrid:
    """Add the size that lowers the total most within the budget, until none does."""
    best, _ = priced(grid)
    while True:
        trials = []
        for name, values in options.items():
            have = getattr(grid, name)
            if len(have) >= max_sizes:
                continue
            for v in values:
                if v not in have:
                    trial = grid.with_size(name, v)
                    total, over = priced(trial)
                    if over is None and total < best:
                        trials.append((total, name, v, trial))
        if not trials:
            return grid
        best, _, _, grid = min(trials, key=lambda t: (t[0], t[1], t[2]))
