"""Decode steps as whole-model step graphs: MASK vs VARLEN vs CAUSAL (batch 1), per
batch size and context length, and the bytes each step graph holds.

Not a test: run it by hand on a machine as quiet as you can get::

    python benchmarks/decode_steps.py --json decode.json

Each cell is one decode step (one new token per sequence, every sequence's context
``C`` tokens) through a :class:`~attnpolicy.engine.runner.StaticModelRunner` with a
:class:`~attnpolicy.engine.kv_cache.KVCache`: the step graph of each mode, compiled
once (``--backend``), then timed ``--repeats`` times (median, ms; the gather of the
context into the graph's inputs and the write-back of the new rows included: they are
what a step costs). ``CAUSAL`` runs at batch 1 only (mask-free needs one sequence).
Beside the times: each graph's static-shape estimate and its build's RSS delta (MiB).
The ratios are against MASK in the same run (> 1: faster than MASK).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import load_model
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.graphs.buckets import Buckets

MIB = 1 << 20


def cell(runner: StaticModelRunner, model: torch.nn.Module, batch: int, context: int, mode: MaskMode,
         repeats: int) -> dict[str, Any]:
    """One decode step of ``batch`` sequences over ``context`` tokens each in ``mode``."""
    layout = BatchLayout.from_lens([1] * batch, [context + 1] * batch, causal=True)
    ids = torch.zeros(batch, dtype=torch.long)
    slots = list(range(batch))
    times = []
    for i in range(repeats + 1):  # the first call compiles
        kv = KVCache.holding(model, [context] * batch, context + 1)
        start = time.perf_counter()
        runner.run(ids, layout, mode, kv=kv, slots=slots)
        if i:
            times.append(time.perf_counter() - start)
    (key,) = map(str, runner.keys_for(layout, mode, kv=True))
    memory = next(m for m in runner.stats().memory if m.key == key)
    return {"batch": batch, "context": context, "mode": mode.value, "key": key,
            "median_ms": 1e3 * statistics.median(times), "estimate_mib": memory.estimate_bytes / MIB,
            "rss_mib": memory.rss_bytes / MIB, "compile_seconds": memory.compile_seconds}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:layers=2,hidden=256,heads=4,kv_heads=2,intermediate=512,vocab=1024")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--contexts", default="128,512,1024,4096")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model, described = load_model(args.model)
    longest = max(contexts) + 1
    config = AttnPolicyConfig(policy="varlen", backend=args.backend, buckets=Buckets(kind="pow2", min=16),
                              max_seq_len=longest * 2, max_batch_tokens=max(batches) * longest * 2)
    runner = StaticModelRunner(model, config)
    rows = []
    print(f"model {described}, backend {args.backend}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'batch':>5} {'context':>7} {'mode':>7} {'ms':>9} {'vs mask':>8} {'est MiB':>8} {'RSS MiB':>8}")
    try:
        for batch in batches:
            for context in contexts:
                modes = [MaskMode.MASK, MaskMode.VARLEN] + ([MaskMode.CAUSAL] if batch == 1 else [])
                done = [cell(runner, model, batch, context, m, args.repeats) for m in modes]
                for row in done:
                    row["vs_mask"] = done[0]["median_ms"] / row["median_ms"]
                    print(f"{batch:>5} {context:>7} {row['mode']:>7} {row['median_ms']:>9.3f} "
                          f"{row['vs_mask']:>7.2f}× {row['estimate_mib']:>8.2f} {row['rss_mib']:>8.2f}")
                rows += done
    finally:
        runner.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": described, "backend": args.backend, "threads": args.threads, "rows": rows}, f,
                      indent=2)
    return rows


if __name__ == "__main__":
    main()
