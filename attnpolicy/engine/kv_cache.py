"""KVCache: each running sequence's keys and values, one slot per sequence, outside
any graph (the step graphs take a step's past as inputs and return its new rows).

A slot holds ``[layers, kv_heads, max_len, head_dim]`` keys and values and its
length; the caller (a model runner, a serving loop) owns the cache and says which
slot each sequence of a step is in. :meth:`gather` lays the slots' contexts out in a
graph's padded spans, :meth:`append` writes a step's new rows back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from attnpolicy.errors import AllocationError, ConfigError, LayoutError


class KVCache:
    """Keys and values of ``slots`` sequences of up to ``max_len`` tokens for a model
    of ``layers`` layers, ``kv_heads`` heads of ``head_dim``; ``lengths``: what each slot
    holds to start with (zero keys and values; default nothing). A cache the device cannot
    allocate raises :class:`~attnpolicy.errors.AllocationError` naming its bytes."""

    def __init__(self, slots: int, max_len: int, *, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 lengths: Sequence[int] | None = None) -> None:
        for name, value in (("slots", slots), ("max_len", max_len), ("layers", layers),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        shape = (layers, slots, kv_heads, max_len, head_dim)
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError
            nbytes = 2 * math.prod(shape) * dtype.itemsize
            raise AllocationError(
                f"a KV cache of {slots} slots x {max_len} tokens ({layers} layers, {kv_heads} KV heads of "
                f"{head_dim}, {str(dtype).removeprefix('torch.')}, keys and values) needs {nbytes} bytes, "
                f"more than {device} can allocate") from exc
        self.max_len = max_len
        if lengths is not None and len(lengths) != slots:
            raise ConfigError(f"lengths must give one length per slot ({slots}), got {list(lengths)}")
        self._lengths = [0] * slots if lengths is None else [self._check_length(n) for n in lengths]

    @classmethod
    def for_model(cls, model: torch.nn.Module, slots: int, max_len: int, *,
                  lengths: Sequence[int] | None = None) -> KVCache:
        """A cache shaped for HF ``model`` (its config, dtype and device)."""
        c: Any = model.config
        param = next(model.parameters())
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(slots, max_len, layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads,
                   head_dim=head_dim, dtype=param.dtype, device=param.device, lengths=lengths)

    @classmethod
    def holding(cls, model: torch.nn.Module, lengths: Sequence[int], max_len: int) -> KVCache:
        """A cache for ``model`` whose slot ``i`` holds ``lengths[i]`` tokens of zero keys and
        values (what a warm-up step runs over: its graph depends on shapes only)."""
        return cls.for_model(model, len(lengths), max_len, lengths=lengths)

    @property
    def slots(self) -> int:
        return len(self._lengths)

    def length(self, slot: int) -> int:
        """The tokens ``slot`` holds."""
        return self._lengths[self._slot(slot)]

    def reset(self, slot: int) -> None:
        """Free ``slot`` for a new sequence (its length back to 0)."""
        self._lengths[self._slot(slot)] = 0

    def check(self, slots: Sequence[int], contexts: Sequence[int], q_lens: Sequence[int]) -> None:
        """Raise :class:`LayoutError` unless each sequence ``i`` of a step is in its own
        ``slots[i]``, that slot holds exactly its ``contexts[i]`` tokens, and its
        ``q_lens[i]`` new rows fit."""
        if len(slots) != len(contexts):
            raise LayoutError(f"slots must name one slot per sequence ({len(contexts)}), got {list(slots)}")
        if len(set(slots)) != len(slots):
            raise LayoutError(f"slots must be distinct, got {list(slots)}")
        for i, (slot, ctx, q) in enumerate(zip(slots, contexts, q_lens)):
            held = self._lengths[self._slot(slot)]
            if held != ctx:
                raise LayoutError(f"sequence {i} has {ctx} tokens of cached context, but slot {slot} holds {held}")
            if ctx + q > self.max_len:
                raise LayoutError(f"sequence {i} would hold {ctx + q} tokens, slot {slot} holds at most "
                                  f"max_len={self.max_len}")

    def gather(self, slots: Sequence[int], offsets: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Past keys and values ``[layers, kv_heads, width, head_dim]``: slot ``slots[i]``'s
        tokens at columns ``offsets[i]:``, every other column zero."""
        layers, _, heads, _, dim = self.k.shape
        k = self.k.new_zeros(layers, heads, width, dim)
        v = self.v.new_zeros(layers, heads, width, dim)
        for slot, at in zip(slots, offsets):
            n = self._lengths[slot]
            k[:, :, at:at + n] = self.k[:, slot, :, :n]
            v[:, :, at:at + n] = self.v[:, slot, :, :n]
        return k, v

    def append(self, slots: Sequence[int], rows: Sequence[torch.Tensor], new_k: torch.Tensor,
               new_v: torch.Tensor) -> None:
        """Write each ``slots[i]``'s new rows, graph rows ``rows[i]`` of ``new_k``/``new_v``
        ``[layers, kv_heads, T, head_dim]``, after what it holds."""
        for slot, r in zip(slots, rows):
            n, q = self._lengths[slot], r.numel()
            self.k[:, slot, :, n:n + q] = new_k[:, :, r]
            self.v[:, slot, :, n:n + q] = new_v[:, :, r]
            self._lengths[slot] = n + q

    def _check_length(self, n: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.max_len:
            raise ConfigError(f"a slot's length must be an int in [0, {self.max_len}], got {n!r}")
        return n

    def _slot(self, slot: int) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(self._lengths):
            raise LayoutError(f"slot must be an int in [0, {len(self._lengths)}), got {slot!r}")
        return slot
