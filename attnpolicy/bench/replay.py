"""Replay a workload for real: real tensors, real compiles, real time. One driver
(:func:`replay`) runs the steps of a level (a :class:`ReplayLevel`) into one
:class:`ReplayResult`; the level says what a step is, how it runs, how it is checked
and which figures it reports.

:class:`AttentionReplay`: each step of the batch former becomes one ``Dispatcher.attend``
call on random tensors of the step's layout (one attention layer). Time a call stalled
on a compile (compiling synchronously, or waiting for a background compile at its
switch point: the dispatcher's stall seconds) is compile time; the rest of the call is
run (attention) time. Checked: every output against a float64 per-sequence reference
(uncompiled VARLEN through the ``eager`` kernel).

:class:`PrefillReplay`: each prefill batch runs as a
:class:`~attnpolicy.engine.runner.StaticModelRunner` serves it (the guarded policy
decides, the batch is placed, the graph of its key comes from the cache, compiled on a
miss, and runs), its graph fetched before it runs so that a miss's build (compile and
first run, or a load from the store) and its run are timed apart on the chosen clock,
as the prefill calibration times them. Checked: every output against a reference model
built from the same SPEC (same seeded weights) run eagerly, one sequence at a time, with
transformers' own SDPA attention. With a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` the model-level
simulator's prediction for the same batches, config and eviction sits beside the
measurement, with predicted/measured ratios.

:class:`RequestReplay`: every step of the batch former (prefill, chunked prefill,
decode, mixed) runs through the runner with a
:class:`~attnpolicy.engine.kv_cache.KVCache` (one slot per running request, reused when
it finishes), each decode fed the token the step before chose greedily; a step's time
is compile, load or run time as its graph was built, loaded or resident. Checked: each
request's tokens must equal transformers' own greedy ``generate`` of the reference
model, and every row's logits the reference's over the whole sequence.

:func:`measured_sets`: rows of the warm-up schemes' comparison, each row's graph set
served as a :class:`RequestReplay` of the same steps, its measured figures by its label.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from attnpolicy.bench.calibration import clock_of
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import RunnerStats, StaticModelRunner, eager_logits
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.accuracy import TOLERANCE, MaxAbsError
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.runtime_sets import RuntimeGraphSet
from attnpolicy.modelling.simulation import SimRow, model_config, own_keys, packed_tokens, replay_key_streams
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.scheme_comparison import SchemeRow
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.traces import Request

#: The tolerance of a model-level replay's fp32 logits against the eager reference model.
MODEL_TOLERANCE = TOLERANCE["float32"]
#: A step as its level runs it.
S = TypeVar("S")


@dataclass(frozen=True)
class ReplayResult:
    """What a real replay measured, at any level. ``batches``: the steps run; ``modes``:
    batches per mode; ``misses``: graph lookups that found no resident graph (calls at the
    attention level, batches at the model level). ``compile_seconds``, ``load_seconds`` and
    ``run_seconds`` split the steps' time: stalled on (or spent in) a compile, loading a
    graph from the store, the rest. ``max_abs_err`` (of the values finite in both),
    ``non_finite`` (values non-finite in an output or its reference: any fails the check),
    ``tolerance`` and ``token_mismatches`` (whole requests: the requests whose greedy tokens
    differ from ``generate``'s) are ``None`` unless outputs were checked. ``predicted``: the
    simulator's row of the same batches (with a cost model). ``figures``: the level's own
    figures; ``json_keys``: the (JSON key, figure) pairs of :meth:`to_json`, its level's."""

    batches: int
    modes: dict[str, int]
    misses: int
    compile_seconds: float
    load_seconds: float
    run_seconds: float
    max_abs_err: float | None
    non_finite: int | None
    tolerance: float | None
    token_mismatches: int | None
    predicted: SimRow | None
    figures: dict[str, Any]
    json_keys: tuple[tuple[str, str], ...]

    @property
    def total_seconds(self) -> float:
        return self.compile_seconds + self.load_seconds + self.run_seconds

    @property
    def passed(self) -> bool | None:
        """Whether the check passed: no value non-finite, the error within tolerance, no
        token differs (``None``: not checked)."""
        if self.max_abs_err is None or self.tolerance is None:
            return None
        return MaxAbsError(self.max_abs_err, self.non_finite or 0).passes(self.tolerance) and not self.token_mismatches

    def ratios(self) -> dict[str, float | None]:
        """predicted / measured misses, compile seconds, run seconds and total seconds."""
        p = self.predicted
        if p is None:
            return {}

        def ratio(a: float, b: float) -> float | None:
            return a / b if b else None
        return {"misses": ratio(p.misses, self.misses),
                "compile_seconds": ratio(p.compile_seconds + p.warmup_seconds, self.compile_seconds),
                "run_seconds": ratio(p.run_seconds, self.run_seconds),
                "total_seconds": ratio(p.total_seconds, self.total_seconds)}

    def set_measured(self) -> dict[str, Any] | None:
        """A graph set's run (``None``: none ran): its ``graph_set`` figure's measured
        values, the steps' run-time compile (and load) and run seconds, and the total
        with the warm-up."""
        figure = self.figures.get("graph_set")
        if figure is None:
            return None
        m = figure["measured"]
        return {**m, "runtime_compile_seconds": self.compile_seconds + self.load_seconds,
                "run_seconds": self.run_seconds, "total_seconds": m["warmup_seconds"] + self.total_seconds}

    def to_json(self) -> dict[str, Any]:
        """The result as JSON: its level's keys."""
        values = {"batches": self.batches, "modes": self.modes, "misses": self.misses,
                  "compile_seconds": self.compile_seconds, "load_seconds": self.load_seconds,
                  "run_seconds": self.run_seconds, "total_seconds": self.total_seconds,
                  "max_abs_err": self.max_abs_err, "non_finite": self.non_finite, "tolerance": self.tolerance,
                  "passed": self.passed, "token_mismatches": self.token_mismatches,
                  "predicted": None if self.predicted is None else self.predicted.to_json(),
                  "predicted_over_measured": self.ratios(), **self.figures}
        return {key: values[name] for key, name in self.json_keys}


class Ran(NamedTuple):
    """One step as its level ran it: its output, its seconds (``compile``: spent building
    its graph or stalled on a compile; ``load``: loading it from the store; ``run``: the
    rest) and its progress label."""

    out: torch.Tensor
    compile: float
    load: float
    run: float
    label: str


class Summary(NamedTuple):
    """A level's figures once its last step has run (see :class:`ReplayResult`)."""

    modes: dict[str, int]
    misses: int
    figures: dict[str, Any]
    predicted: SimRow | None = None


class ReplayLevel(Protocol[S]):
    """What differs between the levels of a real replay. A level holds its runtime from
    its construction until :meth:`close`. ``steps()``: what a step is, each one's inputs
    made as it comes (after the step before ran); ``run``: how it runs; ``check``: how
    its output is compared with a reference (with ``checks``), ``checked``: what is
    checked once the runtime is closed (the token mismatches of whole requests, else
    ``None``); ``summary``: the figures it reports; ``tolerance``: of its check;
    ``json_keys``: of its result's JSON."""

    checks: bool
    tolerance: float
    json_keys: tuple[tuple[str, str], ...]

    def steps(self) -> Iterator[S]: ...
    def run(self, step: S) -> Ran: ...
    def check(self, step: S, out: torch.Tensor, err: MaxAbsError) -> None: ...
    def summary(self) -> Summary: ...
    def close(self) -> None: ...
    def checked(self, err: MaxAbsError) -> int | None: ...


def replay(level: ReplayLevel[S], progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Run every step of ``level``, each checked with the level's ``checks``; closes the level."""
    err = MaxAbsError()
    batches = 0
    compile_s = load_s = run_s = 0.0
    try:
        for step in level.steps():
            ran = level.run(step)
            batches += 1
            compile_s += ran.compile
            load_s += ran.load
            run_s += ran.run
            if level.checks:
                level.check(step, ran.out, err)
            if progress:
                progress(ran.label)
        summary = level.summary()
    finally:
        level.close()
    checked = level.checks
    mismatches = level.checked(err) if checked else None
    return ReplayResult(batches, summary.modes, summary.misses, compile_s, load_s, run_s,
                        err.value if checked else None, err.non_finite if checked else None,
                        level.tolerance if checked else None, mismatches, summary.predicted, summary.figures,
                        level.json_keys)


def _pool(rows: int, heads: int, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, heads, spec.head_dim, generator=gen).to(getattr(torch, spec.dtype))


class _Call(NamedTuple):
    """An attention step: its batch and its query, key and value tensors."""

    step: ScheduledBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class AttentionReplay:
    """Attention calls: every step of ``requests`` (or the given ``steps``) through a
    Dispatcher. A config with a warm set (``warmup``) is warmed first: its compile seconds
    are ``warmup_seconds``, not part of the replay's, and ``compiles_after_warmup`` counts
    the replay's compiles; ``startup_seconds`` runs from building the dispatcher until its
    warm set is ready (loaded from ``store_dir``, or compiled), ``warmup_loads`` counts the
    warm graphs loaded, ``disk`` is the store's stats (``None`` without one).
    ``observe(dispatcher, layout)`` is called after each batch has run (e.g.
    :meth:`Replanner.observe <attnpolicy.planning.replan.Replanner.observe>`).
    ``cost_model``: the dispatcher's (cost-aware's prices, the cost eviction's), the
    built-in one if None. A switch ``observe`` requested that is still pending after the
    last batch is waited for and applied (``switch_at_end``): the figures do not depend
    on how fast its graphs built; ``switch`` counts the switches to re-planned configs."""

    json_keys = (*own_keys("cache", "modes", "batches", "calls", "guard_fallbacks", "overflow", "padding"),
                 ("attention_seconds", "run_seconds"),
                 *own_keys("compile_seconds", "total_seconds", "max_abs_err", "tolerance", "passed", "config",
                           "spec", "stalls", "background", "warmup_graphs", "warmup_seconds",
                           "compiles_after_warmup", "strict_violations", "startup_seconds", "warmup_loads", "disk",
                           "switch", "switch_at_end", "non_finite"))

    def __init__(self, requests: Sequence[Request], config: AttnPolicyConfig, spec: TensorSpec,
                 former: BatchFormer | None = None, *, check: bool = False, seed: int = 0,
                 steps: Sequence[ScheduledBatch] | None = None,
                 observe: Callable[[Dispatcher, BatchLayout], object] | None = None,
                 cost_model: CostModel | None = None) -> None:
        if steps is None:
            steps = list((former or BatchFormer(max_model_len=config.max_seq_len)).steps(requests))
        self.checks, self.tolerance = check, TOLERANCE[spec.dtype]
        self._steps, self._config, self._spec, self._seed, self._observe = steps, config, spec, seed, observe
        self._start = time.perf_counter()
        self._dispatcher = Dispatcher(config, cost_model=cost_model)

    def steps(self) -> Iterator[_Call]:
        """Each step on random tensors of its layout, drawn once the warm set is ready."""
        d, spec, steps = self._dispatcher, self._spec, self._steps
        self._warm_keys = d.warmup(spec) if self._config.warmup else []
        self._startup = time.perf_counter() - self._start  # the dispatcher built and its warm set ready
        self._warm = d.cache.stats()
        gen = torch.Generator().manual_seed(self._seed)
        max_q = max((s.layout.q_tokens for s in steps), default=1)
        max_kv = max((s.layout.kv_tokens for s in steps), default=1)
        q_pool = _pool(max_q, spec.heads, spec, gen)
        k_pool, v_pool = (_pool(max_kv, spec.kv_heads, spec, gen) for _ in range(2))
        for step in steps:
            lay = step.layout
            yield _Call(step, q_pool[:lay.q_tokens], k_pool[:lay.kv_tokens], v_pool[:lay.kv_tokens])

    def run(self, call: _Call) -> Ran:
        d, lay = self._dispatcher, call.step.layout
        stalled_before = d.stall_seconds
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = d.attend(call.q, call.k, call.v, lay, self._spec.scale)
            took = time.perf_counter() - t0
        stalled = d.stall_seconds - stalled_before
        if self._observe is not None:
            self._observe(d, lay)
        return Ran(out, stalled, 0.0, took - stalled, f"step {call.step.index}")

    def check(self, call: _Call, out: torch.Tensor, err: MaxAbsError) -> None:
        with torch.inference_mode():
            ref = attend(call.q.double(), call.k.double(), call.v.double(), call.step.layout, MaskMode.VARLEN,
                         "eager", scale=self._spec.scale)
            err.add(out, ref)

    def summary(self) -> Summary:
        finished = self._dispatcher.finish_switch()
        stats = self._dispatcher.stats().to_json()
        spec, warm = self._spec, self._warm
        return Summary(dict(stats["modes"]), stats["cache"]["misses"], {
            "cache": dict(stats["cache"]), "calls": stats["calls"], "guard_fallbacks": stats["guard_fallbacks"],
            "overflow": stats["overflow"], "padding": dict(stats["padding"]),
            "config": self._config.model_dump(mode="json"),
            "spec": {"dtype": spec.dtype, "heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim},
            "stalls": dict(stats["stalls"]), "background": dict(stats["background"]),
            "warmup_graphs": len(self._warm_keys), "warmup_seconds": warm.compile_seconds,
            "compiles_after_warmup": stats["cache"]["compiles"] - warm.compiles,
            "strict_violations": stats["strict_violations"], "startup_seconds": self._startup,
            "warmup_loads": warm.loads, "disk": None if stats["disk"] is None else dict(stats["disk"]),
            "switch": dict(stats["switch"]), "switch_at_end": finished})

    def close(self) -> None:
        self._dispatcher.close()

    def checked(self, err: MaxAbsError) -> None:
        return None


class _RunnerReplay:
    """What the whole-model levels share: a runner of SPEC's model under ``config`` (with
    ``slots``: a KV cache of their slots and tokens, allocated before any other work,
    :class:`~attnpolicy.errors.AllocationError` when it cannot be), its steps timed on
    ``clock`` with ``threads`` threads, a reference model with ``check``, the simulator's
    prediction with ``cost``. Its figures (see :class:`ReplayResult`): ``hits`` (forwards
    that ran on their own graph, resident when they ran; ``hits + misses`` is the forwards
    run: a batch's one, a ROWS step's one per phase),
    ``compiles``, ``evictions``, ``loads`` and ``disk`` (the store's figures, ``None``
    without one) of the graph cache, ``background`` (``None`` unless
    ``compile_mode="background"``: the worker's compiles, as the attention level's
    ``background``, ``eager_batches`` run on the eager model meanwhile and
    ``stall_seconds`` waited for the worker; there a batch compiles nothing itself, and
    its time is run time), ``context_steps`` (steps with cached context: decode, chunked
    prefill) and ``requests`` served."""

    tolerance = MODEL_TOLERANCE
    json_keys = own_keys("spec", "policy", "batches", "modes", "hits", "misses", "compiles", "evictions", "clock",
                         "compile_seconds", "run_seconds", "max_abs_err", "predicted", "context_steps", "requests",
                         "token_mismatches", "non_finite", "loads", "load_seconds", "disk", "background",
                         "total_seconds", "passed", "predicted_over_measured")

    def __init__(self, spec: str, config: AttnPolicyConfig, *, check: bool, clock: str, threads: int,
                 cost: ModelCostModel | None, slots: SlotPlan | None = None) -> None:
        torch.set_num_threads(threads)
        self.checks, self._config, self._clock, self._cost = check, config, clock, cost
        self._model, self._described = load_model(spec)
        self._kv = None if slots is None else KVCache.for_model(self._model, slots.count, slots.longest)
        self._reference = load_model(spec)[0] if check else None
        self._runner = StaticModelRunner(self._model, config)
        self._now = clock_of(clock)
        self._modes: dict[str, int] = {}

    def _decide(self, layout: BatchLayout) -> MaskMode:
        """The mode the runner's policy decides for ``layout``, counted."""
        mode = self._runner.decide(layout).mode
        self._modes[mode.value] = self._modes.get(mode.value, 0) + 1
        return mode

    def _summary(self, stats: RunnerStats, hits: int, misses: int, layouts: Sequence[BatchLayout] | None, *,
                 requests: int = 0, context_steps: int = 0, steps: bool = False) -> Summary:
        """The figures of ``stats`` (``layouts``: as served, priced with ``steps`` graphs;
        ``None``: no simulator's prediction)."""
        c, bg = stats.cache, stats.background if steps else None
        cost, config = self._cost, self._config
        predicted = None if cost is None or layouts is None else replay_key_streams(
            layouts, cost, [config], [config.eviction], steps=steps)[0]
        return Summary(dict(self._modes), misses, {
            "spec": self._described, "policy": config.policy, "hits": hits, "compiles": c.compiles,
            "evictions": c.evictions, "clock": self._clock, "context_steps": context_steps, "requests": requests,
            "loads": c.loads, "disk": None if stats.disk is None else asdict(stats.disk),
            "background": None if bg is None else {**asdict(bg), "eager_batches": stats.eager_served,
                                                   "stall_seconds": stats.stall_seconds}}, predicted)

    def _eager_reference(self) -> Any:
        """The reference model (checked replays only)."""
        if self._reference is None:
            raise RuntimeError("the replay was not built with check=True: it has no reference model")
        return self._reference

    def close(self) -> None:
        self._runner.close()


class _Prefill(NamedTuple):
    layout: BatchLayout
    ids: torch.Tensor


class PrefillReplay(_RunnerReplay):
    """Prefill batches: ``layouts`` (random token ids, seeded) served through a runner of
    SPEC's model under ``config``, each batch's graph fetched (compiled or loaded) before
    it runs, whatever ``compile_mode``: its build and its run are timed apart (a batch's
    run is what the calibration times: placement, graph, scatter)."""

    def __init__(self, spec: str, layouts: Sequence[BatchLayout], config: AttnPolicyConfig, *,
                 check: bool = False, cost: ModelCostModel | None = None, clock: str = "cpu",
                 threads: int = 1) -> None:
        super().__init__(spec, config, check=check, clock=clock, threads=threads, cost=cost)
        self._layouts = layouts

    def steps(self) -> Iterator[_Prefill]:
        gen = torch.Generator().manual_seed(0)
        vocab = self._model.config.vocab_size
        for layout in self._layouts:
            yield _Prefill(layout, torch.randint(0, vocab, (layout.q_tokens,), generator=gen))

    def run(self, step: _Prefill) -> Ran:
        runner, now, layout = self._runner, self._now, step.layout
        mode = self._decide(layout)
        placing = now()
        batch = runner.prepare(step.ids, layout, mode)
        missed, loads = batch.key not in runner.cache, runner.cache.stats().loads
        start = now()
        graph = runner.graph_for(batch, pin=True)
        built = now()
        loaded = runner.cache.stats().loads > loads
        try:
            with torch.no_grad():
                out = batch.scatter(graph(*batch.inputs), layout.q_tokens)
        finally:
            runner.cache.unpin([batch.key])
        run = now() - built + start - placing + (0.0 if missed else built - start)
        build = built - start if missed else 0.0
        return Ran(out, 0.0 if loaded else build, build if loaded else 0.0, run, str(batch.key))

    def check(self, step: _Prefill, out: torch.Tensor, err: MaxAbsError) -> None:
        err.add(out, eager_logits(self._eager_reference(), step.ids, step.layout))

    def summary(self) -> Summary:
        stats = self._runner.stats()
        return self._summary(stats, stats.cache.hits, stats.cache.misses, self._layouts)  # one lookup per forward

    def checked(self, err: MaxAbsError) -> None:
        return None


def _differs(got: list[int], want: list[int], logits: torch.Tensor, n: int) -> bool:
    """Whether token sequences ``got`` and ``want`` (a prompt of ``n`` tokens, then greedy
    choices) part at a real choice: where they first differ, the reference's ``logits``
    of the two tokens are more than :data:`MODEL_TOLERANCE` apart (within it, a tie that either
    side's rounding decides; past it the sequences are not comparable)."""
    at = next((i for i in range(n, min(len(got), len(want))) if got[i] != want[i]), None)
    if at is None:
        return False
    row = logits[at - 1]
    return float(abs(row[got[at]] - row[want[at]])) > MODEL_TOLERANCE


@dataclass(frozen=True)
class SlotPlan:
    """Where :class:`RequestReplay` keeps each request's keys and values: ``slots[n][i]`` is
    the KV-cache slot of sequence ``i`` of step ``n`` (a request's from its first step
    until it is done: its prompt fed and its decodes run), ``freed[n]`` the slots free
    again after step ``n``; ``count`` slots in all, holding at most ``longest`` tokens
    each (what the steps run, not the batch former's bounds)."""

    slots: tuple[tuple[int, ...], ...]
    freed: tuple[tuple[int, ...], ...]
    count: int
    longest: int

    @classmethod
    def of(cls, requests: Sequence[Request], steps: Sequence[ScheduledBatch]) -> SlotPlan:
        """The slots of ``requests`` served in ``steps``: a new request takes a freed slot, else a new one."""
        slot_of: dict[int, int] = {}
        fed: dict[int, int] = {}
        left: dict[int, int] = {}  # decode steps to come: the prefill samples the first output token
        free: list[int] = []
        slots, freed = [], []
        count = longest = 0
        for step in steps:
            for rid in step.seq_ids:
                if rid not in slot_of:
                    slot_of[rid] = free.pop() if free else count
                    count = max(count, slot_of[rid] + 1)
                    fed[rid], left[rid] = 0, max(requests[rid].output_tokens - 1, 0)
            slots.append(tuple(slot_of[r] for r in step.seq_ids))
            done = []
            for i, (rid, q) in enumerate(zip(step.seq_ids, step.layout.q_lens)):
                fed[rid] += q
                longest = max(longest, fed[rid])
                if i < step.num_decode:
                    left[rid] -= 1
                if fed[rid] >= requests[rid].prompt_tokens and left[rid] == 0:
                    done.append(slot_of.pop(rid))
            free += done
            freed.append(tuple(done))
        return cls(tuple(slots), tuple(freed), max(count, 1), max(longest, 1))


class _Served(NamedTuple):
    """A step of whole requests: its batch, each sequence's slot, the slots freed after it,
    its layout over the cached context and its token ids."""

    step: ScheduledBatch
    slots: tuple[int, ...]
    freed: tuple[int, ...]
    layout: BatchLayout
    ids: torch.Tensor


class RequestReplay(_RunnerReplay):
    """Whole requests: ``requests`` served in the batch former's ``steps`` through a runner
    of SPEC's model under ``config``: prompts of random token ids (seeded per request),
    decodes greedy, keys and values in a KV cache of the slots and tokens the steps take
    (:class:`SlotPlan`). A step's time is compile time when it compiled its graph (compile
    and first run), load time when it loaded it from the store, else run time. With
    ``cost``, the simulator's row of the steps served (each on a step graph) is the
    ``predicted`` one.

    With ``graphs`` (a runtime's graph set) no policy decides: the set's graphs are
    compiled first (the warm-up, timed apart from the steps, then strict mode on), and
    each step runs in the runtime's form on the set's graphs. Its figure ``graph_set``
    says what was measured (graphs, warm-up seconds, run-time compiles, padding, each
    build's static estimate and RSS) and, with ``cost``, what the set is modelled to
    cost on the same steps (its row of the comparison)."""

    json_keys = (*_RunnerReplay.json_keys, ("graph_set", "graph_set"))

    def __init__(self, spec: str, requests: Sequence[Request], steps: Sequence[ScheduledBatch],
                 config: AttnPolicyConfig, *, check: bool = False, clock: str = "cpu", threads: int = 1,
                 cost: ModelCostModel | None = None, graphs: RuntimeGraphSet | None = None) -> None:
        self._plan = SlotPlan.of(requests, steps)
        super().__init__(spec, config, check=check, clock=clock, threads=threads, cost=cost, slots=self._plan)
        self._requests, self._steps, self._graphs = requests, steps, graphs
        self._warmup_seconds, self._warm = 0.0, self._runner.cache.stats()
        self._computed = self._tokens_run = 0  # rows the set's graphs computed, and the tokens they held
        vocab = self._model.config.vocab_size
        self._prompts = {rid: torch.randint(0, vocab, (requests[rid].prompt_tokens,),
                                            generator=torch.Generator().manual_seed(rid)).tolist()
                         for rid in {r for step in steps for r in step.seq_ids}}
        self._tokens = {rid: list(p) for rid, p in self._prompts.items()}  # prompt, then each generated token
        self._rows: dict[int, list[torch.Tensor]] = {rid: [] for rid in self._prompts}  # each fed token's logits
        self._fed = dict.fromkeys(self._prompts, 0)
        self._served: list[BatchLayout] = []
        # a step builds nothing itself in the background: its time is run time
        self._background = config.compile_mode == "background"

    def steps(self) -> Iterator[_Served]:
        kv, tokens, fed = self._kv, self._tokens, self._fed
        assert kv is not None  # built from the slot plan
        if self._graphs is not None:  # the warm-up, before the first step
            start = self._now()
            self._runner.warmup_keys(self._graphs.keys)
            self._warmup_seconds, self._warm = self._now() - start, self._runner.cache.stats()
        for step, slots, freed in zip(self._steps, self._plan.slots, self._plan.freed):
            q_lens = step.layout.q_lens
            kv_lens = [kv.length(s) + q for s, q in zip(slots, q_lens)]
            layout = BatchLayout.from_lens(list(q_lens), kv_lens, causal=True)
            self._served.append(layout)
            ids = torch.tensor([t for rid, q in zip(step.seq_ids, q_lens) for t in tokens[rid][fed[rid]:fed[rid] + q]])
            yield _Served(step, slots, freed, layout, ids)

    def run(self, s: _Served) -> Ran:
        runner, now, layout, graphs, kv = self._runner, self._now, s.layout, self._graphs, self._kv
        assert kv is not None
        before, start = runner.cache.stats(), now()
        if graphs is None:
            out = runner.run(s.ids, layout, self._decide(layout), kv=kv, slots=s.slots)
        else:
            out = runner.serve(s.ids, layout, graphs, kv=kv, slots=s.slots)
        took = now() - start
        if graphs is not None:
            self._computed += sum(key.tokens for _, _, key in graphs.parts(layout))
            self._tokens_run += sum(layout.q_lens)
        after = runner.cache.stats()
        if self._background or after.misses == before.misses:
            seconds = (0.0, 0.0, took)
        elif after.loads > before.loads:
            seconds = (0.0, took, 0.0)  # a step that loads its graph: its run is in its load
        else:
            seconds = (took, 0.0, 0.0)  # a step that builds its graph: its run is in its build
        for i, (rid, q) in enumerate(zip(s.step.seq_ids, layout.q_lens)):
            self._fed[rid] += q
            if self._fed[rid] == len(self._tokens[rid]):  # its last token fed: the next, greedy
                self._tokens[rid].append(int(out[layout.q_starts[i] + q - 1].argmax()))
        assert self._kv is not None
        for slot in s.freed:  # its request done
            self._kv.reset(slot)
        return Ran(out, *seconds, layout.describe())

    def check(self, s: _Served, out: torch.Tensor, err: MaxAbsError) -> None:
        """Keep each row's logits: checked once the requests are served (:meth:`checked`)."""
        for i, (rid, q) in enumerate(zip(s.step.seq_ids, s.layout.q_lens)):
            start = s.layout.q_starts[i]
            self._rows[rid].append(out[start:start + q])

    def summary(self) -> Summary:
        stats = self._runner.stats()
        served, graphs = self._served, self._graphs
        if graphs is None:
            summary = self._summary(stats, stats.forward_hits, stats.forward_misses, served,
                                    requests=len(self._prompts),
                                    context_steps=sum(layout.has_context for layout in served), steps=True)
            return summary._replace(figures={**summary.figures, "graph_set": None})
        cost = self._cost
        summary = self._summary(stats, stats.forward_hits, stats.forward_misses, None, requests=len(self._prompts),
                                context_steps=sum(layout.has_context for layout in served))
        warm = self._warm  # the cache after the warm-up: its graphs compiled (or loaded) then
        measured = {"graphs": warm.compiles + warm.loads, "warmup_seconds": self._warmup_seconds,
                    "runtime_compiles": stats.cache.compiles - warm.compiles,
                    "strict_violations": stats.strict_violations,
                    "padding": (self._computed - self._tokens_run) / self._tokens_run if self._tokens_run else 0.0,
                    "estimate_bytes": sum(m.estimate_bytes for m in stats.memory),
                    "rss_bytes": sum(m.rss_bytes for m in stats.memory)}
        figure = {"name": graphs.name, "peer": graphs.peer, "limits": asdict(graphs.limits), "measured": measured,
                  "modelled": None if cost is None else graphs.cost(served, cost).to_json()}
        # no policy decides: the modes are the forwards' graphs', as the runner counts them
        return Summary(dict(stats.modes), summary.misses, {**summary.figures, "policy": None, "graph_set": figure})

    def checked(self, err: MaxAbsError) -> int:
        """The requests whose greedy tokens differ from ``generate``'s; every row's logits into ``err``."""
        reference, mismatches = self._eager_reference(), 0
        with torch.no_grad():
            for rid, prompt in self._prompts.items():
                seq, n = self._tokens[rid], len(prompt)
                # generate stops at the model's end-of-sequence token; the server's steps run on
                # (a fixed output length, as a benchmark's ignore_eos): its prefix must agree
                # every position is a token: without the mask generate would infer one from
                # pad_token_id and hide the prompt's tokens of that id
                ids = torch.tensor([prompt])
                want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(seq) - n,
                                          do_sample=False)[0].tolist()
                got = torch.cat(self._rows[rid])
                whole = reference(input_ids=torch.tensor([seq[:got.shape[0]]]), use_cache=False).logits[0]
                greedy = whole[n - 1:].argmax(-1).tolist()  # every token the reference would choose
                mismatches += (_differs(seq, want, whole, n) or
                               _differs(seq, seq[:n] + greedy[:len(seq) - n], whole, n))
                err.add(got, whole)
        return mismatches


def measured_sets(spec: str, rows: Sequence[SchemeRow], limits: PeerLimits, requests: Sequence[Request],
                  steps: Sequence[ScheduledBatch], cost: ModelCostModel, former: BatchFormer,
                  progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Each of ``rows``' warm set (rows that
    :meth:`~attnpolicy.planning.scheme_comparison.SchemeComparison.measurable` allows, of a
    comparison under ``limits``) run on the ``steps`` of ``requests`` through a runner of
    SPEC under the config the simulation assumes (the cost model's backend, strict mode
    warning), CPU seconds: its measured figures (:meth:`ReplayResult.set_measured`) by
    the row's label; ``progress(label)`` after each step. Raises
    :class:`~attnpolicy.errors.ConfigError` (SPEC, or a set this runner cannot serve) and
    :class:`~attnpolicy.errors.AllocationError` (the KV cache of the requests that run
    at once, each at its longest)."""
    config = model_config(cost, former.max_model_len, packed_tokens(former), strict="warn")

    def measured(row: SchemeRow) -> dict[str, Any]:
        assert row.warm is not None and row.peer is not None  # measurable
        graphs = RuntimeGraphSet(row.scheme, row.peer, row.warm, limits, config.backend)
        result = replay(RequestReplay(spec, requests, steps, config, graphs=graphs),
                        None if progress is None else lambda label: progress(f"{row.scheme}: {label}"))
        figures = result.set_measured()
        assert figures is not None  # a graph set ran
        return figures
    return {row.scheme: measured(row) for row in rows}
