"""Replay a workload for real: real tensors, real compiles, real time, at the attention
level through a Dispatcher (:func:`run_workload`) or at the model level through a
:class:`~attnpolicy.engine.runner.StaticModelRunner`: prefill batches
(:func:`replay_model`) and whole requests (:func:`serve_model`).

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

Whole requests (:func:`serve_model`): every step of the batch former (prefill,
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
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner, eager_logits
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.execute import attend
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.simulation import ModelSimRow, simulate_model
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch
from attnpolicy.workloads.traces import Request

#: Largest absolute error against the float64 reference that ``check`` accepts, per dtype.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
#: The tolerance of a model-level replay's fp32 logits against the eager reference model.
MODEL_TOLERANCE = TOLERANCE["float32"]


@dataclass(frozen=True)
class RunResult:
    """What a real replay measured. ``cache`` is the graph cache's stats, ``modes``
    counts batches per mode; ``compile_seconds`` are the seconds batches stalled on
    compiles, ``stalls`` and ``background`` the dispatcher's figures (see
    docs/cache.md); ``max_abs_err``, ``tolerance`` and ``passed`` are
    ``None`` unless outputs were checked against the reference; ``switch`` counts the
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
    max_err = 0.0
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
                max_err = max(max_err, float((out.double() - ref).abs().max()))
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
        max_abs_err=max_err if check else None,
        tolerance=tolerance,
        passed=None if tolerance is None else max_err <= tolerance,
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
    )


@dataclass(frozen=True)
class ModelReplay:
    """What a replay measured, and (with a cost model) what the simulator predicted."""

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
    predicted: ModelSimRow | None
    #: (:func:`serve_model`) steps with cached context (decode, chunked prefill), requests
    #: served, and with ``check`` the requests whose greedy tokens differ from ``generate``'s
    context_steps: int = 0
    requests: int = 0
    token_mismatches: int | None = None

    @property
    def total_seconds(self) -> float:
        return self.compile_seconds + self.run_seconds

    @property
    def passed(self) -> bool | None:
        if self.max_abs_err is None:
            return None
        return self.max_abs_err <= MODEL_TOLERANCE and not self.token_mismatches

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


def replay_model(spec: str, layouts: Sequence[BatchLayout], config: AttnPolicyConfig, *, check: bool = False,
                 cost: ModelCostModel | None = None, clock: str = "cpu", threads: int = 1,
                 progress: Callable[[str], None] | None = None) -> ModelReplay:
    """Serve ``layouts`` (random token ids, seeded) through a runner of SPEC's model under ``config``."""
    torch.set_num_threads(threads)
    model, described = load_model(spec)
    reference = load_model(spec)[0] if check else None
    runner = StaticModelRunner(model, config)
    now = clock_of(clock)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    compile_s = run_s = 0.0
    err: float | None = 0.0 if check else None
    modes: dict[str, int] = {}
    try:
        for layout in layouts:
            ids = torch.randint(0, vocab, (layout.q_tokens,), generator=gen)
            mode = runner.decide(layout).mode
            modes[mode.value] = modes.get(mode.value, 0) + 1
            placing = now()
            batch = runner.prepare(ids, layout, mode)
            missed = batch.key not in runner.cache
            start = now()
            graph = runner.graph_for(batch, pin=True)
            built = now()
            try:
                with torch.no_grad():
                    out = batch.scatter(graph(*batch.inputs), layout.q_tokens)
            finally:
                runner.cache.unpin([batch.key])
            # a batch's run is what the calibration times (placement, graph, scatter); a miss's build apart
            run_s += now() - built + start - placing + (0.0 if missed else built - start)
            compile_s += built - start if missed else 0.0
            if reference is not None and err is not None:
                err = max(err, float((out - eager_logits(reference, ids, layout)).abs().max()))
            if progress:
                progress(str(batch.key))
        stats = runner.cache.stats()
    finally:
        runner.close()
    predicted = simulate_model(layouts, cost, [config], [config.eviction])[0] if cost is not None else None
    return ModelReplay(described, config.policy, len(layouts), modes, stats.hits, stats.misses, stats.compiles,
                       stats.evictions, clock, compile_s, run_s, err, predicted)


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


def serve_model(spec: str, requests: Sequence[Request], steps: Sequence[ScheduledBatch], config: AttnPolicyConfig,
                *, max_model_len: int, max_num_seqs: int, check: bool = False, clock: str = "cpu",
                threads: int = 1, progress: Callable[[str], None] | None = None,
                cost: ModelCostModel | None = None) -> ModelReplay:
    """Serve ``requests`` in the batch former's ``steps`` through a runner of SPEC's model
    under ``config``: prompts of random token ids (seeded per request), decodes greedy.
    A step's compile is its new graphs' builds (compile and first run); the rest is run.
    With ``cost``, the simulator's row of the steps served (each on a step graph) is
    the ``predicted`` one."""
    torch.set_num_threads(threads)
    model, described = load_model(spec)
    reference = load_model(spec)[0] if check else None
    runner = StaticModelRunner(model, config)
    kv = KVCache.for_model(model, max_num_seqs, max_model_len)
    now = clock_of(clock)
    vocab = model.config.vocab_size
    prompts = {rid: torch.randint(0, vocab, (requests[rid].prompt_tokens,),
                                  generator=torch.Generator().manual_seed(rid)).tolist()
               for rid in {r for step in steps for r in step.seq_ids}}
    tokens = {rid: list(p) for rid, p in prompts.items()}  # prompt, then each generated token
    rows: dict[int, list[torch.Tensor]] = {rid: [] for rid in prompts}  # each fed token's logits
    # decode steps to come: the prefill step samples the first output token (as the former)
    left = {rid: max(requests[rid].output_tokens - 1, 0) for rid in prompts}
    slot_of: dict[int, int] = {}
    free = list(range(max_num_seqs))
    fed = dict.fromkeys(prompts, 0)
    modes: dict[str, int] = {}
    compile_s = run_s = 0.0
    context_steps = 0
    served: list[BatchLayout] = []
    try:
        for step in steps:
            q_lens = step.layout.q_lens
            for rid in step.seq_ids:
                if rid not in slot_of:
                    slot_of[rid] = free.pop()
            slots = [slot_of[r] for r in step.seq_ids]
            kv_lens = [kv.length(s) + q for s, q in zip(slots, q_lens)]
            layout = BatchLayout.from_lens(list(q_lens), kv_lens, causal=True)
            served.append(layout)
            context_steps += layout.has_context
            ids = torch.tensor([t for rid, q in zip(step.seq_ids, q_lens) for t in tokens[rid][fed[rid]:fed[rid] + q]])
            mode = runner.decide(layout).mode
            modes[mode.value] = modes.get(mode.value, 0) + 1
            misses, start = runner.cache.stats().misses, now()
            out = runner.run(ids, layout, mode, kv=kv, slots=slots)
            took = now() - start
            if runner.cache.stats().misses > misses:
                compile_s += took  # a step that builds a graph: its run is in its build
            else:
                run_s += took
            for i, (rid, q) in enumerate(zip(step.seq_ids, q_lens)):
                start = layout.q_starts[i]
                rows[rid].append(out[start:start + q])
                fed[rid] += q
                if fed[rid] == len(tokens[rid]):  # its last token fed: the next, greedy
                    tokens[rid].append(int(out[start + q - 1].argmax()))
                if i < step.num_decode:
                    left[rid] -= 1
                if fed[rid] >= len(prompts[rid]) and left[rid] == 0:  # done: its slot is free
                    kv.reset(slot_of[rid])
                    free.append(slot_of.pop(rid))
            if progress:
                progress(layout.describe())
        stats = runner.stats()
    finally:
        runner.close()
    err: float | None = None
    mismatches: int | None = None
    if reference is not None:
        err, mismatches = 0.0, 0
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
                err = max(err, float((got - whole).abs().max()))
    c = stats.cache
    predicted = None if cost is None else simulate_model(served, cost, [config], [config.eviction], steps=True)[0]
    return ModelReplay(described, config.policy, len(steps), modes, c.hits, c.misses, c.compiles, c.evictions,
                       clock, compile_s, run_s, err, predicted, context_steps, len(prompts), mismatches)
