"""A planned bucket list in the host runtime's own terms.

- vLLM: ``compilation_config`` with ``compile_sizes`` (the batch token counts
  compiled for) and ``cudagraph_capture_sizes`` (the ones captured), the planned
  sizes up to ``max_num_batched_tokens``;
- static-graph runtimes (tt-xla, RBLN, Neuron, TPU): ``token_padding``, the sizes
  a batch's tokens are padded up to.

Written as ``host_settings.json`` next to ``plan.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnpolicy.errors import ConfigError


def host_settings(buckets: Sequence[int], max_num_batched_tokens: int) -> dict[str, Any]:
    """The host settings of ``buckets`` (sorted, deduplicated) for a server whose steps
    hold at most ``max_num_batched_tokens`` tokens (vLLM's lists are empty when no
    planned size is that small: every step then runs uncompiled sizes)."""
    if max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    sizes = sorted(set(buckets))
    served = [n for n in sizes if n <= max_num_batched_tokens]
    return {"vllm": {"compilation_config": {"compile_sizes": served, "cudagraph_capture_sizes": served},
                     "max_num_batched_tokens": max_num_batched_tokens},
            "token_padding": sizes}
