"""Cold against warm start through one graph store: attention graphs and model graphs.

Not a test: run it by hand, as quiet a machine as you can get. Each pair runs the
same process twice against a fresh store directory; the first compiles its warm set
and saves it, the second loads it. Prints one JSON line per process and one per pair
(the warm/cold start-up ratio), each with the load average when it ended::

    python benchmarks/warm_restart.py attention                      # inductor, the default backend
    python benchmarks/warm_restart.py attention --backend aot_eager
    python benchmarks/warm_restart.py model --backend inductor --lengths 64,128

``attention`` runs ``attnpolicy run --config CONFIG --trace TRACE ... --store STORE
--check --json OUT`` (a 2-request trace, a warm set of 13 shapes: CAUSAL 16–256,
VARLEN with context of 16 or 32 queries over 64–256 keys, MASK 64 and 128) and reads
its ``startup_seconds``: from building the dispatcher to its warm set being ready.
``model`` builds a tiny seeded model (``--model``) and a ``StaticModelRunner`` with
``store_dir`` and warms CAUSAL graphs of ``--lengths`` tokens, one MASK and one
VARLEN graph; ``startup_s`` runs from building the runner to its warm set being
ready. ``process_s`` is the whole process (Python, torch's import, the model), as
``time`` would measure it.

``--inductor-cache fresh`` (the default) gives each pair an empty
``TORCHINDUCTOR_CACHE_DIR``: the first process is the first on a machine. ``shared``
leaves torch's caches as they are (warm from earlier runs), so the first process
finds inductor's compiled kernels and only the store is cold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MODEL_CHILD = """
import json, sys, time
import torch
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.model_specs import parse_spec
from attnpolicy.engine.runner import StaticModelRunner

store, model, backend, lengths = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
built = parse_spec(model).build()
t0 = time.perf_counter()
runner = StaticModelRunner(built, AttnPolicyConfig(backend=backend, max_seq_len=max(lengths), store_dir=store))
warm = [(BatchLayout.from_lens([n]), MaskMode.CAUSAL) for n in lengths]
warm.append((BatchLayout.from_lens([lengths[0], lengths[0]]), MaskMode.MASK))
warm.append((BatchLayout.from_lens([lengths[0], lengths[0]]), MaskMode.VARLEN))
runner.warmup(warm)
startup = time.perf_counter() - t0
s = runner.stats()
print(json.dumps({"startup_s": startup, "graphs": len(warm), "compiles": s.cache.compiles,
                  "compile_s": s.cache.compile_seconds, "loads": s.cache.loads, "load_s": s.cache.load_seconds,
                  "disk_bytes": s.disk.bytes}))
"""

WARM = ([{"family": "causal", "q_bucket": n, "kv_bucket": n} for n in (16, 32, 64, 128, 256)]
        + [{"family": "varlen", "q_bucket": q, "kv_bucket": kv, "causal": True, "context": True}
           for q in (16, 32) for kv in (64, 128, 256)]
        + [{"family": "mask", "q_bucket": n, "kv_bucket": n} for n in (64, 128)])
TRACE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,20,2\n"
         "2023-11-16 18:15:46.7805900,30,1\n")
RUN_ARGS = ("--max-num-seqs", "2", "--max-num-batched-tokens", "128", "--max-seq-len", "256", "--heads", "2",
            "--kv-heads", "2", "--head-dim", "16", "--check")


def attention_run(work: Path, store: Path, backend: str, env: dict[str, str], name: str) -> dict[str, Any]:
    """One ``attnpolicy run`` against ``store``: its start-up, compiles, loads and check."""
    config, trace, out = work / "config.json", work / "trace.csv", work / f"{name}.json"
    config.write_text(json.dumps({"backend": backend, "max_seq_len": 256, "warmup": WARM}))
    trace.write_text(TRACE)
    subprocess.run([sys.executable, "-m", "attnpolicy", "run", "--config", str(config), "--trace", str(trace),
                    *RUN_ARGS, "--store", str(store), "--json", str(out)],
                   env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.read_text())
    each = sorted((k["compile_seconds"] + k["load_seconds"] for k in r["cache"]["per_key"].values()), reverse=True)
    return {"startup_s": r["startup_seconds"], "graphs": r["warmup_graphs"], "compiles": r["cache"]["compiles"],
            "loads": r["cache"]["loads"], "slowest_graphs_s": [round(s, 3) for s in each[:2]],
            "other_graphs_s": [round(each[-1], 3), round(each[2], 3)] if len(each) > 2 else [],
            "passed": r["passed"], "max_abs_err": r["max_abs_err"], "disk_bytes": r["disk"]["bytes"]}


def model_run(store: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    lengths = json.dumps([int(n) for n in args.lengths.split(",")])
    done = subprocess.run([sys.executable, "-c", MODEL_CHILD, str(store), args.model, args.backend, lengths],
                          env=env, capture_output=True, text=True, check=True)
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("graphs", choices=("attention", "model"))
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--inductor-cache", choices=("fresh", "shared"), default="fresh",
                   help="an empty TORCHINDUCTOR_CACHE_DIR per pair, or torch's caches as they are")
    p.add_argument("--pairs", type=int, default=1, help="cold/warm pairs, each against a fresh store")
    p.add_argument("--model", default="qwen3:layers=4,hidden=256,heads=4,kv_heads=2,intermediate=512,vocab=1024")
    p.add_argument("--lengths", default="64,128,256", help="model: CAUSAL graph lengths (pow2 buckets)")
    args = p.parse_args()
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            if args.inductor_cache == "fresh":
                env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
            seconds = {}
            for run in ("cold", "warm"):
                t0 = time.perf_counter()
                if args.graphs == "attention":
                    figures = attention_run(work, work / "store", args.backend, env, run)
                else:
                    figures = model_run(work / "store", args, env)
                seconds[run] = figures["startup_s"]
                print(json.dumps({"pair": pair, "run": run, "backend": args.backend,
                                  "process_s": round(time.perf_counter() - t0, 2),
                                  **{k: round(v, 3) if isinstance(v, float) and k != "max_abs_err" else v
                                     for k, v in figures.items()},
                                  "load_avg": round(os.getloadavg()[0], 1)}), flush=True)
            print(json.dumps({"pair": pair, "ratio": round(seconds["cold"] / seconds["warm"], 2)}), flush=True)


if __name__ == "__main__":
    main()
