"""The plan in each host's own units: host_settings.json. vLLM's sizes count a step's
tokens (chosen from the step stream), checked by vLLM's own config classes and served
by a vLLM engine with ``enforce_eager=False``; vllm-gaudi's buckets, tpu-inference's
paddings and vllm-rbln's decode batches are read back by re-implementations of those
runtimes' own readers and generators (attnpolicy.modelling.peer_buckets); static
runtimes' are the planned paddings.

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
from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    LinearRange,
    PeerGraph,
    PeerLimits,
    WorkloadForwards,
    gaudi_decode_graphs,
    gaudi_file_buckets,
    gaudi_file_warmup,
    gaudi_prompt_graphs,
    rbln_manual_decode_batches,
    tpu_env_paddings,
)
from attnpolicy.planning.host_settings import (
    GAUDI_FILE,
    counts_sizes,
    gaudi_buckets,
    host_settings,
    step_sizes,
    vllm_grid,
    vllm_settings,
)
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

#: The served scenario: two prompts generated together, the former's steps of them.
PROMPTS = (5, 40)
OUTPUT = 3
FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256}


def _layouts(prompts=PROMPTS, output=OUTPUT, **former) -> list[BatchLayout]:
    requests = [Request(0.0, n, output) for n in prompts]
    return [s.layout for s in BatchFormer(**{**FORMER, **former}).steps(requests)]


def _steps() -> list[int]:
    return [layout.q_tokens for layout in _layouts()]


def _tokens(*counts: int) -> list[BatchLayout]:
    """Steps of one sequence of each token count (what vLLM's sizes read)."""
    return [BatchLayout.from_lens([n]) for n in counts]


def _limits(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int = FORMER["max_num_seqs"]):
    return PeerLimits(max_num_seqs, max_num_batched_tokens, max_model_len)


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
    assert _steps() == [45, 2, 2]  # one packed prefill step, then two decode steps of two tokens
    s = host_settings(_layouts(), [16, 48, 128, 256], _limits(64, 128), 4).sections
    vllm = s["vllm"]["compilation_config"]
    # step token counts on vLLM's grid (45 -> 48, 2 -> 2), not the attention buckets
    assert vllm == {"cudagraph_capture_sizes": [2, 48], "max_cudagraph_capture_size": 48, "compile_sizes": [2, 48]}
    assert s["vllm"]["max_num_batched_tokens"] == 64
    assert s["static"] == {"sequence_padding": [16, 48, 128], "packed_padding": [16, 48, 128, 256], "missing": []}
    assert s["vllm"]["missing"] == []
    one = host_settings(_tokens(45, 2, 2), [16], _limits(64, 128), 1).sections
    assert one["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == [48]
    two = host_settings(_tokens(64, 3), [64], _limits(64, 64), 2).sections
    assert two["vllm"]["compilation_config"]["cudagraph_capture_sizes"] == [4, 64]


@pytest.mark.parametrize(("args", "match"), [
    (([], 64, 4), "at least one step"),
    (([65], 64, 4), "a step of 65 tokens is outside 1..max_num_batched_tokens"),
    (([0], 64, 4), "a step of 0 tokens"),
    (([8], 0, 4), "max_num_batched_tokens must be >= 1, got 0"),
    (([8], 64, 0), "max_sizes must be >= 1, got 0"),
])
def test_bad_step_sizes_input_names_the_field(args, match):
    with pytest.raises(ConfigError, match=match):
        step_sizes(*args)


@pytest.mark.parametrize(("args", "match"), [
    (([], [16], (64, 128), 4), "at least one step"),
    ((_tokens(65), [16], (64, 128), 4), "a step of 65 tokens is outside 1..max_num_batched_tokens"),
    ((_tokens(8), [16], (64, 128), 0), "max_sizes must be >= 1, got 0"),
])
def test_bad_host_settings_input_names_the_field(args, match):
    steps, buckets, (budget, mml), k = args
    with pytest.raises(ConfigError, match=match):
        host_settings(steps, buckets, _limits(budget, mml), k)
    with pytest.raises(ConfigError, match="max_model_len must be an int >= 1, got 0"):
        _limits(budget, 0)


def test_vllm_compilation_config_accepts_the_emitted_settings():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from pydantic import ValidationError
    from vllm.config import CompilationConfig

    emitted = host_settings(_tokens(45, 2, 2, 300, 17), [64], _limits(512, 128), 4).sections["vllm"]["compilation_config"]
    config = CompilationConfig(**emitted)
    assert config.cudagraph_capture_sizes == emitted["cudagraph_capture_sizes"] == [2, 24, 48, 304]
    assert config.compile_sizes == emitted["compile_sizes"] and config.max_cudagraph_capture_size == 304
    with pytest.raises(ValidationError):  # vLLM's class does validate: an unknown field is refused
        CompilationConfig(**emitted, not_a_field=1)


def test_vllm_takes_a_section_without_capture_sizes_as_no_graph_at_all():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.config import CompilationConfig

    section = vllm_settings((), _limits(512, 128), ["token paddings: none within the budget"])
    config = CompilationConfig(**section["compilation_config"])
    assert config.cudagraph_mode.name == "NONE" and config.cudagraph_capture_sizes == [] == config.compile_sizes
    assert section["missing"] == ["token paddings: none within the budget"]


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
    # vllm-gaudi's file lies next to host_settings.json, named by its env as an absolute path
    gaudi, path = host["gaudi"], (out / GAUDI_FILE).resolve()
    assert gaudi["env"]["VLLM_BUCKETING_FROM_FILE"] == gaudi["bucketing_file"] == str(path)
    warm = gaudi_file_warmup(path.read_text(), _limits(64, 256))
    assert [[g.batch, g.query_tokens, g.context_blocks] for g in warm.phase("prefill")] == gaudi["prompt_buckets"]
    assert [[g.batch, g.context_blocks] for g in warm.phase("decode")] == gaudi["decode_buckets"]
    assert {q for _, q, _ in gaudi["prompt_buckets"]} <= set(buckets)  # prompts pad to the planned buckets


#: A served scenario with chunked prefill, contexts and decodes: four prompts, one of them
#: longer than the step budget.
MIXED = {"prompts": (5, 40, 300, 700), "output": 3, "max_num_batched_tokens": 512, "max_model_len": 1024}
MIXED_BUCKETS = [16, 48, 256, 512, 1024]


def _mixed() -> tuple[list[BatchLayout], PeerLimits]:
    return _layouts(**MIXED), _limits(512, 1024)


def test_gaudi_bucket_file_read_back_warms_up_exactly_the_emitted_buckets():
    steps, limits = _mixed()
    # the steps: 5+40+300+167 tokens; 3 decodes + 509 of the long prompt on 167 of context; 3 decodes + its last
    # 24 on 676; then 1 decode on 701 and on 702 kv tokens
    assert [(s.q_lens, s.kv_lens) for s in steps] == [
        ((5, 40, 300, 167), (5, 40, 300, 167)), ((1, 1, 1, 509), (6, 41, 301, 676)),
        ((1, 1, 1, 24), (7, 42, 302, 700)), ((1,), (701,)), ((1,), (702,))]
    settings = host_settings(steps, MIXED_BUCKETS, limits, 3)
    gaudi = settings.sections["gaudi"]
    # prompts alone (batch 1), query to the planned bucket, context 0, ceil(167/128) = 2, ceil(676/128) = 6 blocks;
    # decodes: 3 sequences of 1 + 1 + 3 blocks (twice), then 1 of 6 blocks (twice)
    assert gaudi["prompt_buckets"] == [[1, 16, 0], [1, 48, 0], [1, 48, 6], [1, 256, 0], [1, 512, 0], [1, 512, 2]]
    assert gaudi["decode_buckets"] == [[1, 6], [3, 5]] and gaudi["missing"] == []
    assert gaudi["env"] == {"VLLM_BUCKETING_FROM_FILE": GAUDI_FILE, "VLLM_PROMPT_BS_BUCKET_MAX": "1",
                            "VLLM_CONTIGUOUS_PA": "false"}
    warm = gaudi_file_warmup(settings.gaudi_file, limits)
    assert [[g.batch, g.query_tokens, g.context_blocks] for g in warm.phase("prefill")] == gaudi["prompt_buckets"]
    assert [[g.batch, g.context_blocks] for g in warm.phase("decode")] == gaudi["decode_buckets"]
    for layout in steps:  # every step runs on a warmed bucket, as vllm-gaudi's runner shapes and looks it up
        decodes = [kv for q, kv in zip(layout.q_lens, layout.kv_lens) if q == 1]
        for q, kv in zip(layout.q_lens, layout.kv_lens):
            if q > 1:
                served = warm.serves("prefill", 1, q, -(-(kv - q) // 128))
                assert served is not None and served.query_tokens == min(b for b in MIXED_BUCKETS if b >= q)
        if decodes:
            assert warm.serves("decode", len(decodes), 1, sum(-(-kv // 128) for kv in decodes)) is not None


def test_gaudi_decode_buckets_hold_at_least_their_batch_and_are_cut_as_vllm_gaudi_cuts_them():
    limits = PeerLimits(4, 64, 256)  # 2 blocks of 128 per sequence at most

    def decodes(*kv: int) -> BatchLayout:
        return BatchLayout.from_lens([1] * len(kv), list(kv))

    # 3 sequences of 3 blocks pad to batch 4 but stay at 3 blocks, a bucket vllm-gaudi drops (batch > blocks):
    # it holds 4 blocks instead
    steps = [decodes(200, 3)] * 10 + [decodes(3, 3, 3)] + [decodes(200, 200, 200, 200)] * 10 + [BatchLayout.from_lens([9])]
    got = gaudi_buckets(WorkloadForwards(steps, limits).of("gaudi"), [16], limits, 2)
    assert got.decode == ((2, 3), (4, 4), (4, 8)) and got.missing == ()
    # one sequence of 2 blocks pads to 8 blocks, which vllm-gaudi cuts to 1 * 2
    cut = gaudi_buckets(WorkloadForwards([decodes(3)] * 10 + [decodes(200)] + [decodes(200, 200, 200, 200)] * 10
                                         + [BatchLayout.from_lens([9])], limits).of("gaudi"), [16], limits, 2)
    assert cut.decode == ((1, 1), (1, 2), (4, 8))
    for buckets in (got, cut):  # what the file warms up is what was emitted
        warm = gaudi_file_warmup(buckets.file_text(limits), limits)
        assert tuple((g.batch, g.context_blocks) for g in warm.phase("decode")) == buckets.decode


def test_gaudi_names_what_its_file_cannot_hold_and_emits_nothing_in_its_place():
    steps, limits = _mixed()
    small = gaudi_buckets(WorkloadForwards(steps, limits).of("gaudi"), [16, 48], limits, 3)  # no planned bucket holds the 300- and 509-token prompts
    assert all(q <= 48 for _, q, _ in small.prompt)
    assert [m for m in small.missing if "no planned bucket" in m] == [
        "prompt of 300 query tokens: no planned bucket holds it (the largest is 48)",
        "prompt of 167 query tokens: no planned bucket holds it (the largest is 48)",
        "prompt of 509 query tokens: no planned bucket holds it (the largest is 48)"]
    large = gaudi_buckets(WorkloadForwards(steps, limits).of("gaudi"), [1024], limits, 3)  # vllm-gaudi drops a prompt bucket above the step budget
    assert large.prompt == () and "vllm-gaudi drops it (batch x query 1024 > max_num_batched_tokens 512)" \
        in " ".join(large.missing)
    prefill_only = gaudi_buckets(WorkloadForwards(_layouts((5, 40), 1), _limits(64, 256)).of("gaudi"), [64],
                                 _limits(64, 256), 2)
    assert prefill_only.decode == () and any(m.startswith("decode: the plan has no decode step")
                                             for m in prefill_only.missing)
    section = host_settings(_layouts((5, 40), 1), [64], _limits(64, 256), 2).sections["gaudi"]
    assert section["decode_buckets"] == [] and section["missing"] == list(prefill_only.missing)


def test_gaudi_file_reader_follows_vllm_gaudis_reader_and_filters():
    text = "\n".join(["# comment", "(1, 2048, 0)", "(1, [256, 512], [0, 4, 8])", "", "  (64, 1, 1024)  ",
                      "(1, 1, range(256, 512, 128))", "([2, 4], 64, -1)", "1, 64, 2.7"])
    assert gaudi_file_buckets(text) == tuple(sorted({
        (1, 2048, 0), (1, 256, 0), (1, 256, 4), (1, 256, 8), (1, 512, 0), (1, 512, 4), (1, 512, 8),
        (64, 1, 1024), (1, 1, 256), (1, 1, 384), (2, 64, -1), (4, 64, -1), (1, 64, 2)}))  # range: 512 left out
    warm = gaudi_file_warmup(text, PeerLimits(64, 2048, 4096))
    # decode blocks cut to batch * ceil(4096 / 128) = 32 for batch 1
    assert [(g.batch, g.context_blocks) for g in warm.phase("decode")] == [(1, 32), (64, 1024)]
    assert PeerGraph("prefill", 1, 2048, 0) in warm.graphs and len(warm.phase("prefill")) == 10
    assert PeerGraph("prefill", 1, 2048, 0) not in gaudi_file_warmup(text, PeerLimits(64, 1024, 4096)).graphs
    for bad in ("(2, 3)", "(1, 2, range(0, 5, 0))", "not python", "(1, 1, range(0, 100000))", "(1, 64, range(3))",
                "[1, 64, 3]", "(1, range(+1, 3), 2)"):  # what vllm-gaudi cannot read stops it
        with pytest.raises(ConfigError, match=r"line 2 of the vllm-gaudi bucketing file .* vllm-gaudi fails on it"):
            gaudi_file_buckets(f"(1, 128, 0)\n{bad}")
    with pytest.raises(ConfigError, match="leaves no prompt bucket"):
        gaudi_file_warmup("(64, 1, 1024)", PeerLimits(64, 2048, 4096))
    with pytest.raises(ConfigError, match="leaves no decode bucket"):
        gaudi_file_warmup("(1, 128, 0)\n(8, 1, 4)", PeerLimits(64, 2048, 4096))  # batch 8 > 4 blocks: dropped


def test_gaudi_strategy_env_warms_up_the_same_buckets_when_they_are_a_product_of_linear_ranges():
    limits = PeerLimits(4, 512, 1024)
    steps = [BatchLayout.from_lens([100, 200]), BatchLayout.from_lens([1, 1], [101, 201])]
    gaudi = host_settings(steps, [128, 256], limits, 2).sections["gaudi"]
    assert gaudi["prompt_buckets"] == [[1, 128, 0], [1, 256, 0]] and gaudi["decode_buckets"] == [[2, 3]]
    env = gaudi["strategy_env"]
    assert env == {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_CONTIGUOUS_PA": "false",
                   "VLLM_PROMPT_BS_BUCKET_MIN": "1", "VLLM_PROMPT_BS_BUCKET_STEP": "1", "VLLM_PROMPT_BS_BUCKET_MAX": "1",
                   "VLLM_PROMPT_QUERY_BUCKET_MIN": "128", "VLLM_PROMPT_QUERY_BUCKET_STEP": "128",
                   "VLLM_PROMPT_QUERY_BUCKET_MAX": "256", "VLLM_PROMPT_CTX_BUCKET_MIN": "0",
                   "VLLM_PROMPT_CTX_BUCKET_STEP": "1", "VLLM_PROMPT_CTX_BUCKET_MAX": "0",
                   "VLLM_DECODE_BS_BUCKET_MIN": "2", "VLLM_DECODE_BS_BUCKET_STEP": "1", "VLLM_DECODE_BS_BUCKET_MAX": "2",
                   "VLLM_DECODE_BLOCK_BUCKET_MIN": "3", "VLLM_DECODE_BLOCK_BUCKET_STEP": "1",
                   "VLLM_DECODE_BLOCK_BUCKET_MAX": "3"} and "strategy_missing" not in gaudi

    def values(dim: str) -> tuple[int, ...]:
        return LinearRange(*(int(env[f"VLLM_{dim}_BUCKET_{p}"]) for p in ("MIN", "STEP", "MAX"))).values()

    prompt = gaudi_prompt_graphs(limits, values("PROMPT_BS"), values("PROMPT_QUERY"), values("PROMPT_CTX"))
    decode = gaudi_decode_graphs(limits, values("DECODE_BS"), values("DECODE_BLOCK"))
    assert [[g.batch, g.query_tokens, g.context_blocks] for g in prompt] == gaudi["prompt_buckets"]
    assert [[g.batch, g.context_blocks] for g in decode] == gaudi["decode_buckets"]
    mixed = host_settings(*_mixed()[:1], MIXED_BUCKETS, _mixed()[1], 3).sections["gaudi"]
    assert mixed["strategy_env"] is None
    assert mixed["strategy_missing"] == "prompt_query values [16, 48, 256, 512] are no linear range (min, step, max)"


@pytest.mark.parametrize("budget", [512, 600])
def test_tpu_settings_are_what_tpu_inference_compiles_from_them(budget):
    steps = _layouts(**{**MIXED, "max_num_batched_tokens": budget})
    limits = _limits(budget, 1024)
    tpu = host_settings(steps, MIXED_BUCKETS, limits, 3).sections["tpu"]
    compiled = tpu_env_paddings(limits, tpu["env"], tpu["additional_config"]["compilation_sizes"])
    tokens, requests = tpu["num_tokens_paddings"], tpu["attn_num_reqs_paddings"]
    assert list(compiled.tokens) == tokens == sorted(set(tokens))  # each once: the runner would keep a duplicate
    assert list(compiled.attention_requests) == requests == sorted(set(requests))  # sorted: the runner bisects
    assert list(compiled.requests) == tpu["num_reqs_paddings"] == [8] and tpu["missing"] == []
    cover = 512 if budget == 512 else 1024  # the power of two its generator always yields, >= the budget
    assert len(tokens) <= 3 and tokens[-1] == cover and all(t % 16 == 0 for t in tokens)
    assert requests[-1] == FORMER["max_num_seqs"] and len(requests) <= 3
    for layout in steps:
        assert any(t >= layout.q_tokens for t in tokens) and any(r >= len(layout.q_lens) for r in requests)
    if budget == 512:  # steps of 512, 512, 27, 1, 1 tokens and 4, 4, 4, 1, 1 requests
        assert tokens == [16, 32, 512] and requests == [1, 4]


def test_rbln_settings_are_a_manual_list_vllm_rbln_accepts():
    steps, limits = _mixed()
    rbln = host_settings(steps, MIXED_BUCKETS, limits, 3).sections["rbln"]
    assert rbln["env"]["VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY"] == "manual"
    listed = rbln_manual_decode_batches(rbln["env"]["VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS"], 4)
    assert listed == tuple(rbln["decode_batch_buckets"]) == (1, 4)  # 3 and 1 decoding; the max batch ends it
    assert len(rbln["missing"]) == 1 and rbln["missing"][0].startswith("prefill: vllm-rbln has no setting")


@pytest.mark.parametrize(("value", "match"), [
    ("1,,4", "comma-separated ints"), ("0,4", "> 0 each"), ("4,1,4", "unique"), ("1,2", "end at the max batch size 4"),
])
def test_rbln_manual_list_is_refused_as_vllm_rbln_refuses_it(value, match):
    with pytest.raises(ConfigError, match=match):
        rbln_manual_decode_batches(value, 4)


def test_steps_above_max_num_seqs_are_named_not_sized():
    steps = [BatchLayout.from_lens([1] * n, [3] * n) for n in (6, 2, 3)]
    sections = host_settings(steps, [16], _limits(64, 256), 2).sections
    assert sections["tpu"]["attn_num_reqs_paddings"] == [2, 4]  # the largest kept, 3, at max_num_seqs
    assert sections["tpu"]["missing"] == ["a step of 6 requests: more than max_num_seqs (4), left out"]
    assert sections["rbln"]["missing"][0] == "a step of 6 decoding requests: more than max_num_seqs (4), left out"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=25), st.integers(1, 4), st.integers(0, 8))
def test_counts_sizes_pad_the_fewest_of_any_list_ending_at_the_top(values, k, above):
    top = max(values) + above
    sizes = counts_sizes(values, k, top=top)
    counts = Counter(values)
    cands = sorted(set(values) - {max(values)})
    assert sizes[-1] == top and set(sizes[:-1]) <= set(cands) and len(sizes) <= k
    best = min(_padded(counts, (*rest, top)) for j in range(min(k, len(cands) + 1))
               for rest in itertools.combinations(cands, j))
    assert _padded(counts, sizes) == best


@pytest.mark.slow
def test_vllm_keeps_the_settings_and_serves_under_them_compiled(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from tiny_models import llama

    model = llama(tmp_path / "llama")
    path = tmp_path / "host_settings.json"
    emitted = host_settings(_layouts(), [16, 48], _limits(FORMER["max_num_batched_tokens"], 128), 2).sections
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
