"""A runtime's graph set as the runner serves it, and the file that carries the plan's.

:class:`RuntimeGraphSet` is a warm set of one runtime's graphs
(:class:`~attnpolicy.modelling.peer_buckets.PeerWarmSet`) under the server's limits,
as an :class:`~attnpolicy.engine.keys.GraphSet`: its keys are the step graphs this
runner compiles for the runtime's graphs
(:func:`~attnpolicy.modelling.warmup_costs.peer_key`), and a step runs in the
runtime's form (:func:`~attnpolicy.modelling.peer_buckets.peer_ranges`: vllm-gaudi's
and vllm-rbln's prompts alone and decodes together), each forward on the first warm
graph that serves it, padded up, or on a graph of its own shape where none does (a
run-time compile). What it is modelled to cost on a workload is :meth:`~RuntimeGraphSet.cost`,
by the same keys.

A ragged set (tpu-inference's, vLLM's piecewise graphs, the plan's ragged form) does
not run here: its graph's shape holds only the step's tokens, its attention reading
the KV cache in place through the step's page table, where this runner's step graphs
take each forward's context as a dense input of static size
(:func:`why_not_runnable`).

``graph_sets.json`` (:class:`GraphSetsFile`), written by ``plan --whole-requests``,
holds the server's limits and each warm set of the plan's table by its row's label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from attnpolicy.core import jsonfile
from attnpolicy.core.layout import BatchLayout
from attnpolicy.engine.keys import ModelKey, Part
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    Peer,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    WorkloadForwards,
    peer_of,
    peer_ranges,
    step_forwards,
)
from attnpolicy.modelling.warmup_costs import Pricing, WarmupCost, own_graph, peer_key, vllm_warmup, warmup_cost
from attnpolicy.modelling.whole_model_costs import ModelCostModel

#: The runtimes' default sets by name (vLLM's: its piecewise capture sizes, ragged).
SCHEMES = (*WARMUPS, "vllm")
#: Those this runner serves: vllm-gaudi's and vllm-rbln's (the others are ragged).
SERVED_SCHEMES = tuple(name for name in WARMUPS if peer_of(name) != "tpu")
#: The file ``plan --whole-requests`` writes its sets to.
GRAPH_SETS_FILE = "graph_sets.json"
GRAPH_SETS_VERSION: Literal[1] = 1


def why_not_runnable(peer: Peer, warm: PeerWarmSet) -> str | None:
    """Why this runner cannot serve ``warm`` in ``peer``'s form (``None``: it can): a
    ragged form (tpu-inference's, vLLM's, the plan's ragged form, even one left empty)
    or a ragged graph."""
    if peer == "tpu" or any(g.phase == "mixed" for g in warm.graphs):
        return ("its graphs are ragged (one forward padded on its tokens, attention reading the KV cache in place "
                "through the step's page table); this runner's step graphs take each forward's context as a dense "
                "input of static size, so it runs vllm-gaudi's and vllm-rbln's forms only")
    return None


@dataclass(frozen=True)
class RuntimeGraphSet:
    """``warm``, the graphs of runtime ``peer`` under ``limits``, served by a runner of
    ``backend`` (see the module docstring); ``name``: its label. A ragged set is a
    :class:`ConfigError` saying why (:func:`why_not_runnable`)."""

    name: str
    peer: Peer
    warm: PeerWarmSet
    limits: PeerLimits
    backend: str

    def __post_init__(self) -> None:
        why = why_not_runnable(self.peer, self.warm)
        if why is not None:
            raise ConfigError(f"graph set {self.name!r} does not run here: {why}")

    @cached_property
    def keys(self) -> tuple[ModelKey, ...]:
        """The warm graphs' keys, one per graph, in the set's order."""
        return tuple(self._key(g) for g in self.warm.graphs)

    def _key(self, graph: PeerGraph) -> ModelKey:
        return peer_key(graph, self.limits, self.backend)

    def parts(self, layout: BatchLayout) -> tuple[Part, ...]:
        """``layout``'s forwards in the runtime's form, each on the graph that serves it
        (or one of its own shape)."""
        ranges = peer_ranges(self.peer, layout.q_lens)
        forwards = step_forwards(self.peer, layout.q_lens, layout.kv_lens, self.limits)
        served = self.warm.serving([f[:4] for f in forwards]).tolist()
        return tuple((first, end, self._key(self.warm.graphs[at] if at >= 0 else own_graph(f)))
                     for (first, end), f, at in zip(ranges, forwards, served, strict=True))

    def cost(self, steps: Sequence[BatchLayout], model: ModelCostModel) -> WarmupCost:
        """What the set is modelled to cost serving ``steps`` (the comparison's row of it)."""
        forwards = WorkloadForwards(steps, self.limits).of(self.peer)
        return warmup_cost(self.name, self.warm, forwards, Pricing(model, self.limits))


def scheme_set(scheme: str, limits: PeerLimits) -> tuple[Peer, PeerWarmSet]:
    """A runtime's default set under ``limits`` by its name, one of :data:`SCHEMES`
    (vLLM's runs its steps ragged, as tpu-inference's); else a :class:`ConfigError`."""
    if scheme == "vllm":
        return "tpu", vllm_warmup(limits)
    if scheme not in WARMUPS:
        raise ConfigError(f"graph set must be one of {', '.join(SCHEMES)} or a label of the plan's "
                          f"{GRAPH_SETS_FILE}, got {scheme!r}")
    return peer_of(scheme), WARMUPS[scheme](limits)


Graph = tuple[Literal["prefill", "decode", "mixed"], Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)],
              Annotated[int, Field(ge=0)] | None]


class SavedSet(BaseModel):
    """One warm set: the runtime whose form runs it and its graphs as (phase, batch,
    query tokens, context blocks or ``None``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer: Peer
    graphs: tuple[Graph, ...]

    def warm(self, label: str) -> PeerWarmSet:
        return PeerWarmSet.of(label, (PeerGraph(*g) for g in self.graphs))


class SavedLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_seqs: Annotated[int, Field(ge=1)]
    max_num_batched_tokens: Annotated[int, Field(ge=1)]
    max_model_len: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1)]


class GraphSetsFile(BaseModel):
    """``graph_sets.json``: the server's limits and each set by its label."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = GRAPH_SETS_VERSION
    limits: SavedLimits
    sets: dict[str, SavedSet]

    @classmethod
    def of(cls, limits: PeerLimits, sets: Mapping[str, tuple[Peer, PeerWarmSet]]) -> GraphSetsFile:
        return cls(limits=SavedLimits(**asdict(limits)),
                   sets={label: SavedSet(peer=peer, graphs=tuple((g.phase, g.batch, g.query_tokens, g.context_blocks)
                                                                 for g in warm.graphs))
                         for label, (peer, warm) in sets.items()})

    @classmethod
    def load(cls, path: str | Path) -> GraphSetsFile:
        """The file at ``path`` (a plan directory: its :data:`GRAPH_SETS_FILE`), every
        field checked; else a :class:`ConfigError` naming the file and each bad field."""
        file = Path(path)
        if file.is_dir():
            file = file / GRAPH_SETS_FILE
        return jsonfile.parse(cls, jsonfile.read_text(file, "graph sets"), str(file), "graph sets",
                              GRAPH_SETS_VERSION, strict=True)

    def peer_limits(self) -> PeerLimits:
        return PeerLimits(**self.limits.model_dump())

    def chosen(self, label: str) -> tuple[Peer, PeerWarmSet]:
        """The set of ``label``; else a :class:`ConfigError` listing the labels."""
        saved = self.sets.get(label)
        if saved is None:
            raise ConfigError(f"no graph set {label!r} in the plan: it holds {', '.join(map(repr, self.sets))}")
        return saved.peer, saved.warm(label)
