"""The rules a batch's calls are planned by, written once for one call and for many.

Each rule takes Python ints and bools or numpy arrays of them alike (element-wise):
the dispatcher's :class:`~attnpolicy.dispatch.batch_plan.BatchPlanner` applies it to one
call, the planner's :class:`~attnpolicy.planning.call_table.CallTable` to every call
of a workload at once, so both plan by the same rule (callers look the rules up on
this module when they run, so a test may swap one for both). Given numbers a rule
answers a bool, given arrays an array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def runs_causal(causal: bool | np.ndarray, q_len: int | np.ndarray, kv_len: int | np.ndarray) -> bool | np.ndarray:
    """Whether a sequence of a VARLEN batch runs through the CAUSAL graph of its bucket:
    causal and without cached context."""
    return causal & (q_len == kv_len)


def uncompiled(q_bucket: int | np.ndarray, kv_bucket: int | np.ndarray,
               largest: int | np.ndarray) -> bool | np.ndarray:
    """Whether a call of these buckets runs uncompiled (``on_overflow='eager'``): one of
    them is above ``largest``, the largest bucket of its kind's limit (``max_batch_tokens``
    for a MASK call, ``max_seq_len`` for any other), where a length keeps its own size."""
    return (q_bucket > largest) | (kv_bucket > largest)


def mask_over(q_bucket: int | np.ndarray, kv_bucket: int | np.ndarray, max_mask_bytes: int) -> bool | np.ndarray:
    """Whether the dense mask of a MASK call of these buckets is over ``max_mask_bytes``
    (one byte a cell): its batch runs in VARLEN instead (or raises under
    ``on_overflow='raise'``), and a MASK graph of them never serves a pad-up."""
    return q_bucket * kv_bucket > max_mask_bytes


def row_groups(q_lens: Sequence[int], max_rows: int | None = None, *,
               prompt_rows: int | None = None) -> tuple[tuple[int, int], ...]:
    """The ``[first, end)`` sequence ranges a rows batch runs as, one call (one forward at
    model level) each: runs of consecutive sequences of one phase, decodes (one query row)
    apart from prefills, as static-graph runtimes schedule them (a decode row is never
    padded to a prompt's length), at most ``max_rows`` (``None``: no limit) a range and
    at most ``prompt_rows`` a range of prefills (vllm-gaudi's and vllm-rbln's 1: each
    prompt alone). Runtimes put a step's decodes first, so a step runs as one range per
    phase."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(q_lens) + 1):
        cap = prompt_rows if prompt_rows is not None and q_lens[first] != 1 else max_rows
        if (i == len(q_lens) or (q_lens[i] == 1) != (q_lens[first] == 1)
                or (cap is not None and i - first == cap)):
            groups.append((first, i))
            first = i
    return tuple(groups)


def rows_length(longest: int | np.ndarray, bucketed: int | np.ndarray) -> int | np.ndarray:
    """The length of a rows call (or forward) of one :func:`row_groups` range, of its
    queries or its keys, given its longest row's length and that length's bucket: 1 when
    the longest is 1 (every row holds one: decodes' queries, as static-graph runtimes'
    ``[rows, 1]`` decode graphs), else the bucket."""
    return bucketed - (bucketed - 1) * (longest == 1)
