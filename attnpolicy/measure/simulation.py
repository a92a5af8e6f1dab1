"""Replay a workload with a cost model instead of compute: fast enough to sweep
policies × cache capacities × evictions.

Each configuration runs a real :class:`~attnpolicy.dispatcher.Dispatcher` (decision,
guard, plan, graph cache) over the batches of a
:class:`~attnpolicy.measure.batching.BatchFormer`, with a builder that compiles nothing:
a miss is charged the model's compile seconds, every call the model's run seconds
plus the dispatch overhead, and every MASK call whose dense mask is not in the
mask cache (mirrored: a :class:`~attnpolicy.kernels.masks.MaskCache` bounded by
``max_mask_bytes``, keyed like the dispatcher's) a host mask build. Hits, misses and evictions are
therefore exactly those of a real run of the same batches and config.

``belady`` is the offline optimum: the key sequence of the policy's LRU run at the
same capacity is replayed through Belady's strategy (evict the graph needed
farthest in the future). For a policy whose decisions do not depend on the cache
(every fixed policy) that sequence is the one it always requests, so the row is
the fewest misses any eviction could achieve. A cache-aware policy (``cost-aware``)
chooses differently under another cache; its belady row is the bound for the
sequence it chose under LRU. See ``docs/simulate.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import GraphFamily
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels.masks import MaskCache, mask_for
from attnpolicy.measure.batching import BatchFormer, Step
from attnpolicy.measure.layout_stream import LayoutRun
from attnpolicy.measure.workload import Request
from attnpolicy.plugins.registry import eviction_registry

BELADY = "belady"
#: The JSON form of every row holds at least these keys (the stable contract).
ROW_FIELDS = ("policy", "capacity", "eviction", "hits", "misses", "hit_rate", "compiles",
              "compile_seconds", "attention_seconds", "total_seconds", "peak_bytes")


@dataclass(frozen=True)
class SimRow:
    """One simulated (policy, capacity, eviction): cache counters and modelled seconds.

    ``attention_seconds`` includes dispatch overheads and mask builds (also given
    alone as ``mask_build_seconds``); ``total_seconds`` is attention plus compile
    seconds; ``capacity`` is ``max_graphs`` (``None``: unbounded); ``modes`` counts
    batches per mode; ``policy_options`` are the options the policy ran with;
    ``rejected`` counts the requests the batch former left out (too long)."""

    policy: str
    capacity: int | None
    eviction: str
    hits: int
    misses: int
    hit_rate: float
    compiles: int
    compile_seconds: float
    attention_seconds: float
    total_seconds: float
    peak_bytes: int
    peak_graphs: int
    evictions: int
    distinct_keys: int
    batches: int
    calls: int
    modes: dict[str, int]
    guard_fallbacks: int
    overflow_calls: int
    mask_builds: int
    mask_build_seconds: float
    policy_options: dict[str, Any] = field(default_factory=dict)
    rejected: int = 0

    def to_json(self) -> dict[str, Any]:
        """The row as JSON: one key per field."""
        return asdict(self)


class SimulatedGraph:
    """What the simulation's builder returns for a key: it stands for the compiled
    graph in the cache and is never called."""

    __slots__ = ("key",)

    def __init__(self, key: GraphKey) -> None:
        self.key = key

    def __call__(self, *args: Any) -> Any:
        raise TypeError(f"the simulated graph for key {self.key} has no computation")


def _simulated(call: Call, key: GraphKey, spec: TensorSpec) -> SimulatedGraph:
    return SimulatedGraph(key)


def simulation_config(model: CostModel, former: BatchFormer, **fields: Any) -> AttnPolicyConfig:
    """The base config for simulating ``former``'s batches with ``model``: the model's
    backend, ``attn_impl`` and ``partition_len``, ``max_seq_len`` = the former's
    ``max_model_len`` and ``max_batch_tokens`` at least ``max_num_seqs × max_model_len``,
    so that no packed MASK call (whose kv length is the sum of its sequences'
    contexts) overflows the buckets. ``fields`` override any of these."""
    packed = former.max_num_seqs * former.max_model_len
    base: dict[str, Any] = {"backend": model.backend, "attn_impl": model.impl,
                            "partition_len": model.partition_len, "max_seq_len": former.max_model_len,
                            "max_batch_tokens": max(packed, AttnPolicyConfig.model_fields["max_batch_tokens"].default)}
    return AttnPolicyConfig.model_validate({**base, **fields})


@dataclass
class _Replay:
    """What one dispatcher run over the batches produced (before any Belady pass)."""

    keys: list[GraphKey] = field(default_factory=list)
    attention_seconds: float = 0.0
    mask_builds: int = 0
    mask_build_seconds: float = 0.0
    overflow_calls: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def _replay(steps: Sequence[Step | BatchLayout], config: AttnPolicyConfig, model: CostModel,
            spec: TensorSpec | None = None) -> _Replay:
    spec = spec or model.spec
    cache: GraphCache[SimulatedGraph] = GraphCache.from_config(config, sizeof=model.graph_bytes,
                                                               compile_cost=model.compile_cost)
    dispatcher = Dispatcher(config, builder=_simulated, cost_model=model, cache=cache)
    masks = MaskCache(config.max_mask_bytes)
    out = _Replay()
    keys = out.keys
    seconds = 0.0
    overhead = model.call_overhead_seconds
    for step in steps:
        layout = step.layout if isinstance(step, Step) else step
        for call, graph in dispatcher.prepare(layout, spec):
            if isinstance(graph, SimulatedGraph):
                keys.append(graph.key)
                seconds += model.run_seconds(graph.key) + overhead
            else:  # longer than the largest bucket: runs uncompiled (on_overflow="eager")
                out.overflow_calls += 1
                seconds += model.call_seconds(call.family, call.q_bucket, call.kv_bucket) + overhead
            if call.family is GraphFamily.MASK:
                mask_key = (mask_for(layout), call.q_bucket, call.kv_bucket, spec.device)
                if mask_key not in masks:
                    out.mask_builds += 1
                    out.mask_build_seconds += model.mask_build_seconds(call.q_bucket, call.kv_bucket)
                masks.lookup(mask_key, call.q_bucket * call.kv_bucket, bool)
    out.attention_seconds = seconds + out.mask_build_seconds
    out.stats = dispatcher.stats().to_json()
    return out


def next_uses(keys: Sequence[GraphKey]) -> list[float]:
    """For each position, the position of the same key's next request (``inf``: none)."""
    out = [math.inf] * len(keys)
    last: dict[GraphKey, float] = {}
    for i in range(len(keys) - 1, -1, -1):
        out[i] = last.get(keys[i], math.inf)
        last[keys[i]] = i
    return out


def belady_cache(keys: Sequence[GraphKey], config: AttnPolicyConfig,
                 model: CostModel) -> GraphCache[SimulatedGraph]:
    """A graph cache bounded like ``config`` that served ``keys`` in order with Belady's
    eviction (an oracle of the sequence's future); its stats are the bound."""
    upcoming: dict[GraphKey, float] = {}
    cache: GraphCache[SimulatedGraph] = GraphCache.from_config(
        config, eviction=BELADY, eviction_options={"next_use": upcoming.__getitem__},
        sizeof=model.graph_bytes, compile_cost=model.compile_cost)
    for key, nxt in zip(keys, next_uses(keys)):
        upcoming[key] = nxt
        cache.get_or_compile(key, partial(SimulatedGraph, key))
    return cache


def _row(policy: str, config: AttnPolicyConfig, eviction: str, replay: _Replay,
         cache_stats: Mapping[str, Any], rejected: int) -> SimRow:
    hits, misses = cache_stats["hits"], cache_stats["misses"]
    stats = replay.stats
    return SimRow(
        policy=policy,
        capacity=config.max_graphs,
        eviction=eviction,
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        compiles=cache_stats["compiles"],
        compile_seconds=cache_stats["compile_seconds"],
        attention_seconds=replay.attention_seconds,
        total_seconds=replay.attention_seconds + cache_stats["compile_seconds"],
        peak_bytes=cache_stats["peak_bytes"],
        peak_graphs=cache_stats["peak_graphs"],
        evictions=cache_stats["evictions"],
        distinct_keys=len(set(replay.keys)),
        batches=stats["batches"],
        calls=stats["calls"],
        modes=dict(stats["modes"]),
        guard_fallbacks=stats["guard_fallbacks"],
        overflow_calls=replay.overflow_calls,
        mask_builds=replay.mask_builds,
        mask_build_seconds=replay.mask_build_seconds,
        policy_options=dict(config.policy_options),
        rejected=rejected,
    )


def extrapolation(model: CostModel, requests: Sequence[Request], former: BatchFormer) -> str | None:
    """A warning when the longest admitted request is more than twice the longest
    length ``model`` was calibrated on (its seconds are then extrapolated), else ``None``."""
    measured = max((x.cols for x in model.samples), default=0)
    longest = max((r.prompt_tokens + r.output_tokens for r in requests if former.fits(r)), default=0)
    if measured and longest > 2 * measured:
        return (f"the cost model was calibrated up to {measured} tokens but the workload holds "
                f"requests of {longest} tokens: its seconds are extrapolated (calibrate with "
                f"--max-len {1 << (longest - 1).bit_length()})")
    return None


def check_model(config: AttnPolicyConfig, model: CostModel) -> None:
    """:class:`ConfigError` unless ``model`` was calibrated for ``config``'s backend and impl."""
    if (config.backend, config.attn_impl) != (model.backend, model.impl):
        raise ConfigError(f"config backend={config.backend!r}, attn_impl={config.attn_impl!r} differ from "
                          f"the cost model's backend={model.backend!r}, impl={model.impl!r}: calibrate a "
                          "model for this config or change it")


def _rejections(former: BatchFormer) -> str:
    """Why the former rejected its requests, e.g. ``3 need more than max_model_len=8192
    tokens (the first: 1e+23 prompt + 10 output)``."""
    first = former.rejected[0]
    need = "prompt" if former.prefill_only else "prompt + output"
    return (f"{len(former.rejected)} need more than max_model_len={former.max_model_len} tokens "
            f"({need}; the first: {first.prompt_tokens} prompt + {first.output_tokens} output)")


def _check_evictions(evictions: Iterable[str]) -> None:
    known = set(eviction_registry())
    for name in evictions:
        if name not in known:
            raise ConfigError(f"eviction {name!r} is not a registered eviction strategy; "
                              f"known evictions: {', '.join(sorted(known))}")


def simulate(
    requests: Sequence[Request],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    evictions: Sequence[str],
    config_base: AttnPolicyConfig | None = None,
    model: CostModel | None = None,
    former_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[SimRow]:
    """One row per (policy, capacity, eviction), in that nesting order.

    ``capacity`` is ``max_graphs`` (``None``: unbounded); every other config field
    comes from ``config_base`` (default: :func:`simulation_config`); ``model``
    defaults to :meth:`CostModel.default`; ``former_options`` are
    :class:`BatchFormer` keyword arguments. ``progress(label)`` is called after each
    row. ``policy_options[name]`` are the options of policy ``name``; the base
    config's ``policy_options`` apply to its own policy only. A trace whose every
    request is rejected (longer than ``max_model_len``) raises :class:`ConfigError`
    saying why; ``rejected`` in each row counts the requests left out. Rows hold
    :data:`ROW_FIELDS` and more: ``attention_seconds`` includes dispatch overheads and
    mask builds (also given alone as ``mask_build_seconds``); ``total_seconds`` is
    attention plus compile seconds.
    """
    model = model or CostModel.default()
    former = BatchFormer(**dict(former_options or {}))
    base = config_base or simulation_config(model, former)
    check_model(base, model)
    steps = list(former.steps(requests))
    rejected = former.rejected
    if rejected and len(rejected) == len(requests):
        raise ConfigError(f"every request ({len(requests)}) was rejected: {_rejections(former)}; "
                          "nothing to simulate (raise max_model_len or check the trace)")
    return simulate_layouts(steps, policies, capacities, evictions, base, model, progress=progress,
                            policy_options=policy_options, rejected=len(rejected))


def simulate_layouts(
    steps: Sequence[Step | BatchLayout],
    policies: Sequence[str],
    capacities: Sequence[int | None],
    evictions: Sequence[str],
    config_base: AttnPolicyConfig,
    model: CostModel | None = None,
    spec: TensorSpec | None = None,
    progress: Callable[[str], None] | None = None,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
    rejected: int = 0,
) -> list[SimRow]:
    """:func:`simulate` over given steps (or layouts, e.g. a recorded layout stream,
    see :mod:`attnpolicy.measure.layout_stream`) instead of a batch former's.

    ``spec`` (default: the model's) is the tensor spec of the graph keys: give the
    recorded one to reproduce a recorded run's keys, and with them its hits, misses
    and ``max_bytes`` evictions exactly. Costs are the model's, whatever its backend.
    ``rejected`` is reported in every row (requests the caller left out).
    """
    model = model or CostModel.default()
    _check_evictions(evictions)
    base = config_base
    fields = base.model_dump(mode="json")
    lru_runs: dict[tuple[str, int | None], _Replay] = {}
    rows = []
    for policy in policies:
        options = {**(base.policy_options if policy == base.policy else {}),
                   **(policy_options or {}).get(policy, {})}
        for capacity in capacities:
            def config(eviction: str, policy: str = policy, capacity: int | None = capacity,
                       options: dict[str, Any] = options) -> AttnPolicyConfig:
                return AttnPolicyConfig.model_validate(
                    {**fields, "policy": policy, "policy_options": options, "max_graphs": capacity,
                     "eviction": eviction})

            for eviction in evictions:
                if eviction == BELADY:
                    if (policy, capacity) not in lru_runs:
                        lru_runs[policy, capacity] = _replay(steps, config("lru"), model, spec)
                    replay = lru_runs[policy, capacity]
                    cfg = config("lru")
                    stats = belady_cache(replay.keys, cfg, model).stats().to_json()
                else:
                    cfg = config(eviction)
                    replay = _replay(steps, cfg, model, spec)
                    if eviction == "lru":
                        lru_runs[policy, capacity] = replay
                    stats = replay.stats["cache"]
                rows.append(_row(policy, cfg, eviction, replay, stats, rejected))
                if progress:
                    progress(f"{policy} capacity={capacity} {eviction}")
    return rows



def simulate_run(run: LayoutRun, policies: Sequence[str], capacities: Sequence[int | None],
                 evictions: Sequence[str], model: CostModel | None = None,
                 config_base: AttnPolicyConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 policy_options: Mapping[str, Mapping[str, Any]] | None = None) -> list[SimRow]:
    """:func:`simulate_layouts` over a recorded run's layouts, with its tensor spec and
    (unless ``config_base`` is given) the config it ran with: the row for the recorded
    policy, ``max_graphs`` and eviction reproduces the run's misses."""
    return simulate_layouts(run.layouts, policies, capacities, evictions, config_base or run.config,
                            model, run.spec, progress, policy_options)
