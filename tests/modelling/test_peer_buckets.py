"""peer_buckets: vllm-gaudi, vllm-rbln and tpu-inference warm-up sets reproduce their own documented
examples, cover every shape up to their maxima, and run as bucket schemes of simulate."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from attnpolicy.cli import main
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.modelling.bucket_schemes import NAMED, bucket_scheme, complete, named_buckets, scheme_name
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    ExponentialRange,
    LinearRange,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    gaudi_config,
    gaudi_decode_graphs,
    gaudi_prompt_graphs,
    gaudi_warmup,
    rbln_decode_batches,
    rbln_env_warmup,
    rbln_warmup,
    tpu_env_paddings,
    tpu_paddings,
    tpu_request_paddings,
    tpu_token_paddings,
)

GAUDI = "vllm-project/vllm-gaudi@091bbadda10bee4fd3f6d0efc1844d2610dd2707"
RBLN = "rebellions-sw/vllm-rbln@e9ff4c1bc9edcad27bfbd4960310498e5c40c48e"
TPU = "vllm-project/tpu-inference@b8692ff01fa191343836996c27a39dc95f008b88"
PEERS = ("gaudi-linear", "gaudi-exponential", "rbln", "tpu")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- documented examples ------------------------------------------------------------------

def test_gaudi_exponential_range_reproduces_its_docstring():
    # GAUDI vllm_gaudi/extension/bucketing/exponential.py, warmup_range_with_limit's docstring:
    # bmin=128, bstep=128, bmax=2048, num_buckets=10
    assert ExponentialRange(128, 128, 2048, 10).values() == (128, 256, 384, 512, 640, 896, 1152, 1536, 2048)


def test_gaudi_exponential_reproduces_the_server_log_of_its_unit_tests():
    # GAUDI tests/unit_tests/test_bucketing.py, "Scenarios derived from real server logs (Qwen3-32B, TP=2,
    # max-model-len=91964)": max_num_seqs 256, block 128, max_num_batched_tokens 2048, num_hpu_blocks 3593
    limits = PeerLimits(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=91964, block_size=128)
    cfg = gaudi_config(limits, "exponential", num_kv_blocks=3593)
    # test_real_scenario_prompt_cfg_matches_log: bs:[1, 2, 1, 1], query:[128, 128, 2048, 11], blocks:[0, 1, 702, 11]
    assert cfg.prompt_batch == ExponentialRange(1, 2, 1, 1)
    assert cfg.prompt_query == ExponentialRange(128, 128, 2048, 11)
    assert cfg.prompt_context == ExponentialRange(0, 1, 702, 11)
    # test_real_scenario_decode_cfg_matches_fixed_bs_log: bs:[1, 2, 256, 9]; _matches_fixed_log: block
    # [1, 256, 3593 * 3, ceil(log2(10779)) + 1]
    assert cfg.decode_batch == ExponentialRange(1, 2, 256, 9)
    assert cfg.decode_blocks == ExponentialRange(1, 256, 10779, 15)
    # test_real_scenario_decode_bs_range_matches_log: "Log showed bs values: 1, 2, 4, 8, 14, 24, 42, 78, 140, 256"
    assert cfg.decode_batch.values() == (1, 2, 4, 8, 14, 24, 42, 78, 140, 256)
    # without a KV cache size the clamp never binds: the unclamped worst case of the same tests, 184064
    assert gaudi_config(limits, "exponential").decode_blocks.max == 184064
    # the long-context edge (max_model_len >= 8192): the largest context is (max_model_len - query) // block
    prompts = gaudi_warmup(limits, "exponential", num_kv_blocks=3593).phase("prefill")
    assert {g.context_blocks for g in prompts if g.query_tokens == 2048} >= {(91964 - 2048) // 128}
    assert max(g.context_blocks or 0 for g in prompts if g.query_tokens == 128) == (91964 - 128) // 128


def test_gaudi_linear_ranges_reproduce_the_doc_and_unit_tests():
    # GAUDI docs/features/bucketing_mechanism.md "Linear Strategy": with and without ramp-up
    assert LinearRange(2, 32, 64).values() == (2, 4, 8, 16, 32, 64)
    assert LinearRange(128, 128, 512).values() == (128, 256, 384, 512)
    # GAUDI tests/unit_tests/test_bucketing.py test_warmup_range, test_warmup_range_with_one
    assert LinearRange(2, 64, 128).values() == (2, 4, 8, 16, 32, 64, 128)
    assert LinearRange(1, 64, 128).values() == (1, 2, 4, 8, 16, 32, 64, 128)
    assert LinearRange(0, 1, 3).values() == (0, 1, 2, 3) and LinearRange(0, 1, 0).values() == (0,)


def test_gaudi_bucket_products_reproduce_the_unit_tests():
    # GAUDI tests/unit_tests/test_bucketing.py test_generate_prompt_buckets: 25 buckets
    prompt = gaudi_prompt_graphs(PeerLimits(16, 2048, 2048, 64), [1, 2, 4, 8, 16], [512, 1024], [0, 1, 2, 3, 4])
    assert len(prompt) == 25 and all(g.batch * g.query_tokens <= 2048 for g in prompt)
    # test_generate_decode_buckets: 18 buckets, every ctx <= bs * (max_model_len // block_size)
    decode = gaudi_decode_graphs(PeerLimits(64, 131072, 2048, 128), [1, 2, 4, 8, 16, 32, 64], range(128, 2049, 128))
    assert len(decode) == 18
    assert all(g.context_blocks is not None and g.context_blocks <= g.batch * (2048 // 128) for g in decode)


def test_gaudi_warmup_pads_a_request_as_the_doc_describes():
    # GAUDI docs/features/bucketing_mechanism.md: a prompt of 412 tokens pads to the 512 query bucket;
    # its decode pads up in batch and blocks
    limits = PeerLimits(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024, block_size=128)
    warm = gaudi_warmup(limits, "exponential")
    assert warm.serves("prefill", 1, 412, 0) == PeerGraph("prefill", 1, 512, 0)
    assert warm.serves("decode", 3, 1, 5) == PeerGraph("decode", 4, 1, 8)
    assert warm.serves("prefill", 1, 1025, 0) is None  # beyond the largest bucket: a new graph


def test_rbln_reproduces_its_doc_examples():
    # RBLN docs/bucketing.md "Exponential": min 2, step 2, limit 4, max_num_seqs 32 -> [32, 16, 8, 4]
    assert rbln_decode_batches(32, "exponential", min_batch=2, step=2, limit=4) == (4, 8, 16, 32)
    # "Linear": min 2, step 4, limit 32, max_num_seqs 16 -> [16, 12, 8, 4]
    assert rbln_decode_batches(16, "linear", min_batch=2, step=4, limit=32) == (4, 8, 12, 16)
    # RBLN vllm_rbln/rbln_envs.py defaults (limit 1): max_num_seqs alone
    warm = rbln_warmup(PeerLimits(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096))
    assert warm.graphs == (PeerGraph("decode", 32, 1), PeerGraph("prefill", 1, 512))
    assert rbln_warmup(PeerLimits(32, 512, 4096), limit=3, pipeline_parallel_size=2).phase("decode") == (
        PeerGraph("decode", 4, 1), PeerGraph("decode", 8, 1), PeerGraph("decode", 16, 1))


def test_tpu_reproduces_its_unit_tests():
    # TPU tests/runner/test_utils.py test_get_paddings
    assert tpu_token_paddings(16, 512, 64) == (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
    assert tpu_token_paddings(16, 317, 64) == (16, 32, 64, 128, 192, 256, 320)
    assert tpu_token_paddings(16, 1024, 0) == (16, 32, 64, 128, 256, 512, 1024)
    assert tpu_token_paddings(16, 317, 0) == (16, 32, 64, 128, 256, 512)
    # test_get_padded_token_len (16, 512, 64): 1 -> 16, 16 -> 16, 20 -> 32, 300 -> 320, 512 -> 512
    warm = tpu_paddings(PeerLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096),
                        padding_gap=64).warmup()
    assert [warm.serves("mixed", 8, x).query_tokens for x in (1, 16, 20, 300, 512)] == [16, 16, 32, 320, 512]
    # test_get_req_paddings
    assert tpu_request_paddings(1, 32) == (8, 16, 32) == tpu_request_paddings(8, 32)
    assert tpu_request_paddings(8, 36) == (8, 16, 32, 36)
    # TPU tpu_inference/runner/tpu_runner.py _init_inputs: attention at max_num_seqs alone by default
    pads = tpu_paddings(PeerLimits(max_num_seqs=36, max_num_batched_tokens=2048, max_model_len=4096))
    assert pads.attention_requests == (36,) and pads.requests == (8, 16, 32, 36)
    assert tpu_paddings(PeerLimits(36, 2048, 4096), bucketize_attention_requests=True).attention_requests == (
        8, 16, 32, 36)
    assert {g.batch for g in pads.warmup().graphs} == {36}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: PeerLimits(0, 2048, 4096), "max_num_seqs must be an int >= 1, got 0"),
    (lambda: PeerLimits(8, 2048, 4096, block_size=-1), "block_size must be an int >= 1, got -1"),
    (lambda: gaudi_warmup(PeerLimits(8, 64, 4096), "linear"),
     "gaudi-linear needs max_num_batched_tokens >= block_size=128 .*got max_num_batched_tokens=64"),
    (lambda: gaudi_warmup(PeerLimits(8, 1, 4096), "exponential"), "max_num_batched_tokens >= 2 .* got max_num_b"),
    (lambda: gaudi_warmup(PeerLimits(8, 2048, 100), "exponential"), "no prompt bucket fits max_model_len=100"),
    (lambda: gaudi_warmup(PeerLimits(8, 2048, 4096), "exponential", max_num_prefill_seqs=0),
     "max_num_prefill_seqs must be an int >= 1, got 0"),
    (lambda: LinearRange(4, 2, 3).values(), "min must be <= its max, got min=4, max=3"),
    (lambda: rbln_decode_batches(16, "exponential", step=1), "step must be an int >= 2, got 1"),
    (lambda: rbln_warmup(PeerLimits(4, 512, 4096), pipeline_parallel_size=8), "must be >= min_batch=1, got 0"),
    (lambda: tpu_paddings(PeerLimits(8, 512, 4096), min_tokens=24), "power of two, got 24"),
])
def test_bad_input_is_a_config_error_naming_the_field(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


# -- properties ---------------------------------------------------------------------------

def ordered(graphs):
    return list(graphs) == sorted(set(graphs), key=PeerGraph.sort_key)


@given(st.integers(0, 300), st.integers(1, 300), st.integers(0, 5000))
def test_linear_range_is_sorted_unique_within_its_bounds(lo, step, span):
    if lo > step and (lo + span) // step * step < lo:  # no ramp-up and no multiple of step in [min, max]
        with pytest.raises(ConfigError, match="has no bucket"):
            LinearRange(lo, step, lo + span).values()
        return
    values = LinearRange(lo, step, lo + span).values()
    assert list(values) == sorted(set(values)) and min(values) >= lo and max(values) <= lo + span
    top = (lo + span) // step * step  # the largest multiple of step within max is a bucket
    if top >= max(step, lo):
        assert top in values


@given(st.integers(0, 300), st.integers(1, 300), st.integers(1, 50000), st.integers(1, 20))
def test_exponential_range_is_sorted_unique_within_its_bounds_and_ends_at_max(lo, step, hi, limit):
    assume(lo in (0, 1) or lo <= hi)
    values = ExponentialRange(lo, step, hi, limit).values()
    assert list(values) == sorted(set(values)) and values[-1] == hi and len(values) <= limit + 1


limits_st = st.builds(PeerLimits, max_num_seqs=st.integers(1, 64), max_num_batched_tokens=st.integers(2, 12000),
                      max_model_len=st.integers(1, 12000), block_size=st.sampled_from((128, 256)))


@settings(max_examples=60, deadline=None)
@given(limits_st, st.sampled_from(("linear", "exponential")), st.integers(1, 4), st.data())
def test_gaudi_buckets_are_within_limits_and_cover_every_shape_up_to_their_maxima(limits, strategy, prefill_seqs,
                                                                                  data):
    block, mml, tokens = limits.block_size, limits.max_model_len, limits.max_num_batched_tokens
    assume(min(mml, tokens) >= block)
    warm = gaudi_warmup(limits, strategy, max_num_prefill_seqs=prefill_seqs)
    assert ordered(warm.graphs)
    prompt, decode = warm.phase("prefill"), warm.phase("decode")
    for g in prompt:
        assert g.batch <= prefill_seqs and g.query_tokens <= min(mml, tokens) and g.batch * g.query_tokens <= tokens
        assert g.context_blocks is not None and 0 <= g.context_blocks <= ceil_div(mml - 1, block)
    for g in decode:
        assert g.context_blocks is not None and g.query_tokens == 1
        assert g.batch <= limits.max_num_seqs and g.batch <= g.context_blocks <= g.batch * ceil_div(mml, block)
    top_q, top_c = max(g.query_tokens for g in prompt), max(g.context_blocks or 0 for g in prompt)
    if strategy == "exponential" and tokens <= mml:
        assert top_q == tokens  # the largest prompt query bucket is max_num_batched_tokens itself
    q = data.draw(st.integers(1, top_q))
    c = data.draw(st.integers(0, top_c)) if mml < 8192 else 0
    assert warm.serves("prefill", 1, q, c) is not None
    top_b, top_n = max(g.batch for g in decode), gaudi_config(limits, strategy).decode_blocks.values()[-1]
    if strategy == "exponential":
        assert top_b == limits.max_num_seqs
    b = data.draw(st.integers(1, top_b))
    n = data.draw(st.integers(b, max(b, min(top_n, b * ceil_div(mml, block)))))
    assume(n <= top_n)
    assert warm.serves("decode", b, 1, n) is not None


@given(st.integers(1, 4096), st.sampled_from(("exponential", "linear")), st.integers(1, 8), st.integers(2, 9),
       st.integers(1, 40), st.data())
def test_rbln_decode_batches_cover_every_batch_up_to_the_largest(max_batch, strategy, min_batch, step, limit, data):
    assume(min_batch <= max_batch)
    batches = rbln_decode_batches(max_batch, strategy, min_batch=min_batch, step=step, limit=limit)
    assert list(batches) == sorted(set(batches)) and batches[-1] == max_batch and len(batches) <= limit
    assert all(min_batch <= b <= max_batch for b in batches)
    warm = rbln_warmup(PeerLimits(max_batch, 512, 4096), strategy, min_batch=min_batch, step=step, limit=limit)
    assert warm.serves("decode", data.draw(st.integers(1, max_batch)), 1) is not None
    assert warm.serves("prefill", 1, data.draw(st.integers(1, 512))) == PeerGraph("prefill", 1, 512)


@given(st.integers(1, 1024), st.integers(1, 100000), st.sampled_from((0, 16, 64, 100, 512)),
       st.sampled_from((1, 8, 16, 64)), st.data())
def test_tpu_paddings_cover_every_count_up_to_the_maxima(seqs, tokens, gap, min_tokens, data):
    if gap and min_tokens > gap and tokens <= min_tokens // 2:  # the runtime's rule lists no padding
        assert tpu_token_paddings(min_tokens, tokens, gap) == ()
        with pytest.raises(ConfigError, match=f"empty for min_tokens={min_tokens}, padding_gap={gap}"):
            tpu_paddings(PeerLimits(seqs, tokens, 4096), padding_gap=gap, min_tokens=min_tokens)
        return
    pads = tpu_paddings(PeerLimits(seqs, tokens, 4096), padding_gap=gap, min_tokens=min_tokens)
    for sizes in (pads.tokens, pads.requests, pads.attention_requests):
        assert list(sizes) == sorted(set(sizes))
    assert pads.tokens[-1] >= tokens
    if gap == 0 or tokens > gap:  # else the doubling up to the gap may already pass max_num_batched_tokens
        assert len(pads.tokens) == 1 or pads.tokens[-2] < tokens
    assert pads.requests[-1] == max(seqs, 8) and pads.attention_requests == (seqs,)
    warm = pads.warmup()
    assert ordered(warm.graphs)
    assert warm.serves("mixed", data.draw(st.integers(1, seqs)), data.draw(st.integers(1, tokens))) is not None


@pytest.mark.parametrize(("tokens", "gap", "min_tokens"), [(16, 16, 64), (32, 16, 64), (8, 1, 16)])
def test_tpu_paddings_that_list_no_token_padding_are_refused_naming_the_settings(tokens, gap, min_tokens):
    assert tpu_token_paddings(min_tokens, tokens, gap) == ()
    with pytest.raises(ConfigError, match=f"max_num_batched_tokens={tokens}"):
        tpu_paddings(PeerLimits(4, tokens, 4096), padding_gap=gap, min_tokens=min_tokens)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(PEERS), st.integers(128, 20000), st.integers(1, 8), st.data())
def test_projected_schemes_serve_every_length_and_keep_the_peers_sizes(name, max_seq_len, factor, data):
    max_batch_tokens = max_seq_len * factor
    buckets = named_buckets(name, max_seq_len, max_batch_tokens)
    sizes = buckets.sizes or ()
    assert list(sizes) == sorted(set(sizes)) and max_seq_len in sizes and sizes[-1] == max_batch_tokens
    peer = WARMUPS[name](PeerLimits(1, max_seq_len, max_seq_len)).prefill_lengths()
    assert {s for s in peer if s <= max_seq_len} <= set(sizes)
    buckets.bucket(data.draw(st.integers(1, max_seq_len)), max_seq_len)  # no overflow
    buckets.bucket(data.draw(st.integers(1, max_batch_tokens)), max_batch_tokens)
    assert scheme_name(buckets, max_seq_len, max_batch_tokens) in NAMED


# -- as bucket schemes --------------------------------------------------------------------

def test_peer_schemes_are_named_bucket_schemes():
    assert set(PEERS) <= set(NAMED)
    gaudi = bucket_scheme("gaudi-exponential", 8192, 131072).buckets.sizes
    assert gaudi == (128, 256, 384, 512, 768, 1024, 1536, 2048, 2944, 4096, 5888, 8192, 16384, 32768, 65536, 131072)
    assert bucket_scheme("rbln", 8192, 131072).buckets.sizes == (8192, 16384, 32768, 65536, 131072)
    assert bucket_scheme("rbln", 8192, 2048).buckets.sizes == (2048, 8192)  # whole-model graphs: the step budget
    # tpu pads 1000 tokens to 1024: a sequence is bucketed within max_seq_len, so 1000 is a size too
    assert bucket_scheme("tpu", 1000, 4000).buckets.sizes == (16, 32, 64, 128, 256, 512, 1000, 1024, 2048, 4000)
    assert scheme_name(bucket_scheme("gaudi-linear", 1024, 4096).buckets, 1024, 4096) == "gaudi-linear"
    # a scheme that cannot be built for the lengths (gaudi-linear under one block) names nothing
    odd = Buckets(kind="list", sizes=(8, 24, 64, 256))
    assert scheme_name(odd, 64, 256) == odd.describe()
    with pytest.raises(ConfigError, match="bucket scheme 'gaudi-linear' at max_seq_len=64, max_batch_tokens=256: "
                                          "gaudi-linear needs max_num_batched_tokens >= block_size=128"):
        bucket_scheme("gaudi-linear", 64, 256)


def test_complete_adds_max_seq_len_when_the_list_steps_over_it():
    assert complete((64, 300, 2048), 1024, 4096) == (64, 300, 1024, 2048, 4096)
    assert complete((16, 48), 100, 1000) == (16, 48, 100, 200, 400, 800, 1000)


def test_simulate_cli_runs_the_peer_schemes(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["simulate", "--limit", "6", "--policies", "varlen", "--capacities", "inf", "--evictions", "lru",
                 "--buckets", "pow2,gaudi-exponential,rbln,tpu", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "512", "--json", str(out)]) == 0
    rows = {r["buckets"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["pow2", "gaudi-exponential", "rbln", "tpu"]
    assert rows["rbln"]["distinct_keys"] < min(rows[s]["distinct_keys"] for s in ("pow2", "gaudi-exponential"))
    assert rows["tpu"]["distinct_keys"] == rows["pow2"]["distinct_keys"]  # tpu's default paddings are pow2's sizes
    assert "gaudi-exponential" in capsys.readouterr().out


def test_runtimes_read_their_environment_as_they_do():
    limits = PeerLimits(16, 2048, 8192)
    # unset: the defaults
    assert tpu_env_paddings(limits, {}) == tpu_paddings(limits)
    assert rbln_env_warmup(limits, {}) == rbln_warmup(limits)
    # set: each variable as its runtime reads it
    assert tpu_env_paddings(limits, {"MIN_TOKEN_BUCKET": "512", "ATTN_BUCKETIZED_NUM_REQS": "true",
                                     "ATTN_CUSTOM_NUM_REQS_BUCKETS": "2,8"}, [48]) == tpu_paddings(
        limits, min_tokens=512, bucketize_attention_requests=True, custom_attention_requests=[2, 8],
        compilation_sizes=[48])
    assert tpu_env_paddings(limits, {"ATTN_BUCKETIZED_NUM_REQS": "1"}).attention_requests == (8, 16)
    assert tpu_env_paddings(limits, {"ATTN_BUCKETIZED_NUM_REQS": "0"}).attention_requests == (16,)
    assert rbln_env_warmup(limits, {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "manual",
                                    "VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS": "4,16"}) == rbln_warmup(
        limits, manual="4,16")
    assert rbln_env_warmup(limits, {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "linear"}) == rbln_warmup(
        limits, "linear")
    with pytest.raises(ConfigError, match="MIN_TOKEN_BUCKET must be an int, got 'big'"):
        tpu_env_paddings(limits, {"MIN_TOKEN_BUCKET": "big"})
    with pytest.raises(ConfigError, match="ATTN_CUSTOM_NUM_REQS_BUCKETS must be comma-separated ints"):
        tpu_env_paddings(limits, {"ATTN_BUCKETIZED_NUM_REQS": "1", "ATTN_CUSTOM_NUM_REQS_BUCKETS": "2;8"})
    with pytest.raises(ConfigError, match="exponential, linear or manual, got 'fixed'"):
        rbln_env_warmup(limits, {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "fixed"})
    with pytest.raises(ConfigError, match="must end at the max batch size 16"):
        rbln_env_warmup(limits, {"VLLM_RBLN_DECODE_BATCH_BUCKET_STRATEGY": "manual",
                                 "VLLM_RBLN_DECODE_BATCH_BUCKET_MANUAL_BUCKETS": "4,8"})


graphs = st.lists(st.builds(PeerGraph, st.sampled_from(("prefill", "decode", "mixed")), st.integers(1, 6),
                            st.integers(1, 6), st.none() | st.integers(0, 6)), max_size=12)
asked = st.tuples(st.sampled_from(("prefill", "decode", "mixed")), st.integers(1, 7), st.integers(1, 7),
                  st.none() | st.integers(0, 7))


@settings(max_examples=80, deadline=None)
@given(graphs, st.lists(asked, max_size=20))
def test_a_warm_set_serves_each_shape_by_the_first_graph_in_order_that_fits(graphs, shapes):
    warm = PeerWarmSet.of("gaudi-linear", graphs)
    expected = [next((g for g in warm.graphs if g.phase == phase and g.batch >= b and g.query_tokens >= q
                      and (c is None or g.context_blocks is None or g.context_blocks >= c)), None)
                for phase, b, q, c in shapes]
    assert [None if at < 0 else warm.graphs[at] for at in warm.serving(shapes)] == expected
    assert [warm.serves(*shape) for shape in shapes] == expected
