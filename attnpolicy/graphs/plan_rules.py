"""The rules a batch's calls are planned by, written once for one call and for many.

Each rule takes Python ints and bools or numpy arrays of them alike (element-wise):
the dispatcher's :class:`~attnpolicy.dispatch.batch_plan.BatchPlanner` applies it to one
call, the planner's :class:`~attnpolicy.planning.call_table.CallTable` to every call
of a workload at once, so both plan by the same rule (callers look the rules up on
this module when they run, so a test may swap one for both). Given numbers a rule
answers a bool, given arrays an array.
"""

from __future__ import annotations

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

