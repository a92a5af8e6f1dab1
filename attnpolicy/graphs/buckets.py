"""Length buckets: every length rounds up to one of a few compiled sizes, as vLLM's
cudagraph capture sizes and tt-xla's paddings do, so that a runtime compiles one
graph per bucket instead of one per length.

Kinds (the buckets for a maximum length ``max_len``):

- ``pow2``: ``min, 2·min, 4·min, …`` below ``max_len``, then ``max_len`` itself;
- ``multiple``: ``multiple, 2·multiple, …`` below ``max_len``, then ``max_len``;
- ``list``: the given ``sizes`` that are ``<= max_len``;
- ``exact``: every length ``1..max_len`` is its own bucket (no padding, unbounded
  number of graphs).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from attnpolicy.errors import BucketOverflowError, ConfigError, LayoutError

PositiveInt = Annotated[int, Field(strict=True, ge=1)]

# The fields each kind uses besides ``kind``.
_KIND_FIELDS = {"pow2": ("min",), "multiple": ("multiple",), "list": ("sizes",), "exact": ()}


class Buckets(BaseModel, frozen=True, extra="forbid"):
    """How lengths round up to compiled sizes (see the module docstring for the kinds).

    ``min`` belongs to ``pow2`` (smallest bucket), ``multiple`` to ``multiple``
    (required), ``sizes`` to ``list`` (required: non-empty, strictly increasing).
    Giving a field of another kind is an error naming it. Serialised, a Buckets holds
    only ``kind`` and its own fields.
    """

    kind: Literal["pow2", "multiple", "list", "exact"] = "pow2"
    min: PositiveInt = 16
    multiple: PositiveInt | None = None
    sizes: tuple[PositiveInt, ...] | None = None

    @field_validator("sizes")
    @classmethod
    def _increasing(cls, sizes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if sizes is None:
            return None
        if not sizes:
            raise ValueError("sizes must not be empty")
        for a, b in zip(sizes, sizes[1:]):
            if b <= a:
                raise ValueError(f"sizes must be strictly increasing, got {a} then {b} in {list(sizes)}")
        return sizes

    @model_validator(mode="after")
    def _fields_of_kind(self) -> Buckets:
        given = {"min"} & self.model_fields_set
        given |= {name for name in ("multiple", "sizes") if getattr(self, name) is not None}
        foreign = sorted(given - set(_KIND_FIELDS[self.kind]))
        if foreign:
            raise ValueError(f"fields not used by buckets of kind {self.kind!r}: {', '.join(foreign)} "
                             f"(kind {self.kind!r} uses: {', '.join(_KIND_FIELDS[self.kind]) or 'nothing'})")
        if self.kind == "multiple" and self.multiple is None:
            raise ValueError("buckets of kind 'multiple' need multiple (an int >= 1)")
        if self.kind == "list" and self.sizes is None:
            raise ValueError("buckets of kind 'list' need sizes (strictly increasing ints >= 1)")
        return self

    @model_serializer(mode="wrap")
    def _own_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        own = ("kind", *_KIND_FIELDS[self.kind])
        return {name: value for name, value in handler(self).items() if name in own}

    @cached_property
    def _tables(self) -> dict[int, tuple[int, ...]]:
        """Sorted buckets per ``max_len`` (pow2 and list kinds), filled on first use."""
        return {}

    def bucket(self, n: int, max_len: int) -> int:
        """The smallest bucket ``>= n`` (hot path: a dict lookup and a bisect).

        Raises :class:`BucketOverflowError` naming ``n`` and the largest bucket when
        ``n`` is above it (``max_len`` for every kind but ``list``), and
        :class:`LayoutError` when ``n < 1``.
        """
        if n < 1:
            raise LayoutError(f"a length to bucket must be >= 1, got n={n}")
        kind = self.kind
        if kind == "multiple" or kind == "exact":
            if n > max_len:
                _check_max_len(max_len)
                raise self._overflow(n, max_len)
            if kind == "exact":
                return n
            m = self.multiple or 1
            b = -(-n // m) * m
            return b if b < max_len else max_len
        table = self._tables.get(max_len)
        if table is None:
            table = self._table(max_len)
        if n > table[-1]:
            raise self._overflow(n, table[-1])
        return table[bisect_left(table, n)]

    def largest(self, max_len: int) -> int:
        """The largest bucket for ``max_len`` (``max_len`` itself for ``exact``): a
        longer length overflows."""
        return max_len if self.kind == "exact" else self.sizes_up_to(max_len)[-1]

    def sizes_up_to(self, max_len: int) -> tuple[int, ...]:
        """Every bucket for ``max_len``, ascending (what a warm-up compiles).
        ``exact`` has one bucket per length: :class:`ConfigError`."""
        if self.kind == "exact":
            raise ConfigError("buckets of kind 'exact' are unbounded (one graph per length): "
                              "there is no list of sizes to warm up")
        _check_max_len(max_len)
        if self.kind == "multiple":
            m = self.multiple or 1
            return (*range(m, max_len, m), max_len)
        return self._tables.get(max_len) or self._table(max_len)

    def padding_waste(self, lengths: Iterable[int], max_len: int) -> float:
        """Padding tokens added per real token: ``(Σ bucket(n) − Σ n) / Σ n``.

        0.0 means no padding; 1.0 means the padded calls hold as many padding tokens
        as real ones. An empty ``lengths`` wastes nothing (0.0)."""
        real = padded = 0
        for n in lengths:
            real += n
            padded += self.bucket(n, max_len)
        return (padded - real) / real if real else 0.0

    def _table(self, max_len: int) -> tuple[int, ...]:
        _check_max_len(max_len)
        if self.kind == "list":
            sizes = self.sizes or ()
            table = tuple(s for s in sizes if s <= max_len)
            if not table:
                raise ConfigError(f"buckets.sizes {list(sizes)} has no size <= max_len {max_len}")
        else:
            below = []
            s = self.min
            while s < max_len:
                below.append(s)
                s *= 2
            table = (*below, max_len)
        self._tables[max_len] = table
        return table

    def _overflow(self, n: int, largest: int) -> BucketOverflowError:
        return BucketOverflowError(f"length {n} exceeds the largest bucket {largest} "
                                  f"(buckets: {self.describe()})")

    def describe(self) -> str:
        """A short text form, e.g. ``pow2(min=16)`` or ``list(sizes=[128, 512])``."""
        args = ", ".join(f"{name}={list(v) if isinstance(v, tuple) else v}"
                         for name in _KIND_FIELDS[self.kind] for v in [getattr(self, name)])
        return f"{self.kind}({args})"


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ConfigError(f"max_len must be >= 1, got {max_len}")
