"""A graph family: a class of graphs one dispatcher or model runner serves (attention
calls, whole-model forwards), described by what serving it needs and nothing else.

The shared serving code (:class:`~attnpolicy.dispatch.graph_source.GraphSource` and
:class:`~attnpolicy.dispatch.background.Background`) keeps the cache, the store, strict
mode, the warm set, the background worker, pad-up and switch-in for any family; a
family says what its keys are, how a key's graph is built, stored, loaded, padded up to
and run uncompiled. A key is hashable; a *request* is what building a key's graph
needs beyond its key (an attention call and its tensor spec; a forward's example
inputs). A family's methods other than :meth:`~GraphFamily.pad_up` may run in the
background worker: they touch no serving state.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore

if TYPE_CHECKING:
    from attnpolicy.config import AttnPolicyConfig

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
R_contra = TypeVar("R_contra", contravariant=True)


class GraphFamily(Protocol[K, R_contra]):
    """What serving needs of the graphs of one family: keys ``K``, built from requests
    ``R_contra``. A new family implements these members and is served by the same
    :class:`~attnpolicy.dispatch.graph_source.GraphSource` and
    :class:`~attnpolicy.dispatch.background.Background`: nothing in them names a family."""

    #: the config its graphs are built under (a dispatcher switching configs replaces it)
    config: AttnPolicyConfig

    @property
    def store(self) -> DiskStore | None:
        """The store its graphs persist in (``None``: none configured)."""
        ...

    @property
    def eager_misses(self) -> bool:
        """Whether a background miss that no resident graph can serve runs :meth:`eager`
        while its graph compiles in the worker (else it is compiled now, a stall)."""
        ...

    def estimate_bytes(self, key: K) -> int:
        """The static-shape bytes ``key``'s graph holds: what the cache is bounded by."""
        ...

    def rows(self, key: K) -> int:
        """The padded rows ``key``'s graph runs (a pad-up adds the difference)."""
        ...

    def build(self, key: K, request: R_contra) -> Any:
        """Compile ``key``'s graph; ahead of time, saved in the store, when it is stored
        (:meth:`identity` not ``None``)."""
        ...

    def identity(self, key: K) -> ArtifactIdentity | None:
        """What makes ``key``'s stored artifact valid; ``None``: its graph is not stored."""
        ...

    def load(self, key: K) -> Any | None:
        """``key``'s graph from the store (``None``: not there or not valid)."""
        ...

    def pad_up(self, key: K, resident: Sequence[K]) -> K | None:
        """The key among ``resident`` (keys whose graphs are built) whose graph serves a
        batch of ``key`` padded up, else ``None``: a pure function of ``resident``, the
        config and the family's cost model."""
        ...

    def eager(self, key: K, request: R_contra) -> Any:
        """What runs a batch of ``key`` uncompiled."""
        ...

    def release(self, key: K, graph: Any) -> None:
        """Free what a graph of ``key`` holds (its compiled code)."""
        ...
