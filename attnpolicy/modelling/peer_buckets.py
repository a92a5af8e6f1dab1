"""The graphs the peers (other hosts' vLLM plugins) compile at warm-up, re-implemented from their rules.

For a server's limits (:class:`PeerLimits`: vLLM's ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``block_size``) each scheme gives a
:class:`PeerWarmSet` of :class:`PeerGraph` (phase, padded batch, padded query
tokens, context blocks where the peer pads them):

- ``gaudi-linear``, ``gaudi-exponential``: vllm-gaudi's two generated strategies,
  prompt graphs batch × query × context blocks and decode graphs batch × 1 × blocks
  (:func:`gaudi_config`, :func:`gaudi_warmup`);
- ``rbln``: vllm-rbln, one prefill graph at batch 1 padded to
  ``max_num_batched_tokens`` and one decode graph per decode batch bucket
  (:func:`rbln_warmup`);
- ``tpu``: tpu-inference, one ragged graph per token padding × attention request
  padding, serving prefill and decode alike; the request paddings of its sampling
  graphs come with :func:`tpu_paddings`.

Read (not copied) from vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
rebellions-sw/vllm-rbln@e9ff4c1bc9edcad27bfbd4960310498e5c40c48e and
vllm-project/tpu-inference@b8692ff01fa191343836996c27a39dc95f008b88; each function
names its files. Modelled: every peer's defaults (its environment variables
unset), one device (no data or pipeline parallelism), no speculative decoding, LoRA,
multimodal or mamba layers; for vllm-gaudi no merged prefill, no contiguous paged
attention (its default under prefix caching, vLLM's default) and no sliding-window
slicing; its bucket file is read by :func:`gaudi_file_warmup`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import product
from typing import Literal, NamedTuple

import numpy as np

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import plan_rules
from attnpolicy.workloads.batching import BatchFormer

Phase = Literal["prefill", "decode", "mixed"]
#: The peers whose warm sets and forwards are modelled here.
Peer = Literal["gaudi", "rbln", "tpu"]
PEERS: tuple[Peer, ...] = ("gaudi", "rbln", "tpu")
GaudiStrategy = Literal["linear", "exponential"]
RblnStrategy = Literal["exponential", "linear"]

#: vllm-gaudi's KV block size unless the user gives one (vllm_gaudi/platform.py).
GAUDI_BLOCK_SIZE = 128
#: vllm-gaudi's long-context threshold on ``max_model_len`` (bucketing/exponential.py, common.py).
GAUDI_LONG_CONTEXT = 8192
#: tpu-inference's smallest request padding (tpu_inference/runner/utils.py ``MIN_NUM_SEQS``).
TPU_MIN_NUM_SEQS = 8
#: tpu-inference's smallest token padding on one device with a bf16 KV cache
#: (``max(MIN_TOKEN_BUCKET, next_power_of_2(dp_size * kv_packing))`` in tpu_runner.py).
TPU_MIN_TOKEN_BUCKET = 16


#: Context blocks of none: a graph that serves any context, a forward any graph serves.
_ANY = -1


def _check_int(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")


def _ceil_log2(n: int) -> int:
    """``ceil(log2(n))`` for ``n >= 1``, exactly."""
    return (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ordered(graphs: Iterable[PeerGraph]) -> tuple[PeerGraph, ...]:
    return tuple(sorted(set(graphs), key=PeerGraph.sort_key))


@dataclass(frozen=True)
class PeerLimits:
    """The vLLM limits a peer derives its warm set from; each an int >= 1
    (else :class:`ConfigError` naming it)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = GAUDI_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            _check_int(name, getattr(self, name), 1)

    @classmethod
    def of(cls, former: BatchFormer) -> PeerLimits:
        """The limits of the server whose steps ``former`` forms (blocks of the default size)."""
        return cls(former.max_num_seqs, former.max_num_batched_tokens, former.max_model_len)


@dataclass(frozen=True)
class PeerGraph:
    """One compiled shape: a ``prefill`` or ``decode`` graph pads ``batch`` sequences
    to ``query_tokens`` each; a ``mixed`` graph (tpu's ragged batch) takes up to
    ``batch`` requests of ``query_tokens`` tokens in all. ``context_blocks`` is
    ``None`` where the peer does not pad the context (a whole-length KV cache)."""

    phase: Phase
    batch: int
    query_tokens: int
    context_blocks: int | None = None

    def sort_key(self) -> tuple[str, int, int, int]:
        return self.phase, self.batch, self.query_tokens, -1 if self.context_blocks is None else self.context_blocks


@dataclass(frozen=True)
class PeerWarmSet:
    """The graphs a peer compiles at warm-up, sorted by (phase, batch, query
    tokens, context blocks), each once."""

    scheme: str
    graphs: tuple[PeerGraph, ...]

    @classmethod
    def of(cls, scheme: str, graphs: Iterable[PeerGraph]) -> PeerWarmSet:
        return cls(scheme, _ordered(graphs))

    def phase(self, phase: Phase) -> tuple[PeerGraph, ...]:
        return tuple(g for g in self.graphs if g.phase == phase)

    def prefill_lengths(self) -> tuple[int, ...]:
        """The query-token sizes of the graphs that serve prefill (every phase but decode), ascending."""
        return tuple(sorted({g.query_tokens for g in self.graphs if g.phase != "decode"}))

    def serves(self, phase: Phase, batch: int, query_tokens: int,
               context_blocks: int | None = None) -> PeerGraph | None:
        """The first graph (in order) of ``phase`` at least as large in every
        dimension, as vllm-gaudi's bucket lookup picks it; ``None``: the peer
        compiles a new graph. A graph without context blocks serves any context."""
        at = int(self.serving([(phase, batch, query_tokens, context_blocks)])[0])
        return None if at < 0 else self.graphs[at]

    def serving(self, shapes: Sequence[tuple[Phase, int, int, int | None]]) -> np.ndarray:
        """The position in :attr:`graphs` of the graph :meth:`serves` picks for each
        ``(phase, batch, query tokens, context blocks)`` of ``shapes`` (-1: none), all
        of a phase at once."""
        out = np.full(len(shapes), -1, dtype=np.int64)
        if not shapes:
            return out
        phases, batches, queries, contexts = zip(*shapes, strict=True)
        phase = np.array(phases)
        want = np.array([batches, queries], dtype=np.int64).T
        want_blocks = np.array([_ANY if c is None else c for c in contexts], dtype=np.int64)
        for name, (at, batch, query, blocks) in self._phases.items():
            mine = np.flatnonzero(phase == name)
            step = max(1, (1 << 22) // at.size)  # shapes per block of (shape, graph) cells
            for rows in (mine[lo:lo + step] for lo in range(0, mine.size, step)):
                fits = ((batch >= want[rows, :1]) & (query >= want[rows, 1:])
                        & ((blocks == _ANY) | (blocks >= want_blocks[rows, None])))
                first = fits.argmax(axis=1)  # the first in order of those that fit
                out[rows] = np.where(fits[np.arange(rows.size), first], at[first], -1)
        return out

    @cached_property
    def _phases(self) -> dict[Phase, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per phase, its graphs' positions in :attr:`graphs`, batches, query tokens and
        context blocks (:data:`_ANY`: none, any context)."""
        out = {}
        for phase in dict.fromkeys(g.phase for g in self.graphs):
            mine = [(i, g) for i, g in enumerate(self.graphs) if g.phase == phase]
            at, batch, query, blocks = (np.array(col, dtype=np.int64) for col in zip(
                *((i, g.batch, g.query_tokens, _ANY if g.context_blocks is None else g.context_blocks)
                  for i, g in mine), strict=True))
            out[phase] = (at, batch, query, blocks)
        return out


# -- vllm-gaudi ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearRange:
    """vllm-gaudi's linear warm-up range (vllm_gaudi/extension/bucketing/linear.py
    ``warmup_range``; docs/features/bucketing_mechanism.md "Linear Strategy"): a
    ramp-up doubling ``min`` while below ``step``, then the multiples of ``step`` up
    to ``max`` (``max`` itself only when it is one), those below ``min`` left out;
    ``min`` 0 ramps from ``step`` and adds a 0 bucket. None left is a
    :class:`ConfigError` (vllm-gaudi would warm up nothing)."""

    min: int
    step: int
    max: int

    def values(self) -> tuple[int, ...]:
        _check_int("step", self.step, 1)
        _check_int("min", self.min, 0)
        if self.min > self.max:
            raise ConfigError(f"a bucket range's min must be <= its max, got min={self.min}, max={self.max}")
        if self.max == 0:
            return (0,)
        start = self.min or self.step
        ramp = [start << k for k in range(self.max.bit_length()) if (start << k) < self.step
                and (start << k) <= self.max]
        stable = range(self.step, self.max + 1, self.step)
        values = sorted({v for v in (*ramp, *stable) if v >= start} | ({0} if self.min == 0 else set()))
        if not values:
            raise ConfigError(f"a linear bucket range has no bucket: min={self.min} is above step={self.step} "
                              f"and no multiple of step lies in [min, max={self.max}]")
        return tuple(values)


@dataclass(frozen=True)
class ExponentialRange:
    """vllm-gaudi's exponential warm-up range (vllm_gaudi/extension/bucketing/exponential.py
    ``warmup_range_with_limit``): ``limit`` points spaced geometrically from ``min``
    to ``max``, each rounded up to a multiple of ``step``, duplicates dropped, the
    largest cut to ``max``; ``min`` 0 or 1 starts the spacing at ``step`` and adds
    ``min`` itself; ``limit`` 1 is ``max`` alone."""

    min: int
    step: int
    max: int
    limit: int

    def values(self) -> tuple[int, ...]:
        _check_int("step", self.step, 1)
        _check_int("limit", self.limit, 1)
        _check_int("max", self.max, 1)
        if self.limit == 1:
            return (self.max,)
        lo = self.step if self.min in (0, 1) else self.min
        points = {math.ceil(lo * (self.max / lo) ** ((1.0 / (self.limit - 1)) * i) / self.step) * self.step
                  for i in range(self.limit)}
        if self.min in (0, 1):
            points.add(self.min)
        out = sorted(points)
        out[-1] = min(out[-1], self.max)
        return tuple(sorted(set(out)))


GaudiRange = LinearRange | ExponentialRange


@dataclass(frozen=True)
class GaudiConfig:
    """vllm-gaudi's bucket settings for one server: the ranges of prompt batch,
    query tokens and context blocks, and of decode batch and blocks (decode query is 1)."""

    strategy: GaudiStrategy
    prompt_batch: GaudiRange
    prompt_query: GaudiRange
    prompt_context: GaudiRange
    decode_batch: GaudiRange
    decode_blocks: GaudiRange


def gaudi_config(limits: PeerLimits, strategy: GaudiStrategy, *, max_num_prefill_seqs: int = 1,
                 num_kv_blocks: int | None = None) -> GaudiConfig:
    """The settings vllm-gaudi derives (vllm_gaudi/extension/bucketing/linear.py and
    exponential.py ``get_prompt_cfgs`` / ``get_decode_cfgs``, at the commit of the
    module docstring):

    - ``max_num_prefill_seqs``: the runner's ``VLLM_PROMPT_BS_BUCKET_MAX``, default 1
      (vllm_gaudi/v1/worker/hpu_model_runner.py);
    - ``num_kv_blocks``: the KV cache's blocks, known once it is allocated; exponential
      decode clamps its blocks to three times it. ``None``: a cache holding
      ``max_num_seqs`` sequences of ``max_model_len``, so the clamp never binds.

    Exponential: prompt batch (1, 2, max_num_prefill_seqs, ⌈log2⌉+1), query (block,
    block, max_num_batched_tokens, ⌈log2 max_num_batched_tokens⌉), context (0, 1,
    max_ctx, ⌈log2 max_ctx⌉+1, 2 when max_ctx is 1) with max_ctx = (max_model_len −
    block, or − max_num_batched_tokens from 8192 on) // block, at least 1; decode
    batch (1, 2, max_num_seqs, ⌈log2⌉+1), blocks (1, max_num_seqs, ⌈max_model_len /
    block⌉ · max_num_seqs clamped, ⌈log2⌉+1). Linear: prompt batch (1, 1,
    max_num_prefill_seqs), query (block, block, max_num_batched_tokens), context (0,
    1, (max_model_len − block) // block); decode batch (1, 32, max_num_seqs), blocks
    (1, block, max(max_model_len · max_num_seqs // block, block)).
    """
    _check_int("max_num_prefill_seqs", max_num_prefill_seqs, 1)
    if num_kv_blocks is not None:
        _check_int("num_kv_blocks", num_kv_blocks, 1)
    block, mml, tokens, seqs = (limits.block_size, limits.max_model_len, limits.max_num_batched_tokens,
                                limits.max_num_seqs)
    if strategy == "exponential":
        if tokens < 2:
            raise ConfigError(f"gaudi-exponential needs max_num_batched_tokens >= 2 (its query bucket limit is "
                              f"ceil(log2(max_num_batched_tokens)) = 0), got max_num_batched_tokens={tokens}")
        max_ctx = max(1, (mml - (tokens if mml >= GAUDI_LONG_CONTEXT else block)) // block)
        worst = _cdiv(mml, block) * seqs
        blocks = worst if num_kv_blocks is None else min(worst, 3 * num_kv_blocks)
        return GaudiConfig(
            strategy,
            ExponentialRange(1, 2, max_num_prefill_seqs, _ceil_log2(max_num_prefill_seqs) + 1),
            ExponentialRange(block, block, tokens, _ceil_log2(tokens)),
            ExponentialRange(0, 1, max_ctx, 2 if max_ctx == 1 else _ceil_log2(max_ctx) + 1),
            ExponentialRange(1, 2, seqs, _ceil_log2(seqs) + 1),
            ExponentialRange(1, seqs, blocks, _ceil_log2(blocks) + 1))
    if strategy == "linear":
        for name, value in (("max_num_batched_tokens", tokens), ("max_model_len", mml)):
            if value < block:
                raise ConfigError(f"gaudi-linear needs {name} >= block_size={block} (its prompt query buckets "
                                  f"are multiples of a block), got {name}={value}")
        return GaudiConfig(
            strategy, LinearRange(1, 1, max_num_prefill_seqs), LinearRange(block, block, tokens),
            LinearRange(0, 1, (mml - block) // block), LinearRange(1, 32, seqs),
            LinearRange(1, block, max(mml * seqs // block, block)))
    raise ConfigError(f"unknown vllm-gaudi strategy {strategy!r}: give linear or exponential")


def gaudi_prompt_graphs(limits: PeerLimits, batches: Iterable[int], queries: Iterable[int],
                        contexts: Iterable[int]) -> tuple[PeerGraph, ...]:
    """vllm-gaudi's prompt buckets from its ranges (vllm_gaudi/extension/bucketing/common.py
    ``generate_buckets``): every batch × query × context that
    :func:`gaudi_prompt_refusal` does not refuse. From max_model_len 8192 on, the
    largest context becomes, for each query, (max_model_len − query) // block.
    Sorted, each once, as every function here returns graphs."""
    contexts = tuple(contexts)
    top, mml, block = max(contexts), limits.max_model_len, limits.block_size
    out = []
    for b, c, q in product(batches, contexts, tuple(queries)):
        if mml >= GAUDI_LONG_CONTEXT and c == top and mml >= q:
            c = (mml - q) // block
        if gaudi_prompt_refusal(limits, b, q, c) is None:
            out.append(PeerGraph("prefill", b, q, c))
    return _ordered(out)


def gaudi_prompt_refusal(limits: PeerLimits, batch: int, query: int, context: int) -> str | None:
    """Why vllm-gaudi drops the prompt bucket (batch, query tokens, context blocks)
    before warm-up (vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
    vllm_gaudi/extension/bucketing/common.py ``generate_buckets``, its
    filters without merged prefill, for generated and file buckets alike), or ``None``
    when it keeps it: the context within ⌈(max_model_len − 1) / block⌉ blocks, the
    query within max_model_len and batch × query within max_num_batched_tokens."""
    cap = _cdiv(limits.max_model_len - 1, limits.block_size)
    if context > cap:
        return f"context {context} blocks > ceil((max_model_len - 1) / block_size) = {cap}"
    if query > limits.max_model_len:
        return f"query {query} tokens > max_model_len {limits.max_model_len}"
    if batch * query > limits.max_num_batched_tokens:
        return f"batch x query {batch * query} > max_num_batched_tokens {limits.max_num_batched_tokens}"
    return None


def gaudi_decode_bucket(limits: PeerLimits, batch: int, blocks: int) -> PeerGraph | None:
    """The decode bucket vllm-gaudi keeps of (batch, blocks)
    (vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
    vllm_gaudi/extension/bucketing/common.py ``generate_buckets`` without contiguous
    paged attention, for generated and file buckets alike): dropped (``None``) when
    batch > blocks, else the blocks cut to batch · ⌈max_model_len / block⌉."""
    if batch > blocks:
        return None
    return PeerGraph("decode", batch, 1, min(blocks, batch * _cdiv(limits.max_model_len, limits.block_size)))


def gaudi_decode_graphs(limits: PeerLimits, batches: Iterable[int], blocks: Iterable[int]) -> tuple[PeerGraph, ...]:
    """vllm-gaudi's decode buckets from its ranges: every batch × blocks that
    :func:`gaudi_decode_bucket` keeps, as it keeps it."""
    kept = (gaudi_decode_bucket(limits, b, n) for b, n in product(batches, tuple(blocks)))
    return _ordered(g for g in kept if g is not None)


def gaudi_warmup(limits: PeerLimits, strategy: GaudiStrategy, *, max_num_prefill_seqs: int = 1,
                 num_kv_blocks: int | None = None) -> PeerWarmSet:
    """vllm-gaudi's prompt and decode buckets (:func:`gaudi_config`'s ranges through
    :func:`gaudi_prompt_graphs` and :func:`gaudi_decode_graphs`); no prompt bucket
    left by the filters is a :class:`ConfigError`, as vllm-gaudi refuses to start."""
    cfg = gaudi_config(limits, strategy, max_num_prefill_seqs=max_num_prefill_seqs, num_kv_blocks=num_kv_blocks)
    prompt = gaudi_prompt_graphs(limits, cfg.prompt_batch.values(), cfg.prompt_query.values(),
                                 cfg.prompt_context.values())
    if not prompt:
        raise ConfigError(f"gaudi-{strategy}: no prompt bucket fits max_model_len={limits.max_model_len} "
                          f"(its smallest query bucket is {min(cfg.prompt_query.values())} tokens)")
    decode = gaudi_decode_graphs(limits, cfg.decode_batch.values(), cfg.decode_blocks.values())
    return PeerWarmSet.of(f"gaudi-{strategy}", (*prompt, *decode))


#: The most elements vllm-gaudi expands a bucket file's ``range(...)`` to (file_strategy.py).
GAUDI_FILE_MAX_RANGE = 10000


def _gaudi_file_int(node: ast.expr, *, whole: bool = False) -> int | None:
    """A number literal of a bucket file as vllm-gaudi takes it (``int()`` of it;
    ``whole``: a ``range`` argument, an int literal, optionally negative), else ``None``."""
    negative = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    if negative or (not whole and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd)):
        node = node.operand  # type: ignore[attr-defined]
    if not isinstance(node, ast.Constant) or not isinstance(node.value, int if whole else int | float):
        return None
    return -int(node.value) if negative else int(node.value)


def _gaudi_file_entry(node: ast.expr) -> list[int] | None:
    """One entry of a bucket-file tuple as its integers: a number, a list of numbers or
    ``range`` of int literals; ``None`` when vllm-gaudi cannot read it."""
    if (n := _gaudi_file_int(node)) is not None:
        return [n]
    if isinstance(node, ast.List):
        items = [_gaudi_file_int(e) for e in node.elts]
        return [i for i in items if i is not None] if all(i is not None for i in items) else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
            and 2 <= len(node.args) <= 3 and not node.keywords):
        args = [_gaudi_file_int(a, whole=True) for a in node.args]
        if any(a is None for a in args) or args[2:] == [0]:
            return None
        r = range(*(a for a in args if a is not None))
        return list(r) if len(r) <= GAUDI_FILE_MAX_RANGE else None
    return None


def gaudi_file_buckets(text: str) -> tuple[tuple[int, int, int], ...]:
    """The buckets a vllm-gaudi bucketing file (``VLLM_BUCKETING_FROM_FILE``) names, as
    vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
    vllm_gaudi/extension/bucketing/file_strategy.py ``FileBucketingStrategy.get_buckets``
    reads it: a line stripped; empty or starting with ``#``: skipped; else one Python
    literal, a tuple of three entries (batch, query tokens, blocks), each a number, a
    list of numbers or ``range(start, stop[, step])`` of int literals (Python's range:
    stop left out; step 0 or more than 10000 elements leave it unread), the line
    standing for the Cartesian product of its entries. Sorted, each once. Any other
    line is a :class:`ConfigError` naming it: vllm-gaudi means to skip it with a
    warning, but at that commit the warning is ``logger.warning`` on its ``logger``
    factory function, an ``AttributeError`` that stops the warm-up."""
    out: set[tuple[int, int, int]] = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            node: ast.expr | None = ast.parse(line, mode="eval").body
        except SyntaxError:
            node = None
        entries = [_gaudi_file_entry(e) for e in node.elts] if isinstance(node, ast.Tuple) else []
        if len(entries) != 3 or any(e is None for e in entries):
            raise ConfigError(f"line {number} of the vllm-gaudi bucketing file is no (batch, query, blocks) tuple "
                              f"vllm-gaudi reads, got {line!r}: vllm-gaudi fails on it")
        batch, query, blocks = (e or [] for e in entries)
        out.update(product(batch, query, blocks))
    return tuple(sorted(out))


def gaudi_file_warmup(text: str, limits: PeerLimits) -> PeerWarmSet:
    """vllm-gaudi's warm set from a bucketing file
    (vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
    vllm_gaudi/extension/bucketing/common.py ``generate_prompt_buckets``,
    ``generate_decode_buckets`` and ``generate_buckets`` with file buckets): of
    :func:`gaudi_file_buckets`, those of query 1 are decode buckets (batch, 1, blocks)
    kept as :func:`gaudi_decode_bucket` keeps them, the others prompt buckets
    (batch, query, context blocks) :func:`gaudi_prompt_refusal` does not refuse. A phase
    left with no bucket is a :class:`ConfigError`, as vllm-gaudi refuses to start."""
    prompt, decode = [], []
    for b, q, n in gaudi_file_buckets(text):
        if q == 1:
            decode.append(gaudi_decode_bucket(limits, b, n))
        elif gaudi_prompt_refusal(limits, b, q, n) is None:
            prompt.append(PeerGraph("prefill", b, q, n))
    kept = [g for g in decode if g is not None]
    for phase, graphs in (("prompt", prompt), ("decode", kept)):
        if not graphs:
            raise ConfigError(f"the vllm-gaudi bucketing file leaves no {phase} bucket: vllm-gaudi refuses to start")
    return PeerWarmSet.of("gaudi-file", (*prompt, *kept))


# -- vllm-rbln ----------------------------------------------------------------------------

def rbln_decode_batches(max_batch_size: int, strategy: RblnStrategy = "exponential", *, min_batch: int = 1,
                        step: int = 2, limit: int = 1) -> tuple[int, ...]:
    """vllm-rbln's decode batch buckets, ascending (vllm_rbln/v1/worker/bucketing/
    exponential_bucketing_manager.py, linear_bucketing_manager.py, bucketing_manager.py
    ``check_config``): from ``max_batch_size`` down, each bucket the previous one
    divided by ``step`` (exponential, integer division) or less ``step`` (linear),
    until ``limit`` buckets or below ``min_batch``. Defaults are vllm_rbln/rbln_envs.py's
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_*``: exponential, min 1, step 2, limit 1."""
    if strategy not in ("exponential", "linear"):
        raise ConfigError(f"unknown vllm-rbln strategy {strategy!r}: give exponential or linear")
    _check_int("min_batch", min_batch, 1)
    _check_int("step", step, 2 if strategy == "exponential" else 1)
    _check_int("limit", limit, 1)
    if max_batch_size < min_batch:
        raise ConfigError(f"vllm-rbln's max batch size (max_num_seqs // pipeline_parallel_size) must be >= "
                          f"min_batch={min_batch}, got {max_batch_size}")
    out = [max_batch_size]
    while len(out) < limit:
        nxt = out[-1] // step if strategy == "exponential" else out[-1] - step
        if nxt < min_batch:
            break
        out.append(nxt)
    return tuple(sorted(set(out)))


def rbln_manual_decode_batches(value: str, max_batch_size: int) -> tuple[int, ...]:
    """vllm-rbln's manual decode batch buckets, ascending, from
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS`` under
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY=manual`` (rebellions-sw/vllm-rbln@e9ff4c1bc9edcad27bfbd4960310498e5c40c48e,
    vllm_rbln/rbln_envs.py
    ``get_decode_batch_bucket_manual_buckets``, vllm_rbln/v1/worker/bucketing/
    manual_bucketing_manager.py): comma-separated ints, each > 0, none twice, the
    largest the max batch size (``max_num_seqs // pipeline_parallel_size``); any other
    value is a :class:`ConfigError` naming the rule vllm-rbln refuses it by."""
    try:
        buckets = [int(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS must be comma-separated ints, "
                          f"got {value!r}") from None
    if any(b <= 0 for b in buckets):
        raise ConfigError(f"VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS must be > 0 each, got {value!r}")
    if len(buckets) != len(set(buckets)):
        raise ConfigError(f"VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS must be unique, got {value!r}")
    if max(buckets) != max_batch_size:
        raise ConfigError(f"VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS must end at the max batch size "
                          f"{max_batch_size}, got {value!r}")
    return tuple(sorted(buckets))


def rbln_warmup(limits: PeerLimits, strategy: RblnStrategy = "exponential", *, min_batch: int = 1, step: int = 2,
                limit: int = 1, pipeline_parallel_size: int = 1, manual: str | None = None) -> PeerWarmSet:
    """vllm-rbln's warm-up (vllm_rbln/v1/worker/rbln_model_runner.py ``warm_up_model``
    and the prefill padding of its model step; docs/bucketing.md): one prefill graph
    of one request padded to ``max_num_batched_tokens``, one decode graph per
    :func:`rbln_decode_batches` bucket of ``max_num_seqs // pipeline_parallel_size``,
    or per bucket of ``manual`` (``VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS`` under
    the ``manual`` strategy, :func:`rbln_manual_decode_batches`) when it is given.
    Neither pads a context: the KV cache spans ``max_model_len``."""
    _check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    largest = limits.max_num_seqs // pipeline_parallel_size
    batches = (rbln_decode_batches(largest, strategy, min_batch=min_batch, step=step, limit=limit)
               if manual is None else rbln_manual_decode_batches(manual, largest))
    return PeerWarmSet.of("rbln", (PeerGraph("prefill", 1, limits.max_num_batched_tokens),
                                   *(PeerGraph("decode", b, 1) for b in batches)))


def rbln_env_warmup(limits: PeerLimits, env: Mapping[str, str]) -> PeerWarmSet:
    """vllm-rbln's warm-up under the environment ``env``: its decode batch buckets by
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY`` (default exponential), the list of
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS`` under ``manual``; the other
    strategies' tuning variables at their defaults (:func:`rbln_warmup`)."""
    strategy = env.get("VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY", "exponential")
    if strategy == "manual":
        return rbln_warmup(limits, manual=env.get("VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS", ""))
    if strategy == "exponential":
        return rbln_warmup(limits, "exponential")
    if strategy == "linear":
        return rbln_warmup(limits, "linear")
    raise ConfigError(f"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY must be exponential, linear or manual, got {strategy!r}")


# -- tpu-inference ------------------------------------------------------------------------

def tpu_token_paddings(min_tokens: int, max_tokens: int, padding_gap: int = 0) -> tuple[int, ...]:
    """tpu-inference's token paddings (tpu_inference/runner/utils.py ``get_token_paddings``):
    gap 0, ``min_tokens`` doubling up to the first size >= ``max_tokens``; otherwise
    doubling while <= ``padding_gap``, then steps of ``padding_gap`` up to the first
    size >= ``max_tokens``. ``min_tokens`` must be a power of two."""
    _check_int("min_tokens", min_tokens, 1)
    _check_int("max_tokens", max_tokens, 1)
    _check_int("padding_gap", padding_gap, 0)
    if min_tokens & (min_tokens - 1):
        raise ConfigError(f"tpu-inference's smallest token padding must be a power of two, got {min_tokens}")
    if padding_gap == 0:
        doublings = _ceil_log2(_cdiv(max_tokens, min_tokens))
        return tuple(min_tokens << k for k in range(doublings + 1))
    doubled = [min_tokens << k for k in range(padding_gap.bit_length()) if (min_tokens << k) <= padding_gap]
    start = doubled[-1] if doubled else min_tokens // 2
    steps = _cdiv(max_tokens - start, padding_gap) if max_tokens > start else 0
    return (*doubled, *(start + padding_gap * k for k in range(1, steps + 1)))


def tpu_request_paddings(min_reqs: int, max_reqs: int) -> tuple[int, ...]:
    """tpu-inference's request paddings (tpu_inference/runner/utils.py ``get_req_paddings``):
    powers of two from max(8, ``min_reqs``), the last cut to ``max_reqs``; none when
    ``max_reqs`` is below the first."""
    _check_int("min_reqs", min_reqs, 1)
    _check_int("max_reqs", max_reqs, 1)
    if min_reqs & (min_reqs - 1):
        raise ConfigError(f"tpu-inference's smallest request padding must be a power of two, got {min_reqs}")
    first = max(TPU_MIN_NUM_SEQS, min_reqs)
    if max_reqs < first:
        return ()
    return (*(first << k for k in range(max_reqs.bit_length()) if (first << k) < max_reqs), max_reqs)


@dataclass(frozen=True)
class TpuPaddings:
    """tpu-inference's paddings: ``tokens`` (every graph's token count),
    ``requests`` (sampling and logits graphs) and ``attention_requests`` (the
    model graph's request count)."""

    tokens: tuple[int, ...]
    requests: tuple[int, ...]
    attention_requests: tuple[int, ...]

    def warmup(self) -> PeerWarmSet:
        """The model graphs tpu-inference compiles (tpu_inference/runner/compilation_manager.py
        ``_precompile_backbone_text_only``): every token padding × attention request padding."""
        return PeerWarmSet.of("tpu", (PeerGraph("mixed", r, t) for t, r in product(self.tokens,
                                                                                    self.attention_requests)))


def tpu_paddings(limits: PeerLimits, *, padding_gap: int = 0, min_tokens: int = TPU_MIN_TOKEN_BUCKET,
                 bucketize_attention_requests: bool = False, compilation_sizes: Sequence[int] = (),
                 custom_attention_requests: Sequence[int] = ()) -> TpuPaddings:
    """tpu-inference's paddings for one device (vllm-project/tpu-inference@b8692ff01fa191343836996c27a39dc95f008b88,
    tpu_inference/runner/tpu_runner.py
    ``_init_inputs``, utils.py ``get_attn_req_paddings``, envs.py): tokens up to
    ``max_num_batched_tokens`` (``VLLM_TPU_BUCKET_PADDING_GAP``, default 0;
    ``MIN_TOKEN_BUCKET``, default 16) and the ``compilation_sizes`` of vLLM's
    ``additional_config``, sorted together as the runner sorts them (a size in both
    lists twice); requests up to max(``max_num_seqs``, 8); attention requests
    ``max_num_seqs`` alone unless ``ATTN_BUCKETIZED_NUM_REQS``, then
    ``custom_attention_requests`` (``ATTN_CUSTOM_NUM_REQS_BUCKETS``) in their order or,
    without them, the request paddings up to ``max_num_seqs``, either with
    ``max_num_seqs`` appended where it is missing."""
    for size in compilation_sizes:
        _check_int("compilation_sizes", size, 1)
    seqs = limits.max_num_seqs
    attention: tuple[int, ...] = (seqs,)
    if bucketize_attention_requests:
        listed = tuple(custom_attention_requests) or tpu_request_paddings(TPU_MIN_NUM_SEQS, seqs)
        attention = listed if seqs in listed else (*listed, seqs)
    tokens = tuple(sorted((*tpu_token_paddings(min_tokens, limits.max_num_batched_tokens, padding_gap),
                           *compilation_sizes)))
    if not tokens:  # the peer's own rule gives nothing here: it could serve no step
        raise ConfigError(f"tpu-inference's token paddings are empty for min_tokens={min_tokens}, "
                          f"padding_gap={padding_gap} and max_num_batched_tokens={limits.max_num_batched_tokens} "
                          f"(above a gap under min_tokens, its first padding is min_tokens / 2 + padding_gap): "
                          f"raise max_num_batched_tokens or padding_gap to at least min_tokens, or lower min_tokens")
    return TpuPaddings(tokens, tpu_request_paddings(TPU_MIN_NUM_SEQS, max(seqs, TPU_MIN_NUM_SEQS)), attention)


def tpu_env_paddings(limits: PeerLimits, env: Mapping[str, str],
                     compilation_sizes: Sequence[int] = ()) -> TpuPaddings:
    """The paddings tpu-inference compiles under the environment ``env`` and vLLM's
    ``additional_config["compilation_sizes"]``, read as its envs.py reads them
    (``MIN_TOKEN_BUCKET``, default 16; ``VLLM_TPU_BUCKET_PADDING_GAP``, default 0;
    ``ATTN_BUCKETIZED_NUM_REQS``, ``1`` or ``true``; ``ATTN_CUSTOM_NUM_REQS_BUCKETS``,
    comma-separated), through :func:`tpu_paddings`; a value it cannot read is a
    :class:`ConfigError` naming it."""
    def number(name: str, default: int) -> int:
        try:
            return int(env.get(name, default))
        except ValueError:
            raise ConfigError(f"{name} must be an int, got {env[name]!r}") from None

    custom = env.get("ATTN_CUSTOM_NUM_REQS_BUCKETS", "")
    try:
        requests = [int(v) for v in custom.split(",")] if custom else []
    except ValueError:
        raise ConfigError(f"ATTN_CUSTOM_NUM_REQS_BUCKETS must be comma-separated ints, got {custom!r}") from None
    return tpu_paddings(limits, min_tokens=number("MIN_TOKEN_BUCKET", TPU_MIN_TOKEN_BUCKET),
                        padding_gap=number("VLLM_TPU_BUCKET_PADDING_GAP", 0),
                        bucketize_attention_requests=env.get("ATTN_BUCKETIZED_NUM_REQS", "0").lower() in ("1", "true"),
                        compilation_sizes=compilation_sizes, custom_attention_requests=requests)


# -- one engine step, as each peer runs it ------------------------------------------------

class Forward(NamedTuple):
    """One forward a peer runs for an engine step: the graph shape it asks for
    (``phase``, ``batch``, ``query_tokens``, ``context_blocks`` as
    :meth:`PeerWarmSet.serves` takes them), the ``tokens`` it computes, its sequences'
    cached ``context`` tokens in all and the attention score ``cells`` they need (each
    sequence's new tokens times its keys, summed). A tuple: a workload's forwards are
    counted by value."""

    phase: Phase
    batch: int
    query_tokens: int
    context_blocks: int | None
    tokens: int
    context: int
    cells: int

    def rows(self, graph: PeerGraph) -> int:
        """The query rows ``graph`` computes for this forward: its batch × its query
        tokens, or its tokens for a ragged ``mixed`` graph."""
        return graph.query_tokens if graph.phase == "mixed" else graph.batch * graph.query_tokens


def peer_of(scheme: str) -> Peer:
    """The peer whose warm set ``scheme`` is: its name up to the first ``-``
    (``gaudi-linear``, ``gaudi-file``: ``gaudi``), one of :data:`PEERS`."""
    peer = scheme.split("-")[0]
    if peer not in PEERS:
        raise ConfigError(f"scheme must name one of the runtimes {', '.join(PEERS)}, got {scheme!r}")
    return peer


def peer_ranges(peer: Peer, q_lens: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The ``[first, end)`` sequence ranges ``peer`` runs one engine step of sequences
    with ``q_lens`` new tokens as, one forward each: ``tpu`` the whole step;
    ``gaudi`` and ``rbln`` each prompt alone and a step's decodes together
    (:func:`~attnpolicy.graphs.plan_rules.row_groups` with one prompt a range: the
    runtimes put a step's decodes first, so they run as one batch; a one-token prefill
    chunk after the prompts is a decode to them and runs as a second decode batch)."""
    if peer == "tpu":
        return ((0, len(q_lens)),) if q_lens else ()
    return plan_rules.row_groups(q_lens, prompt_rows=1)


def step_forwards(peer: Peer, q_lens: Sequence[int], kv_lens: Sequence[int],
                  limits: PeerLimits) -> tuple[Forward, ...]:
    """The forwards ``peer`` runs for one engine step of sequences with ``q_lens``
    new tokens over ``kv_lens`` tokens in all (context included), one per
    :func:`peer_ranges` range, in order, under its defaults (both of vllm-gaudi's
    strategies run steps alike):

    - ``gaudi`` (vllm_gaudi/v1/worker/hpu_model_runner.py at the commit above: a
      sequence of one new token is a decode, every other a prompt): each prompt alone
      (batch 1, ``VLLM_PROMPT_BS_BUCKET_MAX``'s default) with its ⌈context / block⌉
      context blocks, and the step's decodes as one batch with the sum of their
      ⌈kv tokens / block⌉ blocks;
    - ``rbln``: each prompt (a prefill chunk) alone, padded to its one prefill graph, and
      the decodes as one batch (vllm_rbln/v1/worker/rbln_model_runner.py);
    - ``tpu``: the whole step as one ragged forward of its requests and tokens."""
    if len(q_lens) != len(kv_lens):
        raise ConfigError(f"q_lens and kv_lens must have one length per sequence, got {len(q_lens)} and {len(kv_lens)}")
    block = limits.block_size  # gaudi: a context in blocks, -(-n // block) = ceil(n / block)
    out = []
    for first, end in peer_ranges(peer, q_lens):
        q, kv = q_lens[first:end], kv_lens[first:end]
        tokens, keys = sum(q), sum(kv)
        if peer == "tpu":
            shape: tuple[Phase, int, int, int | None] = ("mixed", len(q), tokens, None)
        elif q[0] != 1:
            shape = ("prefill", 1, q[0], None if peer == "rbln" else -((q[0] - kv[0]) // block))
        else:
            shape = ("decode", len(q), 1, None if peer == "rbln" else sum(-(-n // block) for n in kv))
        out.append(Forward(*shape, tokens, keys - tokens, sum(map(operator.mul, q, kv))))
    return tuple(out)


class WorkloadForwards:
    """The forwards each peer runs for a workload's engine ``steps`` under ``limits``
    (:func:`step_forwards`), counted by value, once per peer and kept: what the host
    settings and the coverage table both read."""

    def __init__(self, steps: Sequence[BatchLayout], limits: PeerLimits) -> None:
        self.steps = steps
        self.limits = limits
        self._counted: dict[Peer, Counter[Forward]] = {}

    def of(self, peer: Peer) -> Counter[Forward]:
        """``peer``'s forwards with how many times each runs (do not change it)."""
        counted = self._counted.get(peer)
        if counted is None:
            counted = self._counted[peer] = Counter(
                f for layout in self.steps for f in step_forwards(peer, layout.q_lens, layout.kv_lens, self.limits))
        return counted


#: The schemes by name, each under its peer's defaults.
WARMUPS: dict[str, Callable[[PeerLimits], PeerWarmSet]] = {
    "gaudi-linear": partial(gaudi_warmup, strategy="linear"),
    "gaudi-exponential": partial(gaudi_warmup, strategy="exponential"),
    "rbln": rbln_warmup,
    "tpu": lambda limits: tpu_paddings(limits).warmup(),
}
