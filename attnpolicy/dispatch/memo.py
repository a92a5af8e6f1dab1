"""The one kind of memo a dispatcher keeps: bounded, least recently used first out."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

import cachetools

#: Entries each memo of a dispatcher holds at most (plans, steps, keys, specs, ...).
MEMO_SIZE = 4096

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def memo(maxsize: int = MEMO_SIZE) -> cachetools.LRUCache[K, V]:
    """A bounded memo (``cachetools.LRUCache``): what it drops is rebuilt on demand,
    so its size changes speed, never results. Look up with ``memo[key]`` (a
    ``KeyError`` on a miss): the cheapest read of a hit."""
    return cachetools.LRUCache(maxsize)
