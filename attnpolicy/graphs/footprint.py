"""What a compiled graph pins in memory, computed from its key's static shapes.

A static-shape runtime (torch.compile with ``dynamic=False``, XLA, vendor
compilers) allocates a graph's input, output and intermediate buffers for its
exact shapes. ``graph_bytes`` adds up the ones attention needs:

- q and the output: ``heads × q_len × head_dim`` each, k and v:
  ``kv_heads × kv_len × head_dim`` each, at the tensor dtype's size;
- MASK graphs: the dense boolean mask input, ``q_len × kv_len`` bytes; VARLEN
  graphs build the same-sized boolean mask inside the graph;
- workspace of the implementation: ``eager`` materialises fp32 scores
  ``heads × q_len × kv_len``; ``flash`` one fp32 partition of scores
  ``heads × q_len × partition_len`` plus its fp32 accumulator; ``sdpa`` is a fused
  kernel that tiles internally, so no L² workspace is counted.

It is an estimate of what the graph pins, not a measurement of the process; pass
your own ``sizeof`` to :class:`~attnpolicy.cache.graph_cache.GraphCache` to measure instead.
"""

from __future__ import annotations

from attnpolicy.core.modes import CallKind
from attnpolicy.graphs.keys import GraphKey

FP32 = 4


def graph_bytes(key: GraphKey) -> int:
    s = key.spec
    q_elems = s.heads * key.q_len * s.head_dim
    kv_elems = s.kv_heads * key.kv_len * s.head_dim
    total = (2 * q_elems + 2 * kv_elems) * s.itemsize
    if key.kind is not CallKind.CAUSAL:
        total += key.q_len * key.kv_len
    if key.impl == "eager":
        total += FP32 * s.heads * key.q_len * key.kv_len
    elif key.impl == "flash":
        part = min(key.partition_len or key.kv_len, key.kv_len)
        total += FP32 * s.heads * key.q_len * (part + s.head_dim)
    return total
