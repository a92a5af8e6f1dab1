"""Turn (layout, mode, bucketing) into the graph calls that compute it."""

from __future__ import annotations

from collections.abc import Callable

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode, check_legal
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.keys import Call


def exact(n: int) -> int:
    """The identity bucketing: every length is its own graph size."""
    return n


def plan_calls(layout: BatchLayout, mode: MaskMode, bucket: Callable[[int], int] = exact,
               batch_bucket: Callable[[int], int] | None = None, rows_bucket: Callable[[int], int] = exact,
               max_rows: int | None = None) -> tuple[Call, ...]:
    """The calls that compute ``layout`` in ``mode`` (raises if the mode is illegal).

    ``bucket`` rounds one sequence's length up to a compiled size; ``batch_bucket``
    (default: ``bucket``) rounds the packed row counts of a MASK call; ``rows_bucket``
    rounds a ROWS call's sequence count up to its row count; a ROWS batch runs as one
    call per :func:`~attnpolicy.graphs.plan_rules.row_groups` range (decodes apart from
    prefills, at most ``max_rows`` sequences a call; default: no limit), in order.

    VARLEN runs a causal sequence without context through the CAUSAL graph of its
    bucket (mask-free, shared with single-sequence batches); any other sequence
    (cached context, bidirectional) runs a per-sequence VARLEN graph whose bounds
    arrive as a tensor, so it never needs a host-built mask either.
    """
    check_legal(mode, layout)
    if mode is MaskMode.CAUSAL:
        n = layout.q_tokens
        b = bucket(n)
        return (Call(CallKind.CAUSAL, 0, n, 0, n, b, b, True),)
    if mode is MaskMode.MASK:
        batch_bucket = batch_bucket or bucket
        return (Call(CallKind.MASK, 0, layout.q_tokens, 0, layout.kv_tokens,
                     batch_bucket(layout.q_tokens), batch_bucket(layout.kv_tokens), layout.causal),)
    if mode is MaskMode.ROWS:
        return tuple(_rows_call(layout, first, end, bucket, rows_bucket)
                     for first, end in plan_rules.row_groups(layout.q_lens, max_rows))
    calls = []
    for qs, ql, ks, kl in zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens):
        if plan_rules.runs_causal(layout.causal, ql, kl):
            b = bucket(ql)
            calls.append(Call(CallKind.CAUSAL, qs, ql, ks, kl, b, b, True))
        else:
            calls.append(Call(CallKind.VARLEN, qs, ql, ks, kl, bucket(ql), bucket(kl), layout.causal))
    return tuple(calls)


def _rows_call(layout: BatchLayout, first: int, end: int, bucket: Callable[[int], int],
               rows_bucket: Callable[[int], int]) -> Call:
    """The ROWS call of ``layout``'s sequences ``[first, end)``."""
    q_lens, kv_lens = layout.q_lens[first:end], layout.kv_lens[first:end]
    qs, ks = layout.q_starts[first], layout.kv_starts[first]
    q_end, kv_end = layout.q_starts[end - 1] + q_lens[-1], layout.kv_starts[end - 1] + kv_lens[-1]
    context = any(kl > ql for ql, kl in zip(q_lens, kv_lens))
    q_bucket, kv_bucket = (int(plan_rules.rows_length(n, bucket(n))) for n in (max(q_lens), max(kv_lens)))
    return Call(CallKind.ROWS, qs, q_end - qs, ks, kv_end - ks, q_bucket, kv_bucket, layout.causal, True, first,
                end - first, rows_bucket(end - first), context)
