"""Replay a workload for real: real tensors, real compiles, real time, at the attention
level through a Dispatcher (:func:`run_workload`) or at the model level through a
:class:`~attnpolicy.engine.runner.StaticModelRunner`: prefill batches
(:func:`replay_prefills`) and whole requests (:func:`serve_requests`).

Attention level: each step of the batch former becomes one ``Dispatcher.attend`` call on random
tensors of the step's layout (one attention layer). Time a call stalled on a
compile (compiling synchronously, or waiting for a background compile at its
switch point: the dispatcher's stall seconds) is compile time; the rest of the call
is attention time. With ``check`` every output is compared with a float64
per-sequence reference (uncompiled VARLEN through the ``eager`` kernel).

Model level: each prefill batch runs as the runner serves it (the guarded policy decides, the batch is
placed, the graph of its key comes from the cache, compiled on a miss, and runs);
its compile (a miss's build: compile and first run) and its run are timed apart on
the chosen clock. With ``check`` every output is compared with a reference model
built from the same SPEC (same seeded weights) run eagerly, one sequence at a time,
with transformers' own SDPA attention. With a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` the model-level
simulator's prediction for the same batches, config and eviction sits beside the
measurement, with predicted/measured ratios.

Whole requests (:func:`serve_requests`): every step of the batch former (prefill,
chunked prefill, decode, mixed) runs through the runner with a
:class:`~attnpolicy.engine.kv_cache.KVCache` (one slot per running request, reused
when it finishes), each decode fed the token the step before chose greedily. With
``check`` each request's tokens must equal transformers' own greedy ``generate`` of the
reference model, and every row's logits the reference's over the whole sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnpolicy.bench.calibration import clock_of
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.dispatch.stats import BackgroundStats
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import RunnerStats, StaticModelRunner, eager_logits
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.accuracy import TOLERANCE, MaxAbsError
from attnpolicy.modelling.simulation import SimRow, replay_key_streams
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.traces import Request

#: The tolerance of a model-level replay's fp32 logits against the eager reference model.
MODEL_TOLERANCE = TOLERANCE["float32"]


@dataclass(frozen=True)
class RunResult:
    """What a real replay measured. ``cache`` is the graph cache's stats, ``modes``
    counts batches per mode; ``compile_seconds`` are the seconds batches stalled on
    compiles, ``stalls`` and ``background`` the dispatcher's figures (see
    docs/cache.md); ``max_abs_err`` (of the values finite in both), ``non_finite``
    (values non-finite in an output or its reference: any fails the check), ``tolerance``
    and ``passed`` are ``None`` unless outputs were checked against the reference; ``switch`` counts the
    switches to re-planned configs (see docs/plan.md), a switch still pending after the
    last batch waited for and applied then (``switch_at_end``): the figures do not
    depend on how fast its graphs built."""

    cache: dict[str, Any]
    modes: dict[str, int]
    batches: int
    calls: int
    guard_fallbacks: int
    overflow: int
    padding: dict[str, Any]
    attention_seconds: float
    compile_seconds: float
    total_seconds: float
    max_abs_err: float | None
    tolerance: float | None
    passed: bool | None
    config: dict[str, Any]
    spec: dict[str, Any]
    stalls: dict[str, Any]
    background: dict[str, Any]
    warmup_graphs: int = 0
    warmup_seconds: float = 0.0
    compiles_after_warmup: int = 0
    strict_violations: int = 0
    startup_seconds: float = 0.0
    warmup_loads: int = 0
    disk: dict[str, Any] | None = None
    switch: dict[str, Any] | None = None
    switch_at_end: bool = False
    non_finite: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as JSON: one key per field."""
        return asdict(self)


def _pool(rows: int, heads: int, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, heads, spec.head_dim, generator=gen).to(getattr(torch, spec.dtype))


def run_workload(requests: Sequence[Request], config: AttnPolicyConfig, spec: TensorSpec,
                 former: BatchFormer | None = None, *, check: bool = False, seed: int = 0,
                 progress: Callable[[str], None] | None = None,
                 steps: Sequence[ScheduledBatch] | None = None,
                 observe: Callable[[Dispatcher, BatchLayout], object] | None = None,
                 cost_model: CostModel | None = None) -> RunResult:
    """Run every step of ``requests`` (or the given ``steps``) through a Dispatcher;
    with ``check``, compare every output with the float64 reference. A config with a
    warm set (``warmup``) is warmed first: its compile seconds are
    ``warmup_seconds``, not part of the replay's, and ``compiles_after_warmup`` counts
    the replay's compiles; ``startup_seconds`` runs from building the dispatcher until
    its warm set is ready (loaded from ``store_dir``, or compiled), ``warmup_loads``
    counts the warm graphs loaded, ``disk`` is the store's stats (``None`` without one).
    ``observe(dispatcher, layout)`` is called after each batch has run (e.g.
    :meth:`Replanner.observe <attnpolicy.planning.replan.Replanner.observe>`).
    ``cost_model``: the dispatcher's (cost-aware's prices, the cost eviction's), the
    built-in one if None. A switch ``observe`` requested that is still pending after the
    last batch is waited for and applied (``switch_at_end``)."""
    if steps is None:
        steps = list((former or BatchFormer(max_model_len=config.max_seq_len)).steps(requests))
    start = time.perf_counter()
    with Dispatcher(config, cost_model=cost_model) as dispatcher:
        return _run(dispatcher, steps, config, spec, check, seed, progress, start, observe)


def _run(dispatcher: Dispatcher, steps: Sequence[ScheduledBatch], config: AttnPolicyConfig, spec: TensorSpec,
         check: bool, seed: int, progress: Callable[[str], None] | None, start: float,
         observe: Callable[[Dispatcher, BatchLayout], object] | None = None) -> RunResult:
    warm_keys = dispatcher.warmup(spec) if config.warmup else []
    startup = time.perf_counter() - start  # the dispatcher built and its warm set ready
    warm = dispatcher.cache.stats()
    gen = torch.Generator().manual_seed(seed)
    max_q = max((s.layout.q_tokens for s in steps), default=1)
    max_kv = max((s.layout.kv_tokens for s in steps), default=1)
    q_pool = _pool(max_q, spec.heads, spec, gen)
    k_pool, v_pool = (_pool(max_kv, spec.kv_heads, spec, gen) for _ in range(2))
    total = compile_total = 0.0
    err = MaxAbsError()
    with torch.inference_mode():
        for step in steps:
            lay = step.layout
            q, k, v = q_pool[:lay.q_tokens], k_pool[:lay.kv_tokens], v_pool[:lay.kv_tokens]
            stalled_before = dispatcher.stall_seconds
            t0 = time.perf_counter()
            out = dispatcher.attend(q, k, v, lay, spec.scale)
            total += time.perf_counter() - t0
            compile_total += dispatcher.stall_seconds - stalled_before
            if check:
                ref = attend(q.double(), k.double(), v.double(), lay, MaskMode.VARLEN, "eager",
                             scale=spec.scale)
                err.add(out, ref)
            if observe is not None:
                observe(dispatcher, lay)
            if progress:
                progress(f"step {step.index}")
    finished = dispatcher.finish_switch()
    stats = dispatcher.stats().to_json()
    tolerance = TOLERANCE[spec.dtype] if check else None
    return RunResult(
        cache=dict(stats["cache"]),
        modes=dict(stats["modes"]),
        batches=stats["batches"],
        calls=stats["calls"],
        guard_fallbacks=stats["guard_fallbacks"],
        overflow=stats["overflow"],
        padding=dict(stats["padding"]),
        attention_seconds=total - compile_total,
        compile_seconds=compile_total,
        total_seconds=total,
        max_abs_err=err.value if check else None,
        tolerance=tolerance,
        passed=None if tolerance is None else err.passes(tolerance),
        config=config.model_dump(mode="json"),
        spec={"dtype": spec.dtype, "heads": spec.heads, "kv_heads": spec.kv_heads,
              "head_dim": spec.head_dim},
        stalls=dict(stats["stalls"]),
        background=dict(stats["background"]),
        warmup_graphs=len(warm_keys),
        warmup_seconds=warm.compile_seconds,
        compiles_after_warmup=stats["cache"]["compiles"] - warm.compiles,
        strict_violations=stats["strict_violations"],
        startup_seconds=startup,
        warmup_loads=warm.loads,
        disk=None if stats["disk"] is None else dict(stats["disk"]),
        switch=dict(stats["switch"]),
        switch_at_end=finished,
        non_finite=err.non_finite if check else None,
    )


@dataclass(frozen=True)
class ModelReplay:
    """What a replay measured, and (with a cost model) what the simulator predicted.

    ``hits`` and ``misses`` count batches: those that ran on their own graph, resident when
    they ran, and the others (``hits + misses == batches``). ``compile_seconds``,
    ``load_seconds`` and ``run_seconds`` split the batches' time on ``clock``: those that
    compiled their graph, those that loaded it from the store (``loads``; ``disk``: the
    store's figures, ``None`` without one), the rest. ``background`` (``None`` unless
    ``compile_mode="background"``): the worker's compiles (as the attention level's
    ``background``), ``eager_batches`` run on the eager model meanwhile and
    ``stall_seconds`` waited for the worker; there a batch compiles nothing itself, and its
    time is run time."""

    spec: str
    policy: str
    batches: int
    modes: dict[str, int]
    hits: int
    misses: int
    compiles: int
    evictions: int
    clock: str
    compile_seconds: float
    run_seconds: float
    max_abs_err: float | None
    predicted: SimRow | None
    #: (:func:`serve_requests`) steps with cached context (decode, chunked prefill), requests
    #: served, and with ``check`` the requests whose greedy tokens differ from ``generate``'s
    context_steps: int = 0
    requests: int = 0
    token_mismatches: int | None = None
    #: with ``check``: logits non-finite in the served output or the reference (any fails
    #: the check; ``max_abs_err`` is of the rest)
    non_finite: int | None = None
    loads: int = 0
    load_seconds: float = 0.0
    disk: dict[str, Any] | None = None
    background: dict[str, Any] | None = None

    @property
    def total_seconds(self) -> float:
        return self.compile_seconds + self.load_seconds + self.run_seconds

    @property
    def passed(self) -> bool | None:
        if self.max_abs_err is None:
            return None
        return MaxAbsError(self.max_abs_err, self.non_finite or 0).passes(MODEL_TOLERANCE) and not self.token_mismatches

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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["predicted"] = None if self.predicted is None else self.predicted.to_json()
        return {**data, "total_seconds": self.total_seconds, "passed": self.passed,
                "predicted_over_measured": self.ratios()}


def replay_prefills(spec: str, layouts: Sequence[BatchLayout], config: AttnPolicyConfig, *, check: bool = False,
                 cost: ModelCostModel | None = None, clock: str = "cpu", threads: int = 1,
                 progress: Callable[[str], None] | None = None) -> ModelReplay:
    """Serve ``layouts`` (random token ids, seeded) through a runner of SPEC's model under
    ``config``, each batch's graph fetched (compiled or loaded) before it runs, whatever
    ``compile_mode``: its build and its run are timed apart."""
    torch.set_num_threads(threads)
    model, described = load_model(spec)
    reference = load_model(spec)[0] if check else None
    runner = StaticModelRunner(model, config)
    now = clock_of(clock)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    compile_s = load_s = run_s = 0.0
    err = MaxAbsError()
    modes: dict[str, int] = {}
    try:
        for layout in layouts:
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            mode = runner.decide(layout).mode
            modes[mode.value] = modes.get(mode.value, 0) + 1
            placing = now()
            batch = runner.prepare(ids, layout, mode)
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
            # a batch's run is what the calibration times (placement, graph, scatter); a miss's build
            # (or load from the store) apart
            run_s += now() - built + start - placing + (0.0 if missed else built - start)
            if missed:
                if loaded:
                    load_s += built - start
                else:
                    compile_s += built - start
            if reference is not None:
                err.add(out, eager_logits(reference, ids, layout))
            if progress:
                progress(str(batch.key))
        stats = runner.stats()
    finally:
        runner.close()
    predicted = replay_key_streams(layouts, cost, [config], [config.eviction])[0] if cost is not None else None
    c = stats.cache  # one lookup per batch
    return ModelReplay(described, config.policy, len(layouts), modes, c.hits, c.misses, c.compiles,
                       c.evictions, clock, compile_s, run_s, err.value if check else None, predicted,
                       non_finite=err.non_finite if check else None, **_graph_figures(stats, load_s, None))


def _graph_figures(stats: RunnerStats, load_seconds: float, bg: BackgroundStats | None) -> dict[str, Any]:
    """A replay's loads (``load_seconds`` on its clock), store figures and background
    compiles ``bg`` (see :class:`ModelReplay`)."""
    return {"loads": stats.cache.loads, "load_seconds": load_seconds,
            "disk": None if stats.disk is None else asdict(stats.disk),
            "background": None if bg is None else {**asdict(bg), "eager_batches": stats.eager_served,
                                                   "stall_seconds": stats.stall_seconds}}


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
    """Where :func:`serve_requests` keeps each request's keys and values: ``slots[n][i]`` is
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


def serve_requests(spec: str, requests: Sequence[Request], steps: Sequence[ScheduledBatch], config: AttnPolicyConfig,
                *, check: bool = False, clock: str = "cpu", threads: int = 1,
                progress: Callable[[str], None] | None = None, cost: ModelCostModel | None = None) -> ModelReplay:
    """Serve ``requests`` in the batch former's ``steps`` through a runner of SPEC's model
    under ``config``: prompts of random token ids (seeded per request), decodes greedy,
    keys and values in a KV cache of the slots and tokens the steps take
    (:class:`SlotPlan`), allocated before any other work
    (:class:`~attnpolicy.errors.AllocationError` when it cannot be).
    A step's time is compile time when it compiled its graph (compile and first run), load
    time when it loaded it from the store, else run time (see :class:`ModelReplay`).
    With ``cost``, the simulator's row of the steps served (each on a step graph) is
    the ``predicted`` one."""
    torch.set_num_threads(threads)
    model, described = load_model(spec)
    plan = SlotPlan.of(requests, steps)
    kv = KVCache.for_model(model, plan.count, plan.longest)
    reference = load_model(spec)[0] if check else None
    runner = StaticModelRunner(model, config)
    now = clock_of(clock)
    vocab = model.config.vocab_size
    prompts = {rid: torch.randint(0, vocab, (requests[rid].prompt_tokens,),
                                  generator=torch.Generator().manual_seed(rid)).tolist()
               for rid in {r for step in steps for r in step.seq_ids}}
    tokens = {rid: list(p) for rid, p in prompts.items()}  # prompt, then each generated token
    rows: dict[int, list[torch.Tensor]] = {rid: [] for rid in prompts}  # each fed token's logits
    fed = dict.fromkeys(prompts, 0)
    modes: dict[str, int] = {}
    compile_s = load_s = run_s = 0.0
    background = config.compile_mode == "background"  # a step builds nothing itself: its time is run time
    context_steps = 0
    served: list[BatchLayout] = []
    try:
        for step, slots, freed in zip(steps, plan.slots, plan.freed):
            q_lens = step.layout.q_lens
            kv_lens = [kv.length(s) + q for s, q in zip(slots, q_lens)]
            layout = BatchLayout.from_lens(list(q_lens), kv_lens, causal=True)
            served.append(layout)
            context_steps += layout.has_context
            ids = torch.tensor([t for rid, q in zip(step.seq_ids, q_lens) for t in tokens[rid][fed[rid]:fed[rid] + q]])
            mode = runner.decide(layout).mode
            modes[mode.value] = modes.get(mode.value, 0) + 1
            before, start = runner.cache.stats(), now()
            out = runner.run(ids, layout, mode, kv=kv, slots=slots)
            took = now() - start
            after = runner.cache.stats()
            if background or after.misses == before.misses:
                run_s += took
            elif after.loads > before.loads:
                load_s += took  # a step that loads its graph: its run is in its load
            else:
                compile_s += took  # a step that builds its graph: its run is in its build
            for i, (rid, q) in enumerate(zip(step.seq_ids, q_lens)):
                start = layout.q_starts[i]
                rows[rid].append(out[start:start + q])
                fed[rid] += q
                if fed[rid] == len(tokens[rid]):  # its last token fed: the next, greedy
                    tokens[rid].append(int(out[start + q - 1].argmax()))
            for slot in freed:  # its request done
                kv.reset(slot)
            if progress:
                progress(layout.describe())
        stats = runner.stats()
    finally:
        runner.close()
    err = MaxAbsError()
    mismatches: int | None = None
    if reference is not None:
        mismatches = 0
        with torch.no_grad():
            for rid, prompt in prompts.items():
                seq, n = tokens[rid], len(prompt)
                # generate stops at the model's end-of-sequence token; the server's steps run on
                # (a fixed output length, as a benchmark's ignore_eos): its prefix must agree
                # every position is a token: without the mask generate would infer one from
                # pad_token_id and hide the prompt's tokens of that id
                ids = torch.tensor([prompt])
                want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(seq) - n,
                                          do_sample=False)[0].tolist()
                got = torch.cat(rows[rid])
                whole = reference(input_ids=torch.tensor([seq[:got.shape[0]]]), use_cache=False).logits[0]
                greedy = whole[n - 1:].argmax(-1).tolist()  # every token the reference would choose
                mismatches += (_differs(seq, want, whole, n) or
                               _differs(seq, seq[:n] + greedy[:len(seq) - n], whole, n))
                err.add(got, whole)
    predicted = None if cost is None else replay_key_streams(served, cost, [config], [config.eviction], steps=True)[0]
    return ModelReplay(described, config.policy, len(steps), modes, stats.batch_hits, stats.batch_misses,
                       stats.cache.compiles, stats.cache.evictions, clock, compile_s, run_s,
                       err.value if check else None, predicted, context_steps, len(prompts), mismatches,
                       err.non_finite if check else None, **_graph_figures(stats, load_s, stats.background))
