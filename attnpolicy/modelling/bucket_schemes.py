"""Bucket schemes a simulation compares side by side: named :class:`Buckets`.

- ``pow2``: powers of two from 16 (tt-xla's padding; attnpolicy's default);
- ``vllm``: vLLM's default CUDA-graph capture sizes, ``[1, 2, 4] + range(8, 256, 8)
  + range(256, …, 16)`` (``vllm.config.VllmConfig._set_cudagraph_sizes``,
  vLLM 0.32), continued in steps of 16 up to ``max_seq_len`` (vLLM itself stops at 512
  and runs larger batches without a graph);
- ``exact``: every length its own graph (no padding);
- ``gaudi-linear``, ``gaudi-exponential``, ``rbln``, ``tpu``: the peers' own
  warm sets (:mod:`attnpolicy.modelling.peer_buckets`) projected to the lengths
  this level buckets: the query-token sizes of the graphs that serve prefill
  (vllm-gaudi's prompt query buckets, at its block size of 128 and one prompt per
  graph; vllm-rbln's one prefill length; tpu-inference's token paddings), for a
  server with ``max_model_len`` = ``max_seq_len`` and ``max_num_batched_tokens`` =
  the smaller of ``max_seq_len`` and ``max_batch_tokens`` (a sequence's length in
  an attention call; a step's tokens in whole-model graphs, where
  ``max_batch_tokens`` is the batch former's budget). Sizes above
  ``max_batch_tokens`` are left out (tpu-inference's last padding may exceed it);
- a path: the buckets of an attnpolicy config (a JSON file, or a directory holding
  ``attnpolicy_config.json``, such as ``attnpolicy plan`` writes).

A ``list`` scheme must serve every length up to ``max_seq_len`` (one sequence) and
``max_batch_tokens`` (the packed rows of a MASK call), or calls would overflow:
:func:`complete` adds ``max_seq_len`` when the list lacks it (a sequence is
bucketed among the sizes up to ``max_seq_len``), then doubles the last size
(``last·2, last·4, …``) up to ``max_batch_tokens``, which ends the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.modelling.peer_buckets import WARMUPS, PeerLimits

NAMED = ("pow2", "vllm", "exact", *WARMUPS)


@dataclass(frozen=True)
class BucketScheme:
    """Buckets with the name a sweep's rows and tables show."""

    name: str
    buckets: Buckets


def vllm_sizes(max_len: int) -> tuple[int, ...]:
    """vLLM's default capture-size pattern up to ``max_len`` (which ends the list)."""
    sizes = [s for s in (1, 2, 4, *range(8, 256, 8), *range(256, max_len + 1, 16)) if s <= max_len]
    if sizes[-1] < max_len:
        sizes.append(max_len)
    return tuple(sizes)


def peer_sizes(name: str, max_seq_len: int, max_batch_tokens: int) -> tuple[int, ...]:
    """The prefill lengths of the peer scheme ``name`` (module docstring); a
    :class:`ConfigError` naming the scheme and lengths when the peer cannot start
    with those limits."""
    try:
        limits = PeerLimits(max_num_seqs=1, max_num_batched_tokens=min(max_seq_len, max_batch_tokens),
                            max_model_len=max_seq_len)
        return WARMUPS[name](limits).prefill_lengths()
    except ConfigError as exc:
        raise ConfigError(f"bucket scheme {name!r} at max_seq_len={max_seq_len}, "
                          f"max_batch_tokens={max_batch_tokens}: {exc}") from exc


def complete(sizes: Sequence[int], max_seq_len: int, max_batch_tokens: int) -> tuple[int, ...]:
    """``sizes`` extended to serve every length up to ``max_batch_tokens`` (module docstring)."""
    out = sorted({s for s in sizes if s <= max_batch_tokens} | {max_seq_len})
    while out[-1] < max_batch_tokens:
        out.append(min(out[-1] * 2, max_batch_tokens))
    return tuple(out)


def _completed(buckets: Buckets, max_seq_len: int, max_batch_tokens: int) -> Buckets:
    if buckets.kind != "list" or buckets.sizes is None:
        return buckets
    return Buckets(kind="list", sizes=complete(buckets.sizes, max_seq_len, max_batch_tokens))


def scheme_name(buckets: Buckets, max_seq_len: int, max_batch_tokens: int) -> str:
    """The name of the :data:`NAMED` scheme ``buckets`` are (one that cannot be built
    for these lengths is none), else the buckets' description (a long list is
    shortened to its size count and ends)."""
    for name, named in _named_schemes(max_seq_len, max_batch_tokens):
        if buckets == named:
            return name
    if buckets.kind == "list" and buckets.sizes is not None and len(buckets.sizes) > 6:
        s = buckets.sizes
        return f"list({len(s)} sizes: {s[0]}, {s[1]}, … {s[-1]})"
    return buckets.describe()


@cache
def _named_schemes(max_seq_len: int, max_batch_tokens: int) -> tuple[tuple[str, Buckets], ...]:
    """Each :data:`NAMED` scheme that can be built for these lengths, with its buckets
    (built once per lengths: a peer's warm set takes a while to derive)."""
    schemes = []
    for name in NAMED:
        try:
            schemes.append((name, named_buckets(name, max_seq_len, max_batch_tokens)))
        except ConfigError:
            continue
    return tuple(schemes)


def named_buckets(name: str, max_seq_len: int, max_batch_tokens: int) -> Buckets:
    """The buckets of the :data:`NAMED` scheme ``name``."""
    if name == "pow2":
        return Buckets()
    if name == "exact":
        return Buckets(kind="exact")
    if name == "vllm":
        return Buckets(kind="list", sizes=complete(vllm_sizes(max_seq_len), max_seq_len, max_batch_tokens))
    if name in WARMUPS:
        sizes = peer_sizes(name, max_seq_len, max_batch_tokens)
        return Buckets(kind="list", sizes=complete(sizes, max_seq_len, max_batch_tokens))
    raise ConfigError(f"unknown bucket scheme {name!r}: give {', '.join(NAMED)} or the path of an attnpolicy config")


def bucket_scheme(spec: str, max_seq_len: int, max_batch_tokens: int) -> BucketScheme:
    """The scheme ``spec`` names: one of :data:`NAMED` or a config path (its
    buckets, a list completed as the module docstring says). A missing or invalid
    config raises :class:`ConfigError` naming the file."""
    if spec in NAMED or not Path(spec).exists():
        return BucketScheme(spec, named_buckets(spec, max_seq_len, max_batch_tokens))
    buckets = AttnPolicyConfig.load(spec).buckets
    return BucketScheme(spec, _completed(buckets, max_seq_len, max_batch_tokens))


def base_scheme(config: AttnPolicyConfig) -> BucketScheme:
    """The scheme of ``config``'s own buckets, as they are (a recorded run's config
    replays its own overflows), named by :func:`scheme_name`."""
    return BucketScheme(scheme_name(config.buckets, config.max_seq_len, config.max_batch_tokens), config.buckets)
