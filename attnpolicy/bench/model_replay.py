"""Real replays through a :class:`~attnpolicy.engine.runner.StaticModelRunner`: of
prefill batches (:func:`replay_model`), and of whole requests (:func:`serve_model`).

Each batch runs as the runner serves it (the guarded policy decides, the batch is
placed, the graph of its key comes from the cache, compiled on a miss, and runs);
its compile (a miss's build: compile and first run) and its run are timed apart on
the chosen clock. With ``check`` every output is compared with a reference model
built from the same SPEC (same seeded weights) run eagerly, one sequence at a time,
with transformers' own SDPA attention. With a
:class:`~attnpolicy.modelling.whole_model_costs.ModelCostModel` the model-level
simulator's prediction for the same batches, config and eviction sits beside the
measurement, with predicted/measured ratios.

:func:`serve_model` serves whole requests: every step of the batch former (prefill,
chunked prefill, decode, mixed) runs through the runner with a
:class:`~attnpolicy.engine.kv_cache.KVCache` (one slot per running request, reused
when it finishes), each decode feeding the token the step before chose greedily. With
``check`` each request's tokens must equal transformers' own greedy ``generate`` of the
reference model, and every row's logits the reference's over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnpolicy.bench.model_calibration import clock_of
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner, eager_logits
from attnpolicy.modelling.simulation import ModelSimRow, simulate_model
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.workloads.batching import ScheduledBatch
from attnpolicy.workloads.traces import Request

#: fp32 tolerance of the runner's logits against the eager reference.
TOLERANCE = 1e-4


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
        return self.max_abs_err <= TOLERANCE and not self.token_mismatches

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
    of the two tokens are more than :data:`TOLERANCE` apart (within it, a tie that either
    side's rounding decides; past it the sequences are not comparable)."""
    at = next((i for i in range(n, min(len(got), len(want))) if got[i] != want[i]), None)
    if at is None:
        return False
    row = logits[at - 1]
    return float(abs(row[got[at]] - row[want[at]])) > TOLERANCE


def serve_model(spec: str, requests: Sequence[Request], steps: Sequence[ScheduledBatch], config: AttnPolicyConfig,
                *, max_model_len: int, max_num_seqs: int, check: bool = False, clock: str = "cpu",
                threads: int = 1, progress: Callable[[str], None] | None = None) -> ModelReplay:
    """Serve ``requests`` in the batch former's ``steps`` through a runner of SPEC's model
    under ``config``: prompts of random token ids (seeded per request), decodes greedy.
    A step's compile is its new graphs' builds (compile and first run); the rest is run."""
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
    try:
        for step in steps:
            q_lens = step.layout.q_lens
            for rid in step.seq_ids:
                if rid not in slot_of:
                    slot_of[rid] = free.pop()
            slots = [slot_of[r] for r in step.seq_ids]
            kv_lens = [kv.length(s) + q for s, q in zip(slots, q_lens)]
            layout = BatchLayout.from_lens(list(q_lens), kv_lens, causal=True)
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
                want = reference.generate(torch.tensor([prompt]), max_new_tokens=len(seq) - n,
                                          do_sample=False)[0].tolist()
                got = torch.cat(rows[rid])
                whole = reference(input_ids=torch.tensor([seq[:got.shape[0]]]), use_cache=False).logits[0]
                greedy = whole[n - 1:].argmax(-1).tolist()  # every token the reference would choose
                mismatches += (_differs(seq, want, whole, n) or
                               _differs(seq, seq[:n] + greedy[:len(seq) - n], whole, n))
                err = max(err, float((got - whole).abs().max()))
    c = stats.cache
    return ModelReplay(described, config.policy, len(steps), modes, c.hits, c.misses, c.compiles, c.evictions,
                       clock, compile_s, run_s, err, None, context_steps, len(prompts), mismatches)
