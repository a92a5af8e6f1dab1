"""A plan in each host runtime's own units, written as ``host_settings.json``.

- vLLM (``"vllm"``): its ``compilation_config`` sizes count a step's tokens (the new
  tokens of every sequence in the step), not an attention call's length. They are
  chosen from the workload's step stream (:func:`step_sizes`): at most ``max_sizes``
  sizes on vLLM's own capture grid (1, 2, 4, then multiples of 8 below 256 and of
  16 from 256, or ``max_num_batched_tokens`` itself), the largest covering the
  largest step, that pad the steps by the fewest tokens.
  ``cudagraph_capture_sizes`` and ``compile_sizes`` are that list,
  ``max_cudagraph_capture_size`` its last size, and ``max_num_batched_tokens`` the
  step budget they were chosen under: what vLLM's ``VllmConfig`` keeps unchanged.
- Static-graph runtimes (``"static"``: tt-xla, RBLN, Neuron, TPU) pad attention
  lengths to the planned buckets themselves: ``sequence_padding``, the sizes a
  sequence pads to (those within ``max_seq_len``), and ``packed_padding``, the
  sizes a MASK call's packed rows pad to (the whole list).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from attnpolicy.errors import ConfigError


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


def step_sizes(step_tokens: Iterable[int], max_num_batched_tokens: int, max_sizes: int) -> tuple[int, ...]:
    """At most ``max_sizes`` sizes of :func:`vllm_grid`, the last one the largest step's,
    that pad the steps of ``step_tokens`` (each step's token count, at most
    ``max_num_batched_tokens``) by the fewest tokens in all: a step runs at the
    smallest size that holds it. Exact: dynamic programming over the grid sizes the
    steps round up to, ``best[k][j] = min_i best[k-1][i] + pad(i, j]``."""
    if max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if max_sizes < 1:
        raise ConfigError(f"max_sizes must be >= 1, got {max_sizes}")
    counts = Counter(step_tokens)
    if not counts:
        raise ConfigError("host settings need at least one step, got none (empty workload)")
    for n in counts:
        if not 1 <= n <= max_num_batched_tokens:
            raise ConfigError(f"a step of {n} tokens is outside 1..max_num_batched_tokens "
                              f"({max_num_batched_tokens})")
    grid: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    for n, c in counts.items():
        g = vllm_grid(n, max_num_batched_tokens)
        grid[g] += c
        tokens[g] += n * c
    cand = np.array(sorted(grid), dtype=float)
    m = cand.size
    k_max = min(max_sizes, m)
    steps = np.concatenate([[0.0], np.cumsum([grid[int(g)] for g in cand])])
    held = np.concatenate([[0.0], np.cumsum([tokens[int(g)] for g in cand])])
    best = np.full((k_max + 1, m + 1), np.inf)
    arg = np.zeros((k_max + 1, m + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, m + 1):  # a size at cand[j-1] holding the steps of cand[i..j-1]
        pad = cand[j - 1] * (steps[j] - steps[:j]) - (held[j] - held[:j])
        total = best[:k_max, :j] + pad
        at = np.argmin(total, axis=1)
        best[1:, j], arg[1:, j] = total[np.arange(k_max), at], at
    sizes, j, k = [], m, k_max
    while k > 0 and j > 0:
        sizes.append(int(cand[j - 1]))
        j, k = int(arg[k, j]), k - 1
    return tuple(sorted(sizes))


def host_settings(step_tokens: Iterable[int], buckets: Sequence[int], max_num_batched_tokens: int,
                  max_seq_len: int, max_sizes: int) -> dict[str, Any]:
    """The host settings of a plan (module docstring): vLLM's from the token counts of
    the workload's steps (:func:`step_sizes`), static runtimes' from the planned
    ``buckets`` (sorted, deduplicated)."""
    if max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be >= 1, got {max_seq_len}")
    sizes = list(step_sizes(step_tokens, max_num_batched_tokens, max_sizes))
    padding = sorted(set(buckets))
    return {"vllm": {"compilation_config": {"cudagraph_capture_sizes": sizes,
                                            "max_cudagraph_capture_size": sizes[-1],
                                            "compile_sizes": sizes},
                     "max_num_batched_tokens": max_num_batched_tokens},
            "static": {"sequence_padding": [b for b in padding if b <= max_seq_len],
                       "packed_padding": padding}}
