"""attnpolicy's CUDA checks in one go, where a GPU is lent (a script, not a test).

Run it from a checkout, on a machine with a CUDA build of torch (and, for the first
check, a CUDA build of vLLM); it needs no network: the tiny random model is written by
the script (``tests/tiny_models.py``)::

    python benchmarks/device_check.py --out device_check        # on the GPU machine
    python benchmarks/device_check.py --dry-run                 # anywhere: what it would measure

Checks (``--only`` picks some):

- ``tokens``: a tiny random Llama through vLLM on CUDA, stock against attnpolicy's
  wrapper of the backend vLLM selects (FLASH_ATTN in float16, TRITON_ATTN in float32 on
  an H100), in-process engines: eager under ``varlen`` and ``always-mask`` (every step
  decided: decisions = the metadata vLLM built), vLLM's CUDA graphs
  (FULL_AND_PIECEWISE: the decodes of captured sizes replay the wrapped kernel, said as
  ``full_graph`` events) and PIECEWISE graphs under ``always-mask`` (every step
  decided). Greedy tokens and prompt logprobs against stock's.
- ``bench``: the dispatcher's ``attend`` on CUDA tensors (``attnpolicy bench`` times
  CPU tensors only), CAUSAL vs MASK on one sequence and MASK vs VARLEN on four, median
  milliseconds (synchronised), and the largest error against the float64 reference.
- ``memory``: the graph memory from CUDA's allocator: ``torch.cuda.memory_allocated``
  before and after each graph's compile, and ``torch.cuda.max_memory_allocated`` (the
  peak) during it.
- ``warm``: warm start: one process compiles a warm set on CUDA into a graph store, a
  second process (same store, same inductor cache) loads it: compiles, loads, seconds.

Prints one JSON line per check and writes them all to ``OUT/device_check.json``. Exit
status 0 when every check that ran passed, 1 when one failed, 2 when none could run (no
CUDA device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CHECKS = ("tokens", "bench", "memory", "warm")
#: what each check measures, as the dry run prints it
MEASURES = {
    "tokens": "greedy tokens and prompt logprobs of a tiny random Llama through vLLM on CUDA, stock against "
              "attnpolicy's wrapper of the backend vLLM selects; decisions against the metadata vLLM built "
              "(100% of the steps it runs outside FULL CUDA graphs); full_graph events",
    "bench": "median ms of Dispatcher.attend on CUDA tensors per mode (torch.cuda.synchronize around each call) "
             "and the largest error against the float64 reference",
    "memory": "bytes each compiled graph holds on the device (torch.cuda.memory_allocated after - before its "
              "compile) and the compile's peak (torch.cuda.max_memory_allocated)",
    "warm": "warm start: a second process loading the first one's graph store on CUDA: compiles, loads, seconds",
}

# -- tokens ------------------------------------------------------------------------------
PROMPT_LENS = (5, 17, 33, 9)  # generated together: a packed prefill, then packed decodes
LONE_LEN = 50  # then alone: a context-free prompt (CAUSAL under varlen), then decodes of one
CAPTURE_SIZES = [1, 2, 4, 8]
#: (name, policy (None: stock), dtype, CUDA graphs); an engine is compared with the stock
#: engine of its dtype and graphs
ENGINES = (
    ("stock-fp16-eager", None, "float16", "none"),
    ("stock-fp32-eager", None, "float32", "none"),
    ("stock-fp16-graphs", None, "float16", "FULL_AND_PIECEWISE"),
    ("varlen-fp16-eager", "varlen", "float16", "none"),
    ("mask-fp16-eager", "always-mask", "float16", "none"),
    ("mask-fp32-eager", "always-mask", "float32", "none"),
    ("varlen-fp16-graphs", "varlen", "float16", "FULL_AND_PIECEWISE"),
    ("mask-fp16-piecewise", "always-mask", "float16", "PIECEWISE"),
)
#: the largest prompt-logprob difference to stock allowed per dtype (attnpolicy's graphs
#: and the backend's kernel round differently in float16)
LOGPROB_TOL = {"float16": 5e-2, "float32": 1e-4}
BUILDERS = ("flash_attn.FlashAttentionMetadataBuilder", "triton_attn.TritonAttentionMetadataBuilder",
            "flex_attention.FlexAttentionMetadataBuilder", "flashinfer.FlashInferMetadataBuilder")
ENGINE_CONFIG = {"backend": "aot_eager"}

# -- bench, memory, warm -----------------------------------------------------------------
HEADS, KV_HEADS, HEAD_DIM = 8, 8, 64
BENCH_CASES = (("always-causal", (2048,)), ("always-mask", (2048,)), ("always-mask", (512,) * 4),
               ("varlen", (512,) * 4))
MEMORY_LAYOUTS = ((128,), (512,), (2048,), (256,) * 4, (512,) * 4)
WARM_SET = [{"family": "causal", "q_bucket": n, "kv_bucket": n} for n in (128, 256, 512, 1024)] + [
    {"family": "mask", "q_bucket": n, "kv_bucket": n} for n in (256, 1024)]


def _configs(backend: str) -> dict[str, dict[str, Any]]:
    """The attnpolicy configs each check runs, by check (validated by the dry run too)."""
    return {"tokens": ENGINE_CONFIG,
            **{f"bench-{policy}": {"policy": policy, "backend": backend, "max_seq_len": 2048}
               for policy, _ in BENCH_CASES},
            "memory": {"policy": "dynamic", "backend": backend, "max_seq_len": 2048},
            "warm": {"backend": backend, "max_seq_len": 1024, "warmup": WARM_SET}}


def _spec(dtype: str = "float16") -> Any:
    import torch

    from attnpolicy.graphs.keys import TensorSpec

    return TensorSpec(dtype, HEADS, KV_HEADS, HEAD_DIM, device=f"cuda:{torch.cuda.current_device()}")


# -- children ------------------------------------------------------------------------------


def _count_builds() -> dict[str, int]:
    """Counts the metadata objects each backend's builder makes (one per step and
    KV-cache group), whichever backend runs."""
    import importlib

    counts: dict[str, int] = {}
    for name in BUILDERS:
        module, cls_name = name.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls_name)
        except (ImportError, AttributeError):
            continue
        counts[cls_name] = 0
        build = cls.build

        def counted(builder: Any, *a: Any, _build: Any = build, _name: str = cls_name, **k: Any) -> Any:
            counts[_name] += 1
            return _build(builder, *a, **k)

        cls.build = counted
    return counts


def tokens_child(model: str, names: list[str], log: str, out: str) -> None:
    """Each engine of ``names`` in turn in this process (stock ones before attnpolicy's)."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from attnpolicy.integrations import vllm as integration

    counts = _count_builds()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    waves = ([[4 + (7 * i + j) % 120 for j in range(n)] for i, n in enumerate(PROMPT_LENS)],
             [[4 + (3 + j) % 120 for j in range(LONE_LEN)]])
    results = {}
    for name, policy, dtype, graphs in (e for e in ENGINES if e[0] in names):
        if policy is None:
            integration.unregister()
        else:
            integration.register()
            os.environ["ATTNPOLICY_POLICY"] = policy
        before = dict(counts)
        seen = len(Path(log).read_text().splitlines()) if Path(log).exists() else 0
        start = time.perf_counter()
        llm = LLM(model=model, dtype=dtype, max_model_len=256, max_num_seqs=8, seed=0, gpu_memory_utilization=0.3,
                  enforce_eager=graphs == "none",
                  compilation_config=None if graphs == "none" else {"cudagraph_mode": graphs,
                                                                     "cudagraph_capture_sizes": CAPTURE_SIZES})
        outs = [o for wave in waves for o in llm.generate([{"prompt_token_ids": p} for p in wave], params,
                                                          use_tqdm=False)]
        seconds = time.perf_counter() - start
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        records = [json.loads(s) for s in Path(log).read_text().splitlines()[seen:]] if Path(log).exists() else []
        decisions = [r for r in records if r["event"] == "decision"]
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_logprobs": [[None if d is None else d[t].logprob for t, d in zip(o.prompt_token_ids,
                                                                                   o.prompt_logprobs)]
                                for o in outs],
            "metadata": {k: counts[k] - before[k] for k in counts if counts[k] > before[k]},
            "decisions": len(decisions), "modes": sorted({d["mode"] for d in decisions}),
            "full_graph": [r["num_tokens"] for r in records if r["event"] == "full_graph"], "seconds": seconds}
    Path(out).write_text(json.dumps(results))


def warm_child(store: str, backend: str, out: str) -> None:
    """Build the warm set on CUDA against ``store``: seconds, compiles, loads."""
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.dispatch import Dispatcher

    start = time.perf_counter()
    d = Dispatcher(AttnPolicyConfig(**{**_configs(backend)["warm"], "store_dir": store}))
    d.warmup(_spec())
    seconds = time.perf_counter() - start
    s = d.stats()
    Path(out).write_text(json.dumps({"seconds": seconds, "graphs": len(WARM_SET), "compiles": s.cache.compiles,
                                     "loads": s.cache.loads, "disk": None if s.disk is None else asdict(s.disk)}))


def _child(kind: str, *argv: str, env: dict[str, str], timeout: int) -> dict[str, Any]:
    """Run ``kind``'s child in a fresh Python; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = subprocess.run([sys.executable, __file__, "--child", kind, *argv, str(out)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


# -- checks ----------------------------------------------------------------------------


def check_tokens(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("vLLM is not installed (a CUDA build of vllm is needed for this check)")
    import tiny_models

    model = tiny_models.llama(work / "llama", max_positions=512)
    config, log = work / "engine_config.json", work / "decisions.jsonl"
    config.write_text(json.dumps(ENGINE_CONFIG))
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "ATTNPOLICY_CONFIG": str(config), "ATTNPOLICY_DECISIONS_LOG": str(log),
           "VLLM_CACHE_ROOT": str(work / "vllm-cache")}
    eager = [e[0] for e in ENGINES if e[3] == "none"]
    got = _child("tokens", str(model), json.dumps(eager), str(log), env=env, timeout=args.timeout)
    got.update(_child("tokens", str(model), json.dumps([e[0] for e in ENGINES if e[0] not in eager]), str(log),
                      env=env, timeout=args.timeout))
    rows, failed = {}, []
    for name, policy, dtype, graphs in ENGINES:
        run = got[name]
        row = {"metadata": run["metadata"], "seconds": round(run["seconds"], 2)}
        if policy is not None:
            stock = got[f"stock-{dtype.replace('float', 'fp')}-{'eager' if graphs == 'none' else 'graphs'}"]
            diffs = [abs(a - b) for mine, ref in zip(run["prompt_logprobs"], stock["prompt_logprobs"])
                     for a, b in zip(mine, ref) if b is not None]
            row.update(tokens_equal=run["tokens"] == stock["tokens"], max_logprob_diff=max(diffs),
                       decisions=run["decisions"], modes=run["modes"], full_graph=run["full_graph"])
            builds = sum(run["metadata"].values())
            ok = row["max_logprob_diff"] <= LOGPROB_TOL[dtype] and run["decisions"] > 0
            if policy == "varlen" or dtype == "float32":
                ok = ok and row["tokens_equal"]
            if graphs == "FULL_AND_PIECEWISE":
                ok = ok and bool(run["full_graph"]) and run["decisions"] < builds
            else:  # every step through the policy
                ok = ok and run["decisions"] == builds
            if not ok:
                failed.append(name)
        rows[name] = row
    return {"passed": not failed, "failed": failed, "engines": rows}


def _timed_ms(fn: Callable[[], Any], repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from reference import reference_attention

    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.core.layout import BatchLayout
    from attnpolicy.dispatch import Dispatcher

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for policy, lens in BENCH_CASES:
        d = Dispatcher(AttnPolicyConfig(**_configs(args.backend)[f"bench-{policy}"]))
        layout = BatchLayout.from_lens(list(lens))
        n = sum(lens)
        q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen)
        out = d.attend(q, k, v, layout)  # compiles
        starts = [sum(lens[:i]) for i in range(len(lens))]
        want = reference_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), starts, lens, starts, lens,
                                   True)
        err = float((out.double().cpu() - want).abs().max())
        rows.append({"policy": policy, "lens": list(lens), "modes": d.stats().modes, "device": str(out.device),
                     "median_ms": round(_timed_ms(lambda d=d, q=q, k=k, v=v, layout=layout: d.attend(q, k, v, layout),
                                                  args.repeats), 4),
                     "max_abs_err": err, "compiles": d.stats().cache.compiles})
    return {"passed": all(r["max_abs_err"] <= 1e-2 and r["device"].startswith("cuda") for r in rows),
            "rows": rows}


def check_memory(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.core.layout import BatchLayout
    from attnpolicy.dispatch import Dispatcher

    d = Dispatcher(AttnPolicyConfig(**_configs(args.backend)["memory"]))
    spec = _spec()
    rows = []
    for lens in MEMORY_LAYOUTS:
        compiles = d.stats().cache.compiles
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step = d.prepare(BatchLayout.from_lens(list(lens)), spec)
        torch.cuda.synchronize()
        rows.append({"lens": list(lens), "mode": step.decision.mode.value,
                     "compiled": d.stats().cache.compiles - compiles,
                     "held_bytes": torch.cuda.memory_allocated() - before,
                     "peak_bytes": torch.cuda.max_memory_allocated() - before})
        d.release_batch()
    return {"passed": all(r["compiled"] >= 1 for r in rows), "rows": rows,
            "allocated_bytes": torch.cuda.memory_allocated(), "cache": asdict(d.stats().cache)}


def check_warm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    store = work / "store"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}  # kept with the store, as docs/vllm.md says
    cold = _child("warm", str(store), args.backend, env=env, timeout=args.timeout)
    warm = _child("warm", str(store), args.backend, env=env, timeout=args.timeout)
    return {"passed": cold["compiles"] == len(WARM_SET) and warm["loads"] == len(WARM_SET) and warm["compiles"] == 0,
            "cold": cold, "warm": warm, "warm_over_cold": round(warm["seconds"] / cold["seconds"], 3)}


RUNS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "tokens": check_tokens, "bench": check_bench, "memory": check_memory, "warm": check_warm}


def dry_run(args: argparse.Namespace) -> int:
    """What a run would measure, with its settings; the configs validated (no CUDA, no vLLM)."""
    from attnpolicy.config import AttnPolicyConfig

    configs = {name: AttnPolicyConfig(**fields) for name, fields in _configs(args.backend).items()}
    print(f"device_check --dry-run: would run {', '.join(args.only)} on the first CUDA device and write "
          f"{args.out / 'device_check.json'}")
    settings = {
        "tokens": [*(f"{name}: policy {policy or 'stock'}, {dtype}, CUDA graphs {graphs}"
                     for name, policy, dtype, graphs in ENGINES),
                   (f"prompts {list(PROMPT_LENS)} together, then one of {LONE_LEN}; capture sizes {CAPTURE_SIZES}; "
                    f"logprob tolerance {LOGPROB_TOL}")],
        "bench": [f"{policy}: lengths {list(lens)}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, float16, backend "
                  f"{configs[f'bench-{policy}'].backend}, {args.repeats} repeats" for policy, lens in BENCH_CASES],
        "memory": [f"layouts {[list(x) for x in MEMORY_LAYOUTS]} under {configs['memory'].policy}, float16"],
        "warm": [(f"warm set of {len(configs['warm'].warmup)} graphs, backend {configs['warm'].backend}, "
                  "twice against one store and one inductor cache")],
    }
    for name in args.only:
        print(f"- {name}: {MEASURES[name]}")
        for line in settings[name]:
            print(f"    {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print what would be measured; needs no GPU")
    p.add_argument("--only", type=lambda s: [c for c in s.split(",") if c], default=list(CHECKS),
                   metavar="C[,C...]", help=f"checks to run (default: all of {', '.join(CHECKS)})")
    p.add_argument("--out", type=Path, default=Path("device_check"), help="where device_check.json goes")
    p.add_argument("--backend", default="inductor", help="attnpolicy's compiler for bench, memory and warm")
    p.add_argument("--repeats", type=int, default=20, help="timed attends per bench case")
    p.add_argument("--timeout", type=int, default=420, help="seconds a child process may run")
    args = p.parse_args(argv)
    unknown = [c for c in args.only if c not in CHECKS]
    if unknown:
        p.error(f"--only: unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"check": "all", "status": "unavailable", "reason": "no CUDA device (torch "
                          f"{torch.__version__}, CUDA build {torch.version.cuda})"}))
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            work = Path(tmp) / name
            work.mkdir()
            start = time.perf_counter()
            try:
                result = {"status": "pass" if (got := RUNS[name](args, work))["passed"] else "fail", **got}
            except ImportError as exc:
                result = {"status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:  # a check that breaks is reported, the others still run
                result = {"status": "fail", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]}
            result["seconds"] = round(time.perf_counter() - start, 1)
            results["checks"][name] = result
            print(json.dumps({"check": name, **result}, default=str), flush=True)
    (args.out / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    statuses = {r["status"] for r in results["checks"].values()}
    return 1 if "fail" in statuses else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "tokens":
            tokens_child(rest[0], json.loads(rest[1]), rest[2], rest[3])
        else:
            warm_child(*rest)
        sys.exit(0)
    sys.exit(main())
