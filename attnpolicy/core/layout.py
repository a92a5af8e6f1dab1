"""BatchLayout: what one attention call holds.

Tensors are *packed*: queries are ``q[q_tokens, heads, head_dim]`` and keys/values
``k, v[kv_tokens, kv_heads, head_dim]``. Sequence ``i`` owns query rows
``q_starts[i] : q_starts[i] + q_lens[i]`` and key rows
``kv_starts[i] : kv_starts[i] + kv_lens[i]``. Rows owned by no sequence are padding.

``kv_lens[i] >= q_lens[i]``: when larger, the first ``kv_lens[i] - q_lens[i]`` keys
are cached context and the queries are the *last* ``q_lens[i]`` positions of the
sequence (causal masks are aligned bottom-right, as in vLLM and FlashAttention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from operator import add, lt, sub

from attnpolicy.errors import LayoutError


def _ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if type(values) is tuple and set(map(type, values)) == {int}:  # already checked: the common case
        return values
    if hasattr(values, "tolist"):  # torch / numpy
        values = values.tolist()
    if type(values) is list and set(map(type, values)) == {int}:
        return tuple(values)
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{name} must be a sequence of integers, got {values!r}") from exc
    for v, orig in zip(out, values):
        if v != orig:
            raise LayoutError(f"{name} must hold integers, got {orig!r}")
    return out


def _offsets(lens: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(accumulate(lens, initial=0))[:-1]


@dataclass(frozen=True)
class BatchLayout:
    """Immutable, validated, hashable description of one attention call.

    Build it with :meth:`from_lens`, :meth:`from_cu_seqlens`,
    :meth:`from_query_start_loc` or :meth:`from_padding_mask`.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    q_tokens: int
    kv_tokens: int
    causal: bool = True
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("q_lens", "kv_lens", "q_starts", "kv_starts"):
            object.__setattr__(self, name, _ints(name, getattr(self, name)))
        n = len(self.q_lens)
        for name in ("kv_lens", "q_starts", "kv_starts"):
            if len(getattr(self, name)) != n:
                raise LayoutError(
                    f"{name} must have one entry per sequence ({n}), got {getattr(self, name)!r}"
                )
        self._check_lens(self.q_lens, self.kv_lens, self.causal)
        self._check_rows("q", self.q_starts, self.q_lens, self.q_tokens)
        self._check_rows("kv", self.kv_starts, self.kv_lens, self.kv_tokens)
        object.__setattr__(
            self,
            "_hash",
            hash((self.q_lens, self.kv_lens, self.q_starts, self.kv_starts,
                  self.q_tokens, self.kv_tokens, self.causal)),
        )

    @staticmethod
    def _check_lens(q_lens: tuple[int, ...], kv_lens: tuple[int, ...], causal: bool) -> None:
        if not q_lens:
            raise LayoutError("q_lens must hold at least one sequence, got ()")
        if min(q_lens) < 1 or any(map(lt, kv_lens, q_lens)):
            for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
                if ql < 1:
                    raise LayoutError(f"q_lens[{i}] must be >= 1, got {ql}")
                if kl < ql:
                    raise LayoutError(f"kv_lens[{i}] must be >= q_lens[{i}] ({ql}), got {kl}")
        if not isinstance(causal, bool):
            raise LayoutError(f"causal must be a bool, got {causal!r}")

    @classmethod
    def _packed(cls, q_lens: tuple[int, ...], kv_lens: tuple[int, ...], q_tokens: int, kv_tokens: int,
                causal: bool) -> BatchLayout:
        """Sequences packed back to back from row 0 (starts are the running sums of the
        lengths, so the rows are right by construction): the lengths are checked as
        ``__post_init__`` checks them, the rows are not checked again."""
        if len(kv_lens) != len(q_lens):
            raise LayoutError(f"kv_lens must have one entry per sequence ({len(q_lens)}), got {kv_lens!r}")
        cls._check_lens(q_lens, kv_lens, causal)
        q_starts, kv_starts = _offsets(q_lens), _offsets(kv_lens)
        self = object.__new__(cls)
        self.__dict__.update(q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_starts=kv_starts,
                             q_tokens=q_tokens, kv_tokens=kv_tokens, causal=causal,
                             _hash=hash((q_lens, kv_lens, q_starts, kv_starts, q_tokens, kv_tokens, causal)))
        return self

    @staticmethod
    def _check_rows(side: str, starts: tuple[int, ...], lens: tuple[int, ...], tokens: int) -> None:
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise LayoutError(f"{side}_tokens must be an int, got {tokens!r}")
        ends = tuple(map(add, starts, lens))
        if starts[0] < 0 or any(map(lt, starts[1:], ends)):
            end = 0
            for i, (s, n) in enumerate(zip(starts, lens)):
                if s < end:
                    raise LayoutError(
                        f"{side}_starts must be increasing without overlap: "
                        f"{side}_starts[{i}]={s} < end of previous sequence {end}"
                    )
                end = s + n
        end = ends[-1]
        if end > tokens:
            raise LayoutError(f"{side}_tokens={tokens} is smaller than the rows the sequences use ({end})")

    def __hash__(self) -> int:
        return self._hash

    # -- constructors -------------------------------------------------------------
    @classmethod
    def from_lens(
        cls,
        q_lens: Sequence[int],
        kv_lens: Sequence[int] | None = None,
        *,
        causal: bool = True,
        padded_to: int | None = None,
    ) -> BatchLayout:
        """Sequences packed back to back; ``padded_to`` adds trailing padding rows.

        Without ``kv_lens`` this is self-attention (keys are the query tokens), and
        ``padded_to`` pads both sides; with context the keys are packed unpadded.
        """
        q = _ints("q_lens", q_lens)
        kv = q if kv_lens is None else _ints("kv_lens", kv_lens)
        q_tokens = sum(q) if padded_to is None else padded_to
        if padded_to is not None and (type(padded_to) is not int or padded_to < sum(q)):
            raise LayoutError(f"padded_to must be an int >= sum(q_lens)={sum(q)}, got {padded_to!r}")
        kv_tokens = q_tokens if kv == q else sum(kv)
        return cls._packed(q, kv, q_tokens, kv_tokens, causal)

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens_q: Sequence[int],
        cu_seqlens_k: Sequence[int] | None = None,
        *,
        causal: bool = True,
        padded_to: int | None = None,
    ) -> BatchLayout:
        """From cumulative offsets ``[0, l0, l0+l1, ...]`` (FlashAttention varlen style)."""
        q_lens = _diffs("cu_seqlens_q", cu_seqlens_q)
        kv_lens = None if cu_seqlens_k is None else _diffs("cu_seqlens_k", cu_seqlens_k)
        return cls.from_lens(q_lens, kv_lens, causal=causal, padded_to=padded_to)

    @classmethod
    def from_query_start_loc(
        cls,
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        *,
        causal: bool = True,
        num_tokens: int | None = None,
    ) -> BatchLayout:
        """From vLLM metadata: ``query_start_loc`` (cumulative query offsets) and
        ``seq_lens`` (context + new tokens per sequence). ``num_tokens`` is the padded
        row count of the query tensor when vLLM pads the batch."""
        q_lens = _diffs("query_start_loc", query_start_loc)
        kv = _ints("seq_lens", seq_lens)
        if len(kv) != len(q_lens):
            raise LayoutError(
                f"seq_lens must have one entry per sequence ({len(q_lens)}), got {list(kv)!r}"
            )
        return cls.from_lens(q_lens, kv, causal=causal, padded_to=num_tokens)

    @classmethod
    def from_padding_mask(cls, mask: object, *, causal: bool = True) -> BatchLayout:
        """From a HF-style 0/1 padding mask ``[batch, len]`` (left or right padding).

        The tensor rows are ``batch * len``; each row's ones must be contiguous.
        """
        import torch

        m = torch.as_tensor(mask)
        if m.dim() != 2:
            raise LayoutError(f"padding mask must be 2-D [batch, len], got shape {tuple(m.shape)}")
        if 0 in m.shape:
            raise LayoutError(f"padding mask must have batch >= 1 and len >= 1, got shape {tuple(m.shape)}")
        if not bool(((m == 0) | (m == 1)).all()):
            raise LayoutError("padding mask must hold only 0 and 1")
        b, length = m.shape
        m = m.to(torch.int64)
        lens = m.sum(dim=1).tolist()
        firsts = m.argmax(dim=1).tolist()
        starts = []
        for row, (n, first) in enumerate(zip(lens, firsts)):
            if n == 0:
                raise LayoutError(f"padding mask row {row} has no tokens")
            if int(m[row, first:first + n].sum()) != n:
                raise LayoutError(f"padding mask row {row} has non-contiguous tokens")
            starts.append(row * length + first)
        return cls(tuple(lens), tuple(lens), tuple(starts), tuple(starts), b * length, b * length, causal)

    # -- properties the policies need -------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @cached_property
    def total_tokens(self) -> int:
        """Real (non-padding) query tokens."""
        return sum(self.q_lens)

    @cached_property
    def total_kv_tokens(self) -> int:
        return sum(self.kv_lens)

    @cached_property
    def is_padded(self) -> bool:
        return self.q_tokens != self.total_tokens or self.kv_tokens != self.total_kv_tokens

    @cached_property
    def has_context(self) -> bool:
        """Some sequence attends to cached keys before its queries."""
        return self.q_lens != self.kv_lens

    @cached_property
    def is_single(self) -> bool:
        """One sequence filling both tensors: no padding."""
        return self.num_seqs == 1 and not self.is_padded

    @cached_property
    def max_len(self) -> int:
        return max(self.q_lens)

    @cached_property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)

    def sequences(self, first: int, end: int) -> BatchLayout:
        """Sequences ``[first, end)`` as a layout of their own: its rows run from the first
        one's start to the last one's end (the padding between them kept)."""
        if not 0 <= first < end <= self.num_seqs:
            raise LayoutError(f"sequences [{first}, {end}) are not a range of this layout's {self.num_seqs}")
        q0, k0, last = self.q_starts[first], self.kv_starts[first], end - 1
        return BatchLayout(self.q_lens[first:end], self.kv_lens[first:end],
                           tuple(s - q0 for s in self.q_starts[first:end]),
                           tuple(s - k0 for s in self.kv_starts[first:end]),
                           self.q_starts[last] + self.q_lens[last] - q0,
                           self.kv_starts[last] + self.kv_lens[last] - k0, self.causal)

    def describe(self) -> str:
        """Short human string, e.g. ``3 seqs q=[5, 7, 9] causal``."""
        ctx = "" if not self.has_context else f" kv={list(self.kv_lens)}"
        pad = f" padded to {self.q_tokens}" if self.is_padded else ""
        kind = "causal" if self.causal else "bidirectional"
        return f"{self.num_seqs} seq{'s' if self.num_seqs > 1 else ''} q={list(self.q_lens)}{ctx}{pad} {kind}"


def _diffs(name: str, offsets: Sequence[int]) -> tuple[int, ...]:
    cu = _ints(name, offsets)
    if len(cu) < 2 or cu[0] != 0:
        raise LayoutError(f"{name} must start at 0 and hold at least two offsets, got {list(cu)!r}")
    diffs = tuple(map(sub, cu[1:], cu))
    if min(diffs) <= 0:
        i = next(i for i, d in enumerate(diffs, 1) if d <= 0)
        raise LayoutError(f"{name} must be strictly increasing: {name}[{i}]={cu[i]} <= {cu[i - 1]}")
    return diffs
