"""GraphKey: everything that changes a compiled attention graph; Call: one graph invocation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnpolicy.core.features import PLAIN, Features
from attnpolicy.core.modes import CallKind

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def check_kv_heads(heads: int, kv_heads: int) -> None:
    """``ValueError`` unless ``kv_heads`` divides ``heads`` (each key/value head serves
    a whole group of query heads)."""
    if heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """The tensor properties a compiled graph is specialised on."""

    dtype: str  # one of attnpolicy.core.names.DTYPES
    heads: int
    kv_heads: int
    head_dim: int
    scale: float | None = None  # None: 1/sqrt(head_dim)
    device: str = "cpu"
    features: Features = PLAIN  # sliding window, soft cap, sinks: graphs differ in them
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # hashed once: specs key every plan and graph lookup on the hot path
        object.__setattr__(self, "_hash", hash((self.dtype, self.heads, self.kv_heads, self.head_dim,
                                                self.scale, self.device, self.features)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, q: Any, k: Any, scale: float | None = None, features: Features = PLAIN) -> TensorSpec:
        """The spec of packed ``q[tokens, Hq, D]`` and ``k[tokens, Hkv, D]``."""
        return cls(str(q.dtype).removeprefix("torch."), q.shape[1], k.shape[1], q.shape[2], scale,
                   str(q.device), features)


@dataclass(frozen=True, slots=True)
class Call:
    """One graph invocation planned from a layout.

    ``kind`` is the :class:`CallKind` of its graph. Rows ``[q_start, q_start +
    q_len)`` of q and ``[kv_start, kv_start + kv_len)`` of k/v are padded up to
    ``q_bucket`` / ``kv_bucket`` rows. ``compiled`` is false for a call longer than
    the largest bucket that runs uncompiled (``on_overflow="eager"``): it has no graph
    in the cache.

    A ROWS call holds the sequences ``[seq_start, seq_start + seqs)`` of its layout,
    one a row, in ``rows`` rows (its row bucket; 1 for every other kind): its token
    ranges span theirs, each row is padded to ``q_bucket`` / ``kv_bucket``, and
    ``context`` says whether a row has cached context (more keys than queries).
    """

    kind: CallKind
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    q_bucket: int
    kv_bucket: int
    causal: bool
    compiled: bool = True
    seq_start: int = 0
    seqs: int = 1
    rows: int = 1
    context: bool = False


@dataclass(frozen=True, slots=True)
class GraphKey:
    """Cache key of one compiled graph: equal keys can share one graph. ``rows`` is a
    ROWS graph's row count (1 for every other kind); ``context`` whether a causal ROWS
    graph bounds its rows' cached context (a fresh one runs mask-free)."""

    kind: CallKind
    q_len: int
    kv_len: int
    causal: bool
    spec: TensorSpec
    impl: str
    partition_len: int | None
    backend: str
    rows: int = 1
    context: bool = False
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # hashed once: a key is looked up in the graph cache on every call
        object.__setattr__(self, "_hash", hash((self.kind, self.q_len, self.kv_len, self.causal, self.spec,
                                                self.impl, self.partition_len, self.backend, self.rows,
                                                self.context)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def for_call(cls, call: Call, spec: TensorSpec, impl: str,
                 partition_len: int | None, backend: str) -> GraphKey:
        # a MASK graph takes causality from its mask: causal and bidirectional share it
        causal = call.causal and call.kind is not CallKind.MASK
        return cls(call.kind, call.q_bucket, call.kv_bucket, causal, spec, impl,
                   partition_len if impl == "flash" else None, backend, call.rows,
                   causal and call.context and call.kind is CallKind.ROWS)

    def __str__(self) -> str:
        s = self.spec
        shape = f"q{self.q_len}" if self.q_len == self.kv_len else f"q{self.q_len}xkv{self.kv_len}"
        part = f"/p{self.partition_len}" if self.partition_len else ""
        part += "" if s.scale is None else f"/s{s.scale:g}"
        part += "" if s.device == "cpu" else f"/{s.device}"
        part += s.features.tag()
        kind = self.kind.value + ("-bidir" if not self.causal and self.kind is not CallKind.MASK else "")
        kind += "-ctx" if self.context else ""
        kind += f"/r{self.rows}" if self.kind is CallKind.ROWS else ""
        return (f"{kind}/{shape}/{s.dtype}/h{s.heads}kv{s.kv_heads}d{s.head_dim}"
                f"/{self.impl}{part}/{self.backend}")
