"""What the peers' warm sets serve of a workload, counted exactly (no cost model).

Each engine step of a workload (one layout per step, as the batch former forms them)
runs as the forwards its peer runs for it
(:func:`~attnpolicy.modelling.peer_buckets.step_forwards`); each forward is served by
the first warm-up graph that holds it (:meth:`PeerWarmSet.serves
<attnpolicy.modelling.peer_buckets.PeerWarmSet.serves>`) or by none: the peer then
compiles a graph after warm-up (vllm-gaudi can be told to fail instead). A
:class:`PeerCoverage` counts, for one warm set: its graphs (prefill, decode and
ragged ``mixed``), the graphs the workload used, the forwards it left unserved with
their distinct shapes (at most that many graphs compiled at run time: a graph compiled
for one serves the smaller ones after it), and the padding: the query rows the serving
graphs compute beyond the tokens they hold. A peer that refuses to start
under the limits (its own rule, a :class:`~attnpolicy.errors.ConfigError`) gets a row
that says why and counts nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    Forward,
    PeerWarmSet,
    WorkloadForwards,
    peer_of,
)


@dataclass(frozen=True)
class PeerCoverage:
    """One warm set against one workload (see the module docstring); ``refused``:
    why the peer would not start (then every count is 0)."""

    scheme: str
    graphs: int
    prefill_graphs: int
    decode_graphs: int
    mixed_graphs: int
    graphs_used: int
    forwards: int
    unserved: int
    unserved_shapes: int
    tokens: int
    padded_rows: int
    refused: str | None = None

    @property
    def padding(self) -> float:
        """Padded rows per token computed, over the forwards a warm-up graph served."""
        return self.padded_rows / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "graphs": self.graphs, "prefill_graphs": self.prefill_graphs,
                "decode_graphs": self.decode_graphs, "mixed_graphs": self.mixed_graphs, "graphs_used": self.graphs_used,
                "forwards": self.forwards, "unserved": self.unserved, "unserved_shapes": self.unserved_shapes,
                "tokens": self.tokens, "padded_rows": self.padded_rows, "padding": self.padding,
                "refused": self.refused}


def coverage(label: str, warm: PeerWarmSet, forwards: Iterable[Forward]) -> PeerCoverage:
    """How ``warm`` serves ``forwards`` (each of its peer's forwards of a workload),
    as the row ``label``."""
    counted = forwards if isinstance(forwards, Counter) else Counter(forwards)  # forwards repeat: decodes above all
    unserved = unserved_shapes = tokens = padded = 0
    rows: dict[int, int] = {}  # the rows of each serving graph, by position
    for (f, n), at in zip(counted.items(), warm.serving([f[:4] for f in counted]).tolist(), strict=True):
        if at < 0:
            unserved, unserved_shapes = unserved + n, unserved_shapes + 1
            continue
        if at not in rows:
            rows[at] = f.rows(warm.graphs[at])
        tokens += n * f.tokens
        padded += n * (rows[at] - f.tokens)
    return PeerCoverage(label, len(warm.graphs), len(warm.phase("prefill")), len(warm.phase("decode")),
                        len(warm.phase("mixed")), len(rows), counted.total(), unserved, unserved_shapes, tokens,
                        padded)


def peer_coverage(forwards: WorkloadForwards,
                  extra: Sequence[tuple[str, Callable[[], PeerWarmSet]]] = ()) -> tuple[PeerCoverage, ...]:
    """Every peer's default warm set (:data:`~attnpolicy.modelling.peer_buckets.WARMUPS`)
    for the workload's limits, then each ``(label, make)`` of ``extra`` (``make()``: a
    peer's set under other settings, such as a plan's), against the workload's
    ``forwards``."""

    def row(label: str, make: Callable[[], PeerWarmSet]) -> PeerCoverage:
        try:
            warm = make()
        except ConfigError as exc:
            return PeerCoverage(label, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, str(exc))
        return coverage(label, warm, forwards.of(peer_of(warm.scheme)))

    defaults: list[tuple[str, Callable[[], PeerWarmSet]]] = [(name, partial(make, forwards.limits))
                                                              for name, make in WARMUPS.items()]
    return tuple(row(label, make) for label, make in [*defaults, *extra])


#: The coverage table's title and columns (:func:`table_rows` gives its cells).
PEER_TITLE = "The runtimes' warm-up sets on this workload"
PEER_COLUMNS = ("warm-up set", "graphs", "prefill / decode / mixed", "used", "forwards", "unserved (shapes)", "padding")
#: What the table's columns mean (under the table in plan.md).
PEER_LEGEND = ("Each engine step as vllm-gaudi, vllm-rbln and tpu-inference run it: their default warm-up sets, then "
               "the sets host_settings.json gives them (`-plan`). *unserved*: forwards no warm-up graph holds (the "
               "runtime compiles at run time; in brackets their distinct shapes, at most that many compiles since a "
               "graph compiled for one serves the smaller ones after it); *padding*: rows the serving graphs compute "
               "beyond the tokens, per token. Counted, not modelled.")


def table_rows(rows: Sequence[PeerCoverage]) -> list[tuple[str, ...]]:
    """``rows`` as the cells of :data:`PEER_COLUMNS` (the printed table and the Markdown one)."""
    return [(r.scheme, f"refused: {r.refused}", "", "", "", "", "") if r.refused is not None else
            (r.scheme, str(r.graphs), f"{r.prefill_graphs} / {r.decode_graphs} / {r.mixed_graphs}",
             str(r.graphs_used), str(r.forwards), f"{r.unserved} ({r.unserved_shapes})", f"{r.padding:.1%}")
            for r in rows]
