"""Cold against warm start of whole-model graphs through one graph store.

Runs the same process twice against a fresh store directory: each builds a tiny
seeded model (``--model``, a built-in spec), a :class:`StaticModelRunner` with
``store_dir`` and warms CAUSAL graphs of ``--lengths`` tokens (and one MASK graph).
The first process compiles and saves them, the second loads them. Prints each
process's start-up seconds (runner built, warm set ready), compiles and loads::

    python benchmarks/warm_restart.py --backend inductor
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.integrations.model_specs import parse_spec
from attnpolicy.integrations.static_model import StaticModelRunner

store, model, backend, lengths = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
runner = StaticModelRunner(parse_spec(model).build(),
                           AttnPolicyConfig(backend=backend, max_seq_len=max(lengths), store_dir=store))
warm = [(BatchLayout.from_lens([n]), MaskMode.CAUSAL) for n in lengths]
warm.append((BatchLayout.from_lens([lengths[0], lengths[0]]), MaskMode.MASK))
runner.warmup(warm)
s = runner.stats()
print(json.dumps({"startup_s": time.perf_counter() - t0, "compiles": s.cache.compiles,
                  "compile_s": s.cache.compile_seconds, "loads": s.cache.loads,
                  "load_s": s.cache.load_seconds, "disk_bytes": s.disk.bytes}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3:layers=4,hidden=256,heads=4,kv_heads=2,intermediate=512,vocab=1024")
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    p.add_argument("--lengths", default="64,128,256", help="CAUSAL graph lengths (pow2 buckets)")
    args = p.parse_args()
    lengths = json.dumps([int(n) for n in args.lengths.split(",")])
    with tempfile.TemporaryDirectory() as store:
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, store, args.model, args.backend, lengths],
                                  capture_output=True, text=True, check=True)
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"run": run, "process_s": round(time.perf_counter() - t0, 2),
                              **{k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
