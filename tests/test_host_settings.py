"""The plan in each host's own units: host_settings.json. vLLM's sizes count a step's
tokens (chosen from the step stream), checked by vLLM's own config classes and served
by a vLLM engine with ``enforce_eager=False``; static runtimes' are the planned paddings.

The engine runs in a child Python (this file as a script), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with a tiny random Llama: no downloads.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.cli import main
from attnpolicy.errors import ConfigError
from attnpolicy.planning.host_settings import host_settings, step_sizes, vllm_grid
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

#: The served scenario: two prompts generated together, the former's steps of them.
PROMPTS = (5, 40)
OUTPUT = 3
FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256}


def _steps() -> list[int]:
    requests = [Request(0.0, n, OUTPUT) for n in PROMPTS]
    return [s.layout.q_tokens for s in BatchFormer(**FORMER).steps(requests)]


def _vllm_kept(model: str, section: dict) -> dict:
    """What vLLM's ``VllmConfig`` keeps of a ``"vllm"`` section after its own
    normalisation of capture sizes (``_set_cudagraph_sizes``, which ends in
    ``CompilationConfig.post_init_cudagraph_sizes``). On CPU vLLM skips that step (its
    platform has no graph mode): the platform is made to report one while the config
    is built, and the sizes are read as that normalisation leaves them."""
    from vllm.config import CompilationConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms import current_platform

    kept: dict = {}
    platform, normalise = type(current_platform), CompilationConfig.post_init_cudagraph_sizes
    graph_mode = platform.support_static_graph_mode

    def observed(self) -> None:
        normalise(self)
        kept.update(mode=self.cudagraph_mode.name, cudagraph_capture_sizes=list(self.cudagraph_capture_sizes),
                    max_cudagraph_capture_size=self.max_cudagraph_capture_size,
                    compile_sizes=sorted(self.compile_sizes))

    CompilationConfig.post_init_cudagraph_sizes = observed
    platform.support_static_graph_mode = classmethod(lambda cls: True)
    try:
        VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32",
                                            max_model_len=FORMER["max_model_len"], enforce_eager=False, seed=0),
                   scheduler_config=SchedulerConfig(max_num_batched_tokens=section["max_num_batched_tokens"],
                                                    max_num_seqs=FORMER["max_num_seqs"],
                                                    max_model_len=FORMER["max_model_len"],
                                                    is_encoder_decoder=False),
                   compilation_config=CompilationConfig(**section["compilation_config"]))
    finally:
        CompilationConfig.post_init_cudagraph_sizes = normalise
        platform.support_static_graph_mode = graph_mode
    return kept


def _child(model: str, settings_path: str, out: str) -> None:
    """Validate the settings in vLLM's config, then serve the prompts eagerly and under
    the settings with ``enforce_eager=False``, one engine after the other (the first shut
    down before the second starts; the second is left to the process's end)."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    section = json.loads(Path(settings_path).read_text())["vllm"]
    probe = {"compilation_config": {"cudagraph_capture_sizes": [16, 48, 128]}, "max_num_batched_tokens": 64}
    result: dict = {"kept": _vllm_kept(model, section), "probe": _vllm_kept(model, probe)}
    prompts = [{"prompt_token_ids": [4 + (7 * i + j) % 120 for j in range(n)]} for i, n in enumerate(PROMPTS)]
    for eager in (True, False):
        llm = LLM(model=model, dtype="float32", max_model_len=FORMER["max_model_len"],
                  max_num_seqs=FORMER["max_num_seqs"], seed=0, kv_cache_memory_bytes=8 << 20,
                  max_num_batched_tokens=section["max_num_batched_tokens"],
                  compilation_config=section["compilation_config"], enforce_eager=eager)
        cc = llm.llm_engine.vllm_config.compilation_config
        outs = llm.generate(prompts, SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        result["eager" if eager else "compiled"] = {"mode": cc.mode.name, "compile_sizes": sorted(cc.compile_sizes),
                                                    "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        if eager:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
    # the result is written: the process ends now, without the last engine's teardown and the
    # interpreter's (about 3 s of CPU that nothing reads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- test side -----------------------------------------------------------------------


def test_vllm_grid_is_vllms_own_capture_grid_then_the_budget():
    # vLLM's default: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), and max_num_batched_tokens
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 1025, 16)]
    for n in range(1, 1025):
        assert vllm_grid(n, 4096) == min(s for s in default if s >= n), n
    assert vllm_grid(300, 300) == 300 and vllm_grid(301, 300) == 300  # the budget, off the grid


def _padded(steps: Counter, sizes: tuple[int, ...]) -> int:
    return sum(c * (min(s for s in sizes if s >= n) - n) for n, c in steps.items())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.integers(1, 4), st.sampled_from([300, 4096]))
def test_step_sizes_pad_the_fewest_tokens_of_any_list_on_the_grid(steps, k, budget):
    sizes = step_sizes(steps, budget, k)
    grid = sorted({vllm_grid(n, budget) for n in steps})
    assert set(sizes) <= set(grid) and sizes[-1] == grid[-1] and len(sizes) == min(k, len(grid))
    counts = Counter(steps)
    best = min(_padded(counts, (*rest, grid[-1])) for j in range(min(k, len(grid)))
               for rest in itertools.combinations(grid[:-1], j))
    assert _padded(counts, sizes) == best


def test_host_settings_are_in_each_hosts_units():
    steps = _steps()
    assert steps == [45, 2, 2]  # one packed prefill step, then two decode steps of two tokens
    s = host_settings(steps, [16, 48, 128, 256], 64, 128, 4)
    vllm = s["vllm"]["compilation_config"]
    # step token counts on vLLM's grid (45 -> 48, 2 -> 2), not the attention buckets
    assert vllm == {"cudagraph_capture_sizes": [2, 48], "max_cudagraph_capture_size": 48, "compile_sizes": [2, 48]}
    assert s["vllm"]["max_num_batched_tokens"] == 64
    assert s["static"] == {"sequence_padding": [16, 48, 128], "packed_padding": [16, 48, 128, 256]}
    assert host_settings([45, 2, 2], [16], 64, 128, 1)["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == [48]
    assert host_settings([64, 3], [64], 64, 64, 2)["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == [4, 64]


@pytest.mark.parametrize(("args", "match"), [
    (([], [16], 64, 128, 4), "at least one step"),
    (([65], [16], 64, 128, 4), "a step of 65 tokens is outside 1..max_num_batched_tokens"),
    (([0], [16], 64, 128, 4), "a step of 0 tokens"),
    (([8], [16], 0, 128, 4), "max_num_batched_tokens must be >= 1, got 0"),
    (([8], [16], 64, 128, 0), "max_sizes must be >= 1, got 0"),
    (([8], [16], 64, 0, 4), "max_seq_len must be >= 1, got 0"),
])
def test_bad_host_settings_input_names_the_field(args, match):
    with pytest.raises(ConfigError, match=match):
        host_settings(*args)


def test_vllm_compilation_config_accepts_the_emitted_settings():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from pydantic import ValidationError
    from vllm.config import CompilationConfig

    emitted = host_settings([45, 2, 2, 300, 17], [64], 512, 128, 4)["vllm"]["compilation_config"]
    config = CompilationConfig(**emitted)
    assert config.cudagraph_capture_sizes == emitted["cudagraph_capture_sizes"] == [2, 24, 48, 304]
    assert config.compile_sizes == emitted["compile_sizes"] and config.max_cudagraph_capture_size == 304
    with pytest.raises(ValidationError):  # vLLM's class does validate: an unknown field is refused
        CompilationConfig(**emitted, not_a_field=1)


def test_the_plan_command_writes_vllm_sizes_from_its_steps(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:00.0,{n},{OUTPUT}\n" for n in PROMPTS))
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(trace), "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--max-seq-len", "256", "--policies", "varlen", "--max-buckets", "3", "--out", str(out)]) == 0
    host = json.loads((out / "host_settings.json").read_text())
    assert host["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == list(step_sizes(_steps(), 64, 3))
    buckets = json.loads((out / "plan.json").read_text())["policies"][0]["buckets"]
    assert host["static"]["packed_padding"] == buckets and buckets[-1] == 256  # max_seq_len, the cover


@pytest.mark.slow
def test_vllm_keeps_the_settings_and_serves_under_them_compiled(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from tiny_models import llama

    model = llama(tmp_path / "llama")
    path = tmp_path / "host_settings.json"
    emitted = host_settings(_steps(), [16, 48], FORMER["max_num_batched_tokens"], 128, 2)
    path.write_text(json.dumps(emitted))
    out = tmp_path / "out.json"
    # VLLM_CPU_CI_ENV: vLLM's own switch for its CPU CI, the compiled engine traces with Dynamo and runs the
    # graph without inductor (about 25 s for the child instead of 75 s); vllm-cpu ignores capture sizes either way
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_CI_ENV": "1"}
    proc = subprocess.run([sys.executable, __file__, str(model), str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    section = emitted["vllm"]["compilation_config"]
    # vLLM's normalisation (cudagraphs on) keeps every emitted size as it is; it does change sizes it
    # refuses: a capture size above max_num_batched_tokens is dropped
    assert result["kept"] == {"mode": "FULL_AND_PIECEWISE", **section}
    assert result["probe"]["cudagraph_capture_sizes"] == [16, 48]
    compiled = result["compiled"]
    assert compiled["mode"] != "NONE" and result["eager"]["mode"] == "NONE"
    assert compiled["compile_sizes"] == section["compile_sizes"]
    assert compiled["tokens"] == result["eager"]["tokens"] and [len(t) for t in compiled["tokens"]] == [OUTPUT] * 2
