"""A plan in each host runtime's own units, written as ``host_settings.json`` (and, for
vllm-gaudi, its bucketing file next to it).

- vLLM (``"vllm"``): its ``compilation_config`` sizes count a step's tokens (the new
  tokens of every sequence in the step), not an attention call's length. They are
  chosen from the workload's step stream (:func:`step_sizes`): at most ``max_sizes``
  sizes on vLLM's own capture grid (1, 2, 4, then multiples of 8 below 256 and of
  16 from 256, or ``max_num_batched_tokens`` itself), the largest covering the
  largest step, that pad the steps by the fewest tokens.
  ``cudagraph_capture_sizes`` and ``compile_sizes`` are that list,
  ``max_cudagraph_capture_size`` its last size, and ``max_num_batched_tokens`` the
  step budget they were chosen under: what vLLM's ``VllmConfig`` keeps unchanged.
- vllm-gaudi (``"gaudi"``, :func:`gaudi_settings`): prompt buckets (batch, query
  tokens, context blocks) and decode buckets (batch, blocks) as its bucketing file
  (``VLLM_BUCKETING_FROM_FILE``) and the environment that makes it warm up exactly them.
- tpu-inference (``"tpu"``, :func:`tpu_settings`): token paddings (step tokens) and
  attention request paddings (requests per step), as its environment and vLLM's
  ``additional_config``.
- vllm-rbln (``"rbln"``, :func:`rbln_settings`): decode batch buckets (decoding
  requests per step) as its manual bucket list.
- Static-graph runtimes (``"static"``: tt-xla, RBLN, Neuron, TPU) pad attention
  lengths to the planned buckets themselves: ``sequence_padding``, the sizes a
  sequence pads to (those within ``max_seq_len``), and ``packed_padding``, the
  sizes a MASK call's packed rows pad to (the whole list).

Each section holds ``missing``: what of the plan its settings cannot say (empty when
they say all of it); nothing else is emitted in its place. Every runtime's rules are
those of :mod:`attnpolicy.modelling.peer_buckets`, read at the commits its docstring
names.

A joint prompt and decode plan (:class:`PlannedForms`) gives every section its own
sets instead: vllm-gaudi's its buckets, tpu-inference's and vLLM's its token paddings,
vllm-rbln's its decode batches, each section's ``missing`` naming what the plan's
budget leaves out (and the bucketing file, as ``# missing:`` lines).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    GAUDI_LONG_CONTEXT,
    TPU_MIN_TOKEN_BUCKET,
    Forward,
    LinearRange,
    PeerLimits,
    PeerWarmSet,
    WorkloadForwards,
    gaudi_decode_bucket,
    gaudi_decode_graphs,
    gaudi_file_warmup,
    gaudi_prompt_graphs,
    gaudi_prompt_refusal,
    rbln_env_warmup,
    tpu_env_paddings,
    tpu_paddings,
)


def vllm_grid(n: int, max_num_batched_tokens: int) -> int:
    """The smallest size of vLLM's default capture grid that holds ``n`` tokens
    (1, 2, 4, multiples of 8 below 256, multiples of 16 from 256), or
    ``max_num_batched_tokens`` when that is smaller (vLLM captures it off the grid)."""
    if n <= 4:
        up = 1 << (n - 1).bit_length()
    elif n < 256:
        up = -(-n // 8) * 8
    else:
        up = -(-n // 16) * 16
    return min(up, max_num_batched_tokens)


def fewest_padding(counts: Counter[int], grid: Callable[[int], int], max_sizes: int) -> tuple[int, ...]:
    """At most ``max_sizes`` sizes, each ``grid(n)`` of some ``n`` counted in ``counts``
    (value: how many times), the largest ``grid`` of the largest value, that pad the
    values by the fewest units in all: a value pads to the smallest size that holds it.
    ``grid`` must not decrease and must hold its argument. Exact: dynamic programming
    over the grid sizes the values round up to, ``best[k][j] = min_i best[k-1][i] + pad(i, j]``."""
    if max_sizes < 1:
        raise ConfigError(f"max_sizes must be >= 1, got {max_sizes}")
    if not counts:
        raise ConfigError("host settings need at least one step, got none (empty workload)")
    rounded: Counter[int] = Counter()
    held: Counter[int] = Counter()
    for n, c in counts.items():
        g = grid(n)
        rounded[g] += c
        held[g] += n * c
    cand = np.array(sorted(rounded), dtype=float)
    m = cand.size
    k_max = min(max_sizes, m)
    count = np.concatenate([[0.0], np.cumsum([rounded[int(g)] for g in cand])])
    units = np.concatenate([[0.0], np.cumsum([held[int(g)] for g in cand])])
    best = np.full((k_max + 1, m + 1), np.inf)
    arg = np.zeros((k_max + 1, m + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, m + 1):  # a size at cand[j-1] holding the values of cand[i..j-1]
        pad = cand[j - 1] * (count[j] - count[:j]) - (units[j] - units[:j])
        total = best[:k_max, :j] + pad
        at = np.argmin(total, axis=1)
        best[1:, j], arg[1:, j] = total[np.arange(k_max), at], at
    sizes, j, k = [], m, k_max
    while k > 0 and j > 0:
        sizes.append(int(cand[j - 1]))
        j, k = int(arg[k, j]), k - 1
    return tuple(sorted(sizes))


def step_sizes(step_tokens: Iterable[int], max_num_batched_tokens: int, max_sizes: int) -> tuple[int, ...]:
    """:func:`fewest_padding` of the token counts of ``step_tokens`` (each at most
    ``max_num_batched_tokens``) on :func:`vllm_grid`: at most ``max_sizes`` sizes, the
    last one the largest step's, a step running at the smallest size that holds it."""
    if max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    counts = Counter(step_tokens)
    for n in counts:
        if not 1 <= n <= max_num_batched_tokens:
            raise ConfigError(f"a step of {n} tokens is outside 1..max_num_batched_tokens "
                              f"({max_num_batched_tokens})")
    return fewest_padding(counts, lambda n: vllm_grid(n, max_num_batched_tokens), max_sizes)


def counts_sizes(values: Iterable[int], max_sizes: int, top: int | None = None) -> tuple[int, ...]:
    """:func:`fewest_padding` of ``values`` on every integer (a runtime that takes any
    size), the largest value standing for ``top`` where given (a size the runtime
    always has, at least the largest value)."""
    counts = Counter(values)
    if not counts:
        raise ConfigError("host settings need at least one value to size, got none")
    largest = max(counts)
    if top is not None and top < largest:
        raise ConfigError(f"a value {largest} is above the runtime's largest size {top}")
    cover = largest if top is None else top
    return fewest_padding(counts, lambda n: cover if n == largest else n, max_sizes)


def _up(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of ascending ``sizes`` that holds ``n``, or ``None``."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def _pad(sizes: Sequence[int], n: int) -> int:
    """The smallest of ascending ``sizes`` (chosen to hold every ``n`` asked) that holds ``n``."""
    up = _up(sizes, n)
    if up is None:
        raise ConfigError(f"no size of {list(sizes)} holds {n}")
    return up


def _within_seqs(counts: Iterable[int], max_num_seqs: int, what: str) -> tuple[list[int], list[str]]:
    """The per-step ``counts`` within ``max_num_seqs``, and a ``missing`` line for each
    distinct one above it (a step such a server never runs)."""
    counted = list(counts)
    above = sorted({n for n in counted if n > max_num_seqs})
    notes = [f"a step of {n} {what}: more than max_num_seqs ({max_num_seqs}), left out" for n in above]
    return [n for n in counted if n <= max_num_seqs], notes


# -- vllm-gaudi ---------------------------------------------------------------------------

#: The bucketing file's name, next to ``host_settings.json``.
GAUDI_FILE = "gaudi_buckets.txt"


@dataclass(frozen=True)
class GaudiBuckets:
    """vllm-gaudi's buckets of a plan: ``prompt`` (batch, query tokens, context blocks),
    ``decode`` (batch, blocks), both ascending, and ``missing``, what of the plan they
    cannot hold."""

    prompt: tuple[tuple[int, int, int], ...]
    decode: tuple[tuple[int, int], ...]
    missing: tuple[str, ...]

    @classmethod
    def of(cls, warm: PeerWarmSet, outside: Sequence[str] = ()) -> GaudiBuckets:
        """The buckets of a warm set of vllm-gaudi's form (prefill and decode graphs)
        planned under a budget, ``outside``: what the budget leaves out of it; a phase
        without a bucket is named too (vllm-gaudi refuses the file)."""
        prompt = tuple((g.batch, g.query_tokens, g.context_blocks or 0) for g in warm.phase("prefill"))
        decode = tuple((g.batch, g.context_blocks or 0) for g in warm.phase("decode"))
        empty = [_no_bucket(phase, f"the plan has no {phase} bucket within its budget")
                 for phase, buckets in (("prompt", prompt), ("decode", decode)) if not buckets]
        return cls(prompt, decode, (*outside, *empty))

    def file_text(self, limits: PeerLimits) -> str:
        """The buckets as vllm-gaudi's bucketing file: one ``(batch, query, blocks)``
        line per bucket, decode lines with query 1 (how the file tells them apart), and
        a ``# missing:`` comment line per entry of ``missing``."""
        return "\n".join([
            "# vllm-gaudi buckets of an attnpolicy plan; use with VLLM_BUCKETING_FROM_FILE=<this file>",
            (f"# and block_size {limits.block_size}, max_model_len {limits.max_model_len}, "
             f"max_num_batched_tokens {limits.max_num_batched_tokens} (host_settings.json \"gaudi\")"),
            *(f"# missing: {line}" for line in self.missing),
            "# prompt: (batch_size, query_len, context_blocks)",
            *(f"({b}, {q}, {c})" for b, q, c in self.prompt),
            "# decode: (batch_size, 1, blocks)",
            *(f"({b}, 1, {n})" for b, n in self.decode), ""])


def _no_bucket(phase: str, why: str) -> str:
    """The ``missing`` line of a phase without a vllm-gaudi bucket, ``why``."""
    return f"{phase}: {why}, and vllm-gaudi refuses a bucketing file without a {phase} bucket"


def gaudi_buckets(forwards: Counter[Forward], buckets: Sequence[int], limits: PeerLimits,
                  max_sizes: int) -> GaudiBuckets:
    """The buckets vllm-gaudi needs to run the plan's steps (their vllm-gaudi
    ``forwards``, counted) as the plan pads them
    (vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707,
    vllm_gaudi/v1/worker/hpu_model_runner.py: a sequence of one new token is a decode,
    every other a prompt; ``_bucketize_2d_prompt``, ``_create_decode_input_data``):

    - prompt: each prompting sequence alone (batch 1, vllm-gaudi's default
      ``VLLM_PROMPT_BS_BUCKET_MAX``), its query tokens padded to the smallest planned
      ``bucket`` that holds them, its context ⌈context tokens / block⌉ blocks padded to
      one of at most ``max_sizes`` context sizes (:func:`counts_sizes`);
    - decode: a step's decoding sequences as one batch, padded to one of at most
      ``max_sizes`` batch sizes, and the sum of their ⌈kv tokens / block⌉ blocks, padded
      to one of at most ``max_sizes`` block sizes, then at least the batch (vllm-gaudi
      drops a decode bucket of fewer blocks than sequences) and cut as vllm-gaudi cuts
      it (:func:`~attnpolicy.modelling.peer_buckets.gaudi_decode_bucket`).

    A prompt no planned bucket holds, a bucket vllm-gaudi would drop
    (:func:`~attnpolicy.modelling.peer_buckets.gaudi_prompt_refusal`) and a phase
    without any step are named in ``missing`` instead."""
    planned = sorted(set(buckets))
    prompts: list[tuple[int, int]] = []
    decodes: list[tuple[int, int]] = []
    for f, n in forwards.items():
        assert f.context_blocks is not None  # vllm-gaudi pads every context to blocks
        if f.phase == "decode":
            decodes += [(f.batch, f.context_blocks)] * n
        else:
            prompts += [(f.query_tokens, f.context_blocks)] * n
    missing: list[str] = []
    prompt: set[tuple[int, int, int]] = set()
    if prompts:
        contexts = counts_sizes((c for _, c in prompts), max_sizes)
        for q, c in prompts:
            qb = _up(planned, q)
            if qb is None:
                missing.append(f"prompt of {q} query tokens: no planned bucket holds it (the largest is "
                               f"{planned[-1] if planned else None})")
                continue
            bucket = (1, qb, _pad(contexts, c))
            refusal = gaudi_prompt_refusal(limits, *bucket)
            if refusal is not None:
                missing.append(f"prompt bucket {bucket}: vllm-gaudi drops it ({refusal})")
            else:
                prompt.add(bucket)
    else:
        missing.append(_no_bucket("prompt", "the plan has no prompt step"))
    decode: set[tuple[int, int]] = set()
    if decodes:
        batches = counts_sizes((n for n, _ in decodes), max_sizes)
        sizes = counts_sizes((k for _, k in decodes), max_sizes)
        for n, k in decodes:
            b = _pad(batches, n)
            g = gaudi_decode_bucket(limits, b, max(b, _pad(sizes, k)))  # kept: batch <= blocks
            if g is not None and g.context_blocks is not None:
                decode.add((g.batch, g.context_blocks))
    else:
        missing.append(_no_bucket("decode", "the plan has no decode step"))
    return GaudiBuckets(tuple(sorted(prompt)), tuple(sorted(decode)), tuple(dict.fromkeys(missing)))


def linear_range(values: Iterable[int]) -> LinearRange | None:
    """The vllm-gaudi linear range (min, step, max) whose values
    (:class:`~attnpolicy.modelling.peer_buckets.LinearRange`) are exactly ``values``,
    the smallest step first, or ``None`` when there is none."""
    want = tuple(sorted(set(values)))
    if not want:
        return None
    for step in range(1, max(want[-1], 1) + 1):
        candidate = LinearRange(want[0], step, want[-1])
        try:
            if candidate.values() == want:
                return candidate
        except ConfigError:
            continue
    return None


#: vllm-gaudi's range variables, by the bucket dimension they set (bucketing/linear.py ``read_bucket_settings``).
GAUDI_RANGE_VARIABLES = ("PROMPT_BS", "PROMPT_QUERY", "PROMPT_CTX", "DECODE_BS", "DECODE_BLOCK")


def gaudi_strategy_env(gaudi: GaudiBuckets, limits: PeerLimits) -> tuple[dict[str, str] | None, str | None]:
    """The environment of vllm-gaudi's linear strategy (``VLLM_BUCKETING_STRATEGY=lin``
    and ``VLLM_{PROMPT_BS,PROMPT_QUERY,PROMPT_CTX,DECODE_BS,DECODE_BLOCK}_BUCKET_{MIN,STEP,MAX}``;
    vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707, bucketing/linear.py, common.py)
    that generates exactly ``gaudi``'s buckets without the file, and ``None``; or
    ``None`` and why no such environment exists: the strategy warms up the Cartesian
    product of one linear range per dimension (then filters it), which a plan's buckets
    rarely are."""
    if limits.max_model_len >= GAUDI_LONG_CONTEXT:
        return None, (f"from max_model_len {GAUDI_LONG_CONTEXT} on, vllm-gaudi's strategies rewrite the largest "
                      f"context of every prompt bucket; use the bucketing file")
    dims = ({b for b, _, _ in gaudi.prompt}, {q for _, q, _ in gaudi.prompt}, {c for _, _, c in gaudi.prompt},
            {b for b, _ in gaudi.decode}, {n for _, n in gaudi.decode})
    ranges = []
    for name, values in zip(GAUDI_RANGE_VARIABLES, dims):
        found = linear_range(values)
        if found is None:
            return None, f"{name.lower()} values {sorted(values)} are no linear range (min, step, max)"
        ranges.append(found)
    bs, query, ctx, decode_bs, blocks = (r.values() for r in ranges)
    prompt = {(g.batch, g.query_tokens, g.context_blocks) for g in gaudi_prompt_graphs(limits, bs, query, ctx)}
    decode = {(g.batch, g.context_blocks) for g in gaudi_decode_graphs(limits, decode_bs, blocks)}
    if prompt != set(gaudi.prompt) or decode != set(gaudi.decode):
        return None, "the buckets are not the product of one linear range per dimension; use the bucketing file"
    env = {"VLLM_BUCKETING_STRATEGY": "lin"}
    for name, r in zip(GAUDI_RANGE_VARIABLES, ranges):
        env.update({f"VLLM_{name}_BUCKET_MIN": str(r.min), f"VLLM_{name}_BUCKET_STEP": str(r.step),
                    f"VLLM_{name}_BUCKET_MAX": str(r.max)})
    return {**env, "VLLM_CONTIGUOUS_PA": "false"}, None


def gaudi_settings(gaudi: GaudiBuckets, limits: PeerLimits, bucketing_file: str) -> dict[str, Any]:
    """The ``"gaudi"`` section: the buckets, the server limits they hold for (vLLM's
    ``block_size``, ``max_model_len``, ``max_num_batched_tokens``) and ``env``, the
    variables that make vllm-gaudi warm up exactly the file's buckets
    (vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707, vllm_gaudi/extension/features.py,
    bucketing/common.py, v1/worker/hpu_model_runner.py): ``VLLM_BUCKETING_FROM_FILE``
    (the file, which replaces every bucketing strategy and its ``VLLM_*_BUCKET_*``
    ranges), ``VLLM_PROMPT_BS_BUCKET_MAX`` (the runner's largest prompt batch, the
    file's) and ``VLLM_CONTIGUOUS_PA=false`` (the decode filter the buckets are cut by);
    ``strategy_env``, the same buckets from the linear strategy's ranges instead, or
    ``null`` and ``strategy_missing``, why they cannot (:func:`gaudi_strategy_env`)."""
    largest_prompt_batch = max((b for b, _, _ in gaudi.prompt), default=1)
    strategy, why = (None, "part of the plan is not expressed (see missing)") if gaudi.missing \
        else gaudi_strategy_env(gaudi, limits)
    return {"bucketing_file": bucketing_file,
            "env": {"VLLM_BUCKETING_FROM_FILE": bucketing_file,
                    "VLLM_PROMPT_BS_BUCKET_MAX": str(largest_prompt_batch), "VLLM_CONTIGUOUS_PA": "false"},
            "block_size": limits.block_size, "max_model_len": limits.max_model_len,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
            "prompt_buckets": [list(b) for b in gaudi.prompt], "decode_buckets": [list(b) for b in gaudi.decode],
            "strategy_env": strategy, **({"strategy_missing": why} if why else {}), "missing": list(gaudi.missing)}


# -- tpu-inference ------------------------------------------------------------------------

def tpu_settings(forwards: Counter[Forward], limits: PeerLimits, max_sizes: int,
                 paddings: Sequence[int] | None = None, outside: Sequence[str] = ()) -> dict[str, Any]:
    """The ``"tpu"`` section of the steps' tpu-inference ``forwards`` (counted)
    (tpu-inference@b8692ff01fa191343836996c27a39dc95f008b88,
    tpu_inference/runner/tpu_runner.py ``_init_inputs``, runner/utils.py, envs.py):

    - ``num_tokens_paddings``: at most ``max_sizes`` token counts padding the steps'
      tokens the least (:func:`fewest_padding`), multiples of 16 as every padding
      tpu-inference generates on one device (powers of two from ``MIN_TOKEN_BUCKET``,
      16, which is at least the KV packing they must hold), the largest its own cover:
      the power of two >= max_num_batched_tokens its generator always yields. Set as
      ``MIN_TOKEN_BUCKET`` (that cover, so the generator yields it alone;
      ``VLLM_TPU_BUCKET_PADDING_GAP=0``) and vLLM's
      ``additional_config["compilation_sizes"]`` (the others, which the runner adds).
    - ``attn_num_reqs_paddings``: at most ``max_sizes`` request counts padding the
      steps' requests the least, the largest ``max_num_seqs`` (which the runner appends
      where it is missing), as ``ATTN_BUCKETIZED_NUM_REQS=1`` and
      ``ATTN_CUSTOM_NUM_REQS_BUCKETS``.
    - ``num_reqs_paddings``: the sampling graphs' request paddings, which no setting
      but ``max_num_seqs`` changes (reported, not chosen).

    ``paddings``: token paddings planned already (a ragged plan, multiples of 16 ending at
    that cover), each a graph of ``max_num_seqs`` requests: set as above, with one
    attention request padding, ``max_num_seqs``; none (the plan's budget holds no
    graph): no setting says it, since tpu-inference always compiles that cover, so
    ``env`` is empty and ``missing`` says why. ``outside``: what the plan's budget left
    out, said in ``missing``."""
    budget, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    cover = max(TPU_MIN_TOKEN_BUCKET, 1 << (budget - 1).bit_length())
    planned = None if paddings is None else sorted(set(paddings))
    ragged = list(forwards.elements())
    tokens = Counter(f.tokens for f in ragged)
    if not tokens:
        raise ConfigError("host settings need at least one step, got none (empty workload)")
    top = max(tokens)
    if top > budget:
        raise ConfigError(f"a step of {top} tokens is above max_num_batched_tokens ({budget})")
    step = TPU_MIN_TOKEN_BUCKET
    counts, within = _within_seqs((f.batch for f in ragged), seqs, "requests")
    missing = [*outside, *within]
    if planned is None:
        sizes = fewest_padding(tokens, lambda n: cover if n == top else -(-n // step) * step, max_sizes)
        requests = counts_sizes(counts, max_sizes, top=seqs) if counts else (seqs,)
    elif planned:
        if planned[-1] != cover or any(n % step for n in planned):
            raise ConfigError(f"planned token paddings must be multiples of {step} ending at {cover}, got "
                              f"{list(planned)}")
        sizes, requests = tuple(planned), (seqs,)
    else:
        sizes = requests = ()
        missing.append(f"token paddings: the plan has none within its budget, and tpu-inference always compiles "
                       f"its cover of {cover} tokens: no setting says it, env left empty")
    extra = [s for s in sizes if s != cover]
    env = {"MIN_TOKEN_BUCKET": str(cover), "VLLM_TPU_BUCKET_PADDING_GAP": "0", "ATTN_BUCKETIZED_NUM_REQS": "1",
           "ATTN_CUSTOM_NUM_REQS_BUCKETS": ",".join(map(str, requests))} if sizes else {}
    return {"env": env, "additional_config": {"compilation_sizes": extra},
            "num_tokens_paddings": list(sizes), "attn_num_reqs_paddings": list(requests),
            "num_reqs_paddings": list(tpu_paddings(limits).requests),
            "max_num_batched_tokens": budget, "max_num_seqs": seqs, "missing": missing}


# -- vllm-rbln ----------------------------------------------------------------------------

def rbln_settings(forwards: Counter[Forward], limits: PeerLimits, max_sizes: int,
                  planned: Sequence[int] | None = None,
                  over: Callable[[PeerWarmSet], str | None] | None = None) -> dict[str, Any]:
    """The ``"rbln"`` section of the steps' vllm-rbln ``forwards`` (counted)
    (vllm-rbln@e9ff4c1bc9edcad27bfbd4960310498e5c40c48e, vllm_rbln/rbln_envs.py,
    vllm_rbln/v1/worker/bucketing/manual_bucketing_manager.py):
    ``decode_batch_buckets``, at most ``max_sizes`` batch sizes padding the steps'
    decoding requests the least, the largest ``max_num_seqs`` (vllm-rbln's max batch
    size on one pipeline stage, which its manual list must end at), as
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY=manual`` and
    ``VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS``. vllm-rbln has no setting for its
    prefill graph (one request padded to ``max_num_batched_tokens``): ``missing`` says so.

    ``planned``: decode batches planned already (a joint plan's; empty: its budget holds
    no decode graph, and vllm-rbln warms up ``max_num_seqs`` alone, which its list must
    end at); ``over``: the bound vllm-rbln's warm-up under these settings breaks, if
    any, said in ``missing``."""
    seqs = limits.max_num_seqs
    decoding, missing = _within_seqs((f.batch for f in forwards.elements() if f.phase == "decode"), seqs,
                                     "decoding requests")
    if planned is None:
        batches = counts_sizes(decoding, max_sizes, top=seqs) if decoding else (seqs,)
    else:
        batches = tuple(sorted(set(planned))) or (seqs,)
        if not planned:
            missing.append(f"decode: the plan has no decode graph within its budget, and vllm-rbln's manual list "
                           f"must end at max_num_seqs ({seqs}): it warms up that batch")
    missing.append(f"prefill: vllm-rbln has no setting for its prefill graph, which pads every prefill to "
                   f"max_num_batched_tokens ({limits.max_num_batched_tokens}) at batch 1; the plan's prompt "
                   f"buckets are not expressible")
    env = {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "manual",
           "VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS": ",".join(map(str, batches))}
    why = over(rbln_env_warmup(limits, env)) if over else None
    if why:
        missing.append(f"the budget: vllm-rbln's warm-up under these settings breaks it ({why})")
    return {"env": env, "decode_batch_buckets": list(batches), "max_num_seqs": seqs, "missing": missing}


# -- all hosts ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HostSettings:
    """A plan's host settings: ``sections`` (``host_settings.json``, one per host),
    ``gaudi_file``, the text of vllm-gaudi's bucketing file, and ``forwards``, the
    runtimes' forwards of the steps they were made for (and the server's limits)."""

    sections: dict[str, Any]
    gaudi_file: str
    forwards: WorkloadForwards

    @property
    def limits(self) -> PeerLimits:
        return self.forwards.limits

    def warmup_sets(self) -> tuple[tuple[str, Callable[[], PeerWarmSet]], ...]:
        """What vllm-gaudi, tpu-inference and vllm-rbln warm up under these settings, each
        read back as the runtime reads it (its bucketing file, its environment and
        ``additional_config``) when called (a :class:`ConfigError` where the runtime
        refuses them), as ``gaudi-plan``, ``tpu-plan`` and ``rbln-plan``."""
        tpu, rbln = self.sections["tpu"], self.sections["rbln"]
        return (("gaudi-plan", partial(gaudi_file_warmup, self.gaudi_file, self.limits)),
                ("tpu-plan", lambda: tpu_env_paddings(self.limits, tpu["env"],
                                                      tpu["additional_config"]["compilation_sizes"]).warmup()),
                ("rbln-plan", partial(rbln_env_warmup, self.limits, rbln["env"])))


@dataclass(frozen=True)
class PlannedForms:
    """A joint prompt and decode plan's warm sets under its budget: vllm-gaudi's
    ``gaudi`` buckets (their ``missing`` holding what the budget leaves out of that
    form), ``gaudi_outside`` (that alone), the ragged form's token ``paddings`` (empty:
    none within the budget) and ``ragged_outside``, what the budget leaves out of it;
    ``over``: the bound a warm set breaks under the budget, or ``None``."""

    gaudi: GaudiBuckets
    gaudi_outside: tuple[str, ...]
    paddings: tuple[int, ...]
    ragged_outside: tuple[str, ...]
    over: Callable[[PeerWarmSet], str | None]


def vllm_settings(sizes: Sequence[int], limits: PeerLimits, missing: Sequence[str] = ()) -> dict[str, Any]:
    """The ``"vllm"`` section of capture ``sizes`` (step tokens, ascending, at most
    ``max_num_batched_tokens``); none: ``cudagraph_mode`` ``NONE``, as vLLM itself sets a
    config without capture sizes, every step on its dynamically shaped graph."""
    config: dict[str, Any] = ({"cudagraph_capture_sizes": list(sizes), "max_cudagraph_capture_size": sizes[-1],
                               "compile_sizes": list(sizes)} if sizes else
                              {"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [], "max_cudagraph_capture_size": 0,
                               "compile_sizes": []})
    return {"compilation_config": config, "max_num_batched_tokens": limits.max_num_batched_tokens,
            "missing": list(missing)}


def host_settings(steps: Sequence[BatchLayout], buckets: Sequence[int], limits: PeerLimits, max_sizes: int,
                  bucketing_file: str = GAUDI_FILE, *, forwards: WorkloadForwards | None = None,
                  planned: PlannedForms | None = None) -> HostSettings:
    """The host settings of a plan (module docstring): its ``steps`` (one layout per
    engine step) under the server's ``limits`` (``max_model_len`` is attnpolicy's
    ``max_seq_len``), its planned attention ``buckets``, at most ``max_sizes`` sizes per
    dimension; ``bucketing_file``: where vllm-gaudi is to read its file. ``forwards``:
    the steps' forwards when counted already. ``planned``: a joint prompt and decode
    plan's sets, which every section then holds: vllm-gaudi's its buckets, tpu-inference's
    and vLLM's its token paddings (vLLM's at most ``max_num_batched_tokens``, above which
    vLLM drops a capture size), vllm-rbln's its decode batches; each section's
    ``missing`` says what the plan's budget leaves out of it."""
    forwards = forwards or WorkloadForwards(steps, limits)
    padding = sorted(set(buckets))
    if planned is None:
        gaudi = gaudi_buckets(forwards.of("gaudi"), buckets, limits, max_sizes)
        vllm = vllm_settings(step_sizes([layout.q_tokens for layout in steps], limits.max_num_batched_tokens,
                                        max_sizes), limits)
        tpu = tpu_settings(forwards.of("tpu"), limits, max_sizes)
        rbln = rbln_settings(forwards.of("rbln"), limits, max_sizes)
        static_missing: list[str] = []
    else:
        gaudi, static_missing = planned.gaudi, list(planned.gaudi_outside)
        captured = sorted({min(t, limits.max_num_batched_tokens) for t in planned.paddings})
        none = [] if captured else [("token paddings: the plan has none within its budget: vLLM captures no graph "
                                    "and runs every step on its dynamically shaped graph")]
        vllm = vllm_settings(captured, limits, [*planned.ragged_outside, *none])
        tpu = tpu_settings(forwards.of("tpu"), limits, max_sizes, planned.paddings, planned.ragged_outside)
        rbln = rbln_settings(forwards.of("rbln"), limits, max_sizes, sorted({b for b, _ in gaudi.decode}),
                             planned.over)
    return HostSettings(
        {"vllm": vllm, "gaudi": gaudi_settings(gaudi, limits, bucketing_file), "tpu": tpu, "rbln": rbln,
         "static": {"sequence_padding": [b for b in padding if b <= limits.max_model_len],
                    "packed_padding": padding, "missing": static_missing}},
        gaudi.file_text(limits), forwards)
