"""The key of a whole-model graph, pure data: :class:`ModelKey`, a forward over a
batch's new rows and their cached context (a prefill is a step with no context), the
rule that maps a layout and a mode to a step's forwards and their keys (shared by the
runner and the simulator),
which larger graph serves a key padded up, and a graph's static-shape byte estimate.
No torch: a planner or a simulator prices these keys without loading a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.graphs import plan_rules


@dataclass(frozen=True, slots=True)
class ModelKey:
    """One whole-model graph: its mode, padded rows, padded context columns, per-sequence
    ``(rows, context)`` buckets (one pair for MASK and CAUSAL; ROWS: its row bucket's count
    of one pair, every row padded alike) and backend; ``kv``: the graph takes the cached
    context's keys and values and returns its new rows' (a step run with a KV cache), else
    it returns logits only (a prefill whose KV is not kept: no context). ``tokens`` and
    ``context`` are the graph's totals (ROWS: rows times each row's)."""

    mode: MaskMode
    tokens: int
    context: int
    segments: tuple[tuple[int, int], ...]
    backend: str
    kv: bool

    @property
    def rows(self) -> int:
        """The batch rows of the graph's ``[rows, length]`` input: ROWS's row bucket, else 1."""
        return len(self.segments) if self.mode is MaskMode.ROWS else 1

    def __str__(self) -> str:
        if self.mode is MaskMode.ROWS:
            length, context = self.segments[0]
            return (f"step/rows/r{self.rows}t{length}c{context}/{self.backend}" if self.kv
                    else f"model/rows/r{self.rows}t{length}/{self.backend}")
        if not self.kv:
            shape = "+".join(str(t) for t, _ in self.segments) if self.mode is MaskMode.VARLEN else str(self.tokens)
            return f"model/{self.mode.value}/t{shape}/{self.backend}"
        if self.mode is MaskMode.VARLEN:
            shape = "+".join(f"t{t}c{c}" for t, c in self.segments)
        else:
            shape = f"t{self.tokens}c{self.context}"
        return f"step/{self.mode.value}/{shape}/{self.backend}"


def contexts(layout: BatchLayout) -> tuple[int, ...]:
    """Each sequence's cached context: its keys before its query rows."""
    return tuple(kv - q for kv, q in zip(layout.kv_lens, layout.q_lens))


def why_illegal_step(mode: MaskMode, layout: BatchLayout) -> str | None:
    """``None`` when a step graph (``kv``) of ``mode`` computes ``layout`` right: MASK,
    VARLEN and ROWS always; CAUSAL for one causal sequence (its context is exact in its key)."""
    if mode is not MaskMode.CAUSAL:
        return None
    if not layout.causal:
        return "bidirectional"
    return None if layout.num_seqs == 1 else f"{layout.num_seqs} sequences packed"


def forwards(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig) -> tuple[tuple[int, int], ...]:
    """The ``[first, end)`` sequence ranges of ``layout`` that run as one forward each:
    ROWS's :func:`~attnpolicy.graphs.plan_rules.row_groups` (decodes apart from prefills,
    at most the largest of ``config.row_buckets`` a forward), every other mode one forward
    of all."""
    if mode is MaskMode.ROWS:
        return plan_rules.row_groups(layout.q_lens, config.row_buckets[-1])
    return ((0, layout.num_seqs),)


#: One forward of a step: its sequences ``[first, end)`` and the key of the graph they run on.
Part = tuple[int, int, ModelKey]


def step_parts(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig, *, kv: bool) -> tuple[Part, ...]:
    """``layout``'s forwards (:func:`forwards`) in ``mode``, each with its key, in order."""
    return tuple((first, end, model_key_for(layout.sequences(first, end), mode, config, kv=kv))
                 for first, end in forwards(layout, mode, config))


def step_keys(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig, *, kv: bool) -> tuple[ModelKey, ...]:
    """The keys of ``layout``'s forwards (:func:`forwards`), in order: what a step requests."""
    return tuple(key for _, _, key in step_parts(layout, mode, config, kv=kv))


class GraphSet(Protocol):
    """A fixed set of step graphs (``kv`` keys) and the rule that serves a step from them
    in one runtime's form, keys alone: ``name`` says which; ``keys`` are its graphs,
    compiled at warm-up; ``parts(layout)`` the step's forwards, each on the graph that
    serves it (padded up), or on one of its own shape where none does (a run-time
    compile)."""

    @property
    def name(self) -> str: ...
    @property
    def keys(self) -> tuple[ModelKey, ...]: ...
    def parts(self, layout: BatchLayout) -> tuple[Part, ...]: ...


def why_not_held(key: ModelKey, layout: BatchLayout) -> str | None:
    """Why ``key``'s graph cannot hold ``layout``'s sequences in its padded rows and context
    (``None``: it can): ROWS, a row per sequence, each within the row's length and context;
    MASK, every row and context column within its totals; CAUSAL, one sequence within its
    rows over exactly its context. (VARLEN's segments are matched as it is placed.)"""
    ctx = contexts(layout)
    if key.mode is MaskMode.ROWS:
        length, context = key.segments[0]
        if layout.num_seqs > key.rows or max(layout.q_lens) > length or max(ctx) > context:
            return (f"{layout.num_seqs} rows of at most {max(layout.q_lens)} tokens over {max(ctx)} context, "
                    f"the graph {key.rows} of {length} over {context}")
    elif key.mode is MaskMode.MASK and (sum(layout.q_lens) > key.tokens or sum(ctx) > key.context):
        return f"{sum(layout.q_lens)} rows over {sum(ctx)} context, the graph {key.tokens} over {key.context}"
    elif key.mode is MaskMode.CAUSAL and (layout.num_seqs != 1 or layout.q_lens[0] > key.tokens
                                          or ctx[0] != key.context):
        return f"the graph holds one sequence of at most {key.tokens} rows over exactly {key.context} context"
    return None


def filling(key: ModelKey) -> BatchLayout:
    """The layout that fills ``key``'s graph exactly: every segment one causal sequence of
    its rows over its context (ROWS: one per row; MASK and CAUSAL: one of all). What a
    warm-up of ``key`` runs."""
    return BatchLayout.from_lens([t for t, _ in key.segments], [t + c for t, c in key.segments], causal=True)


def segment(rows: int, context: int, config: AttnPolicyConfig) -> tuple[int, int]:
    """A sequence's VARLEN span: its rows' and its context's buckets (no context: 0)."""
    return config.bucket(rows), config.bucket(context) if context else 0


def model_key_for(layout: BatchLayout, mode: MaskMode, config: AttnPolicyConfig, *, kv: bool) -> ModelKey:
    """The graph key ``layout`` runs under in ``mode`` with ``config``'s buckets and
    backend, ``kv`` as :class:`ModelKey`'s (pure: the runner and a simulator share it).
    A sequence's rows and context are bucketed by ``config.bucket`` (at most
    ``max_seq_len``), MASK's totals by ``config.batch_bucket`` (at most
    ``max_batch_tokens``); CAUSAL's context is exact. ROWS: ``config.rows_bucket`` of the
    sequences, every row padded to the longest context's bucket and the longest rows'
    (:func:`~attnpolicy.graphs.plan_rules.rows_length`: decodes exactly one; no
    per-sequence combination), for one forward's sequences (:func:`forwards`: more
    than the largest row bucket raise ``ValueError``)."""
    ctx = contexts(layout)
    if mode is MaskMode.ROWS:
        longest = max(layout.q_lens)
        length, context = segment(longest, max(ctx), config)
        row = int(plan_rules.rows_length(longest, length)), context
        count = config.rows_bucket(layout.num_seqs)
        return ModelKey(mode, count * row[0], count * row[1], (row,) * count, config.backend, kv)
    if mode is MaskMode.VARLEN:
        segments = tuple(sorted((segment(q, c, config) for q, c in zip(layout.q_lens, ctx)), reverse=True))
        return ModelKey(mode, sum(t for t, _ in segments), sum(c for _, c in segments), segments,
                        config.backend, kv)
    rows, total = sum(layout.q_lens), sum(ctx)
    if mode is MaskMode.CAUSAL:
        tokens, context = config.bucket(rows), total
    else:
        tokens, context = config.batch_bucket(rows), config.batch_bucket(total) if total else 0
    return ModelKey(mode, tokens, context, ((tokens, context),), config.backend, kv)


def dominates(other: ModelKey, key: ModelKey) -> bool:
    """Whether ``other``'s graph can serve ``key``'s batch padded up: same mode, backend
    and ``kv``, at least as many rows and context columns (VARLEN: as many sequences,
    each at least as large; ROWS: at least as many rows, each at least as long and with
    at least as much context; CAUSAL: the same context, which must be exact)."""
    if other.mode is not key.mode or other.backend != key.backend or other.kv != key.kv or other == key:
        return False
    if key.mode is MaskMode.ROWS:
        (t, c), (u, d) = other.segments[0], key.segments[0]
        return other.rows >= key.rows and t >= u and c >= d
    if key.mode is MaskMode.VARLEN:
        return len(other.segments) == len(key.segments) and all(
            a >= b and c >= d for (a, c), (b, d) in zip(other.segments, key.segments))
    if key.mode is MaskMode.CAUSAL:
        return other.context == key.context and other.tokens >= key.tokens
    return other.tokens >= key.tokens and other.context >= key.context


def estimate_bytes(key: ModelKey, model_config: Any, itemsize: int = 4) -> int:
    """A static-shape estimate of what one graph holds while it runs: its inputs (ids,
    positions, the cached context's keys and values, the mask or ROWS's context lengths),
    its logits and (``kv``) its new rows' keys and values, and one layer's activations
    (hidden states, q/k/v, MLP)."""
    c, t = model_config, key.tokens
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_row = 2 * c.num_hidden_layers * kv_heads * head_dim if key.kv else 0
    mask = {MaskMode.MASK: t * (key.context + t), MaskMode.ROWS: 8 * key.rows}.get(key.mode, key.context)
    layer = t * (2 * c.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * c.intermediate_size)
    return 16 * t + mask + itemsize * (kv_row * (key.context + t) + t * c.vocab_size + layer)
