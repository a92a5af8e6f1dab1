"""The plan in the host's own terms: host_settings.json, validated by vLLM's own
config class and served by a vLLM engine under the emitted compile sizes.

The engine runs in a child Python (this file as a script), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with a tiny random Llama: no downloads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnpolicy.errors import ConfigError
from attnpolicy.planning.host_settings import host_settings


def _child(model: str, settings_path: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    settings = json.loads(Path(settings_path).read_text())["vllm"]
    llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=settings["max_num_batched_tokens"],
              compilation_config=settings["compilation_config"], enforce_eager=False)
    cc = llm.llm_engine.vllm_config.compilation_config
    prompts = [{"prompt_token_ids": [4 + (7 * i + j) % 120 for j in range(n)]} for i, n in enumerate((5, 40))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    Path(out).write_text(json.dumps({"compile_sizes": list(cc.compile_sizes or []),
                                     "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
                                     "tokens": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
    sys.exit(0)


def test_host_settings_render_the_planned_buckets():
    s = host_settings([64, 16, 512, 64], 256)
    assert s["vllm"]["compilation_config"] == {"compile_sizes": [16, 64], "cudagraph_capture_sizes": [16, 64]}
    assert s["token_padding"] == [16, 64, 512]  # a static-graph runtime pads to every planned size
    assert host_settings([512], 256)["vllm"]["compilation_config"]["compile_sizes"] == []
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        host_settings([512], 0)


def test_vllm_compilation_config_accepts_the_emitted_settings():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from pydantic import ValidationError
    from vllm.config import CompilationConfig

    emitted = host_settings([48, 128, 200], 256)["vllm"]["compilation_config"]
    config = CompilationConfig(**emitted)
    assert config.compile_sizes == [48, 128, 200]
    assert config.cudagraph_capture_sizes == [48, 128, 200]
    with pytest.raises(ValidationError):  # vLLM's class does validate: an unknown field is refused
        CompilationConfig(**emitted, not_a_field=1)


@pytest.mark.slow
def test_vllm_serves_under_the_emitted_settings(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from tiny_models import llama

    model = llama(tmp_path / "llama")
    settings = tmp_path / "host_settings.json"
    settings.write_text(json.dumps(host_settings([16, 48], 64)))
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, str(model), str(settings), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["compile_sizes"] == [16, 48]
    assert [len(t) for t in result["tokens"]] == [3, 3]
