"""The plain types of a :class:`~attnpolicy.cache.graph_cache.GraphCache`: its
validated bounds, and what it counts (the snapshots ``stats()`` returns, the running
figures of one key; see docs/cache.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from attnpolicy.core.names import Oversize
from attnpolicy.errors import ConfigError


class Bounds(BaseModel):
    """The validated bounds of a cache."""

    model_config = ConfigDict(strict=True, frozen=True)

    max_graphs: PositiveInt | None = None
    max_bytes: PositiveInt | None = None
    oversize: Oversize = "raise"

    @classmethod
    def of(cls, **fields: Any) -> Bounds:
        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])} {e['msg'].lower()}, got {e['input']!r}"
                                 for e in exc.errors())
            raise ConfigError(f"invalid GraphCache bounds: {problems}") from None


@dataclass(frozen=True, slots=True)
class KeyStats:
    """The figures of one key (see docs/cache.md)."""

    hits: int
    misses: int
    compiles: int
    evictions: int
    compile_seconds: float
    bytes: int
    loads: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a :class:`GraphCache` (see docs/cache.md for each figure).
    ``to_json()`` gives the dict of the JSON outputs."""

    hits: int
    misses: int
    evictions: int
    compiles: int
    compile_failures: int
    compile_seconds: float
    waits: int
    uncached: int
    refused: int
    graphs: int
    bytes: int
    peak_graphs: int
    peak_bytes: int
    held_graphs: int
    held_bytes: int
    peak_held_graphs: int
    peak_held_bytes: int
    max_graphs: int | None
    max_bytes: int | None
    eviction: str
    per_key: dict[str, KeyStats]
    loads: int = 0  # misses served by a load (a disk tier) instead of a build
    load_seconds: float = 0.0
    deferred: int = 0  # misses entered without a graph (reserve)
    deferred_built: int = 0  # builds (or loads) of deferred entries begun: their requests are hits

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class KeyCounters:
    """The running figures of one key (:meth:`snapshot`: its :class:`KeyStats`)."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0
    evictions: int = 0
    compile_seconds: float = 0.0
    bytes: int = 0
    loads: int = 0
    load_seconds: float = 0.0

    def snapshot(self) -> KeyStats:
        return KeyStats(self.hits, self.misses, self.compiles, self.evictions, self.compile_seconds, self.bytes,
                        self.loads, self.load_seconds)
