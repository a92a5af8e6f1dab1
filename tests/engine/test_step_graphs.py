"""Step graphs (decode, chunked prefill, mixed steps) against the eager HF model: a
whole sequence run at once, and HF's own greedy generation."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from cost_models import of_model, synthetic
from docs_blocks import ROOT, blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_static_model import TINY, Counted, config

from attnpolicy.cli import main
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import GraphSet, ModelKey, dominates, estimate_bytes, forwards, model_key_for, step_keys
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import ModelSpec, parse_spec
from attnpolicy.engine.runner import StaticModelRunner
from attnpolicy.errors import ConfigError, IllegalModeError, LayoutError, StrictModeError
from attnpolicy.modelling.cost_file import CostFile

VOCAB = 64
MAX_LEN = 64  # test_static_model's config: max_seq_len 64, max_batch_tokens 128, pow2 from 16, aot_eager


@pytest.fixture(scope="module", params=sorted(TINY))
def models(request):
    """(runner model, reference model): two builds of one spec, so equal weights."""
    spec = parse_spec(TINY[request.param])
    assert isinstance(spec, ModelSpec)
    return spec.build(), spec.build()


def whole(reference, tokens: list[int]) -> torch.Tensor:
    """The reference: the eager model over the whole sequence at once ``[len, vocab]``."""
    with torch.no_grad():
        return reference(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]


def serve(runner, seqs: list[list[int]], chunks: list[list[int]], *, mode: MaskMode | None = None,
          graphs: GraphSet | None = None):
    """Run ``seqs`` through ``runner`` in steps (in ``mode``, or served from ``graphs``):
    step ``j`` gives sequence ``i`` its next ``chunks[j][i]`` tokens (0: none); yields each
    step's logits per sequence."""
    kv = KVCache.for_model(runner.model, len(seqs), MAX_LEN)
    done = [0] * len(seqs)
    for step in chunks:
        live = [i for i, n in enumerate(step) if n]
        q = [step[i] for i in live]
        layout = BatchLayout.from_lens(q, [done[i] + n for i, n in zip(live, q)], causal=True)
        ids = torch.tensor([t for i, n in zip(live, q) for t in seqs[i][done[i]:done[i] + n]])
        out = (runner.serve(ids, layout, graphs, kv=kv, slots=live) if graphs is not None
               else runner.logits(ids, layout, kv=kv, slots=live) if mode is None
               else runner.run(ids, layout, mode, kv=kv, slots=live))
        rows = {}
        for i, n, start in zip(live, q, layout.q_starts):
            rows[i] = (done[i], out[start:start + n])
            done[i] += n
        yield rows


@st.composite
def schedules(draw, max_seqs: int = 3):
    """Sequences of random tokens and the steps that serve them: each step gives a live
    sequence a chunk (prefill, chunked prefill) or one token (decode), so steps mix."""
    n = draw(st.integers(1, max_seqs))
    lens = [draw(st.integers(1, 24)) for _ in range(n)]
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lens]
    left, chunks = list(lens), []
    while any(left):
        first = next(i for i in range(n) if left[i])  # every step serves someone
        step = [draw(st.integers(int(i == first), left[i])) if left[i] else 0 for i in range(n)]
        left = [a - b for a, b in zip(left, step)]
        chunks.append(step)
    return seqs, chunks


@pytest.mark.parametrize("policy", ["always-mask", "varlen"])
@settings(max_examples=4, deadline=None)
@given(schedule=schedules())
def test_every_step_equals_the_whole_sequence_run_eagerly(models, policy, schedule):
    model, reference = models
    counted = Counted()
    runner = StaticModelRunner(model, config(policy), compile_counter=counted)
    seqs, chunks = schedule
    for rows in serve(runner, seqs, chunks):
        for i, (at, got) in rows.items():
            want = whole(reference, seqs[i])[at:at + got.shape[0]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{policy} seq {i} at {at}")
    stats = runner.stats()
    assert stats.cache.compiles == counted.n == stats.cache.misses
    # varlen runs one sequence mask-free (CAUSAL) where that is legal
    assert set(stats.modes) <= ({"mask"} if policy == "always-mask" else {"varlen", "causal"})


@settings(max_examples=3, deadline=None)
@given(lens=st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_one_sequence_runs_causal_over_its_exact_context(models, lens):
    model, reference = models
    runner = StaticModelRunner(model, config())
    tokens = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(sum(lens))).tolist()
    for rows in serve(runner, [tokens], [[n] for n in lens], mode=MaskMode.CAUSAL):
        at, got = rows[0]
        torch.testing.assert_close(got, whole(reference, tokens)[at:at + got.shape[0]], rtol=0, atol=1e-5)
    keys = {str(k) for k in runner.cache.keys()}
    assert all(k.startswith("step/causal/") for k in keys)
    done = [sum(lens[:j]) for j in range(len(lens))]
    assert keys == {str(ModelKey(MaskMode.CAUSAL, runner.config.bucket(n), c, ((runner.config.bucket(n), c),),
                                 "aot_eager", kv=True)) for n, c in zip(lens, done)}


@pytest.mark.parametrize("policy", ["always-mask", "varlen", "dynamic", "always-causal", "always-rows"])
def test_greedy_tokens_equal_hf_generate(models, policy):
    model, reference = models
    runner = StaticModelRunner(model, config(policy))
    prompts, new = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20]], 6
    # generate stops at the end-of-sequence token; the runner's steps run on: its prefix must agree
    want = [reference.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    kv = KVCache.for_model(model, len(prompts), MAX_LEN)
    slots = list(range(len(prompts)))
    layout = BatchLayout.from_lens([len(p) for p in prompts], causal=True)
    out = runner.logits(torch.tensor([t for p in prompts for t in p]), layout, kv=kv, slots=slots)
    nxt = [int(out[s + len(p) - 1].argmax()) for s, p in zip(layout.q_starts, prompts)]
    got: list[list[int]] = [[] for _ in prompts]
    for step in range(new):
        for i, t in enumerate(nxt):
            got[i].append(t)
        if step == new - 1:
            break
        layout = BatchLayout.from_lens([1] * len(prompts), [kv.length(s) + 1 for s in slots], causal=True)
        out = runner.logits(torch.tensor(nxt), layout, kv=kv, slots=slots)
        nxt = out.argmax(-1).tolist()
    assert [g[:len(w)] for g, w in zip(got, want)] == want and all(want)


def test_keys_bucket_rows_and_context_and_a_larger_key_dominates():
    cfg = config()
    layout = BatchLayout.from_lens([1, 1, 3], [20, 9, 3], causal=True)
    mask = model_key_for(layout, MaskMode.MASK, cfg, kv=True)
    assert (mask.tokens, mask.context) == (16, 32)  # rows 5, context 19 + 8 + 0 = 27
    varlen = model_key_for(layout, MaskMode.VARLEN, cfg, kv=True)
    assert varlen.segments == ((16, 32), (16, 16), (16, 0))
    assert str(varlen) == "step/varlen/t16c32+t16c16+t16c0/aot_eager"
    one = BatchLayout.from_lens([2], [13], causal=True)
    causal = model_key_for(one, MaskMode.CAUSAL, cfg, kv=True)
    assert (causal.tokens, causal.context) == (16, 11)
    bigger = ModelKey(MaskMode.MASK, 32, 64, ((32, 64),), "aot_eager", kv=True)
    assert dominates(bigger, mask) and not dominates(mask, bigger)
    assert not dominates(ModelKey(MaskMode.CAUSAL, 32, 12, ((32, 12),), "aot_eager", kv=True), causal)  # exact context
    assert dominates(ModelKey(MaskMode.CAUSAL, 32, 11, ((32, 11),), "aot_eager", kv=True), causal)


@settings(max_examples=2, deadline=None)  # the float64 test below checks more schedules, exactly
@given(schedule=schedules(max_seqs=4))
def test_every_rows_step_equals_the_whole_sequence_run_eagerly(models, schedule):
    """ROWS steps (prefill, chunked prefill, decode, mixed): one sequence per row, each
    row's context bounded in the graph; one graph per (rows, length, context) buckets."""
    model, reference = models
    runner = StaticModelRunner(model, config())
    seqs, chunks = schedule
    for rows in serve(runner, seqs, chunks, mode=MaskMode.ROWS):
        for i, (at, got) in rows.items():
            torch.testing.assert_close(got, whole(reference, seqs[i])[at:at + got.shape[0]], rtol=0, atol=1e-5,
                                       msg=f"rows seq {i} at {at}")
    assert all(str(k).startswith("step/rows/r") for k in runner.cache.keys())


@pytest.fixture(scope="module")
def models64(models):
    """The models in float64: the reference the ROWS graphs must equal to float64's precision."""
    return tuple(copy.deepcopy(m).double() for m in models)


@settings(max_examples=3, deadline=None)
@given(schedule=schedules(max_seqs=4))
def test_rows_steps_equal_the_float64_reference(models64, schedule):
    model, reference = models64
    runner = StaticModelRunner(model, config())
    seqs, chunks = schedule
    for rows in serve(runner, seqs, chunks, mode=MaskMode.ROWS):
        for i, (at, got) in rows.items():
            assert got.dtype is torch.float64
            torch.testing.assert_close(got, whole(reference, seqs[i])[at:at + got.shape[0]], rtol=0, atol=1e-10)


def test_rows_keys_bucket_rows_length_and_context_with_no_combination():
    cfg = config()
    layout = BatchLayout.from_lens([3, 2, 3], [20, 9, 3], causal=True)
    key = model_key_for(layout, MaskMode.ROWS, cfg, kv=True)
    assert (key.rows, key.segments[0], key.tokens, key.context) == (4, (16, 32), 64, 128)
    assert str(key) == "step/rows/r4t16c32/aot_eager"
    # another mix of the same buckets (order, lengths, contexts): the same graph
    assert model_key_for(BatchLayout.from_lens([3, 2, 4, 5], [3, 30, 6, 18], causal=True), MaskMode.ROWS, cfg,
                         kv=True) == key
    prefill = model_key_for(BatchLayout.from_lens([5, 20, 3], causal=True), MaskMode.ROWS, cfg, kv=False)
    assert str(prefill) == "model/rows/r4t32/aot_eager" and prefill.context == 0
    larger = [model_key_for(BatchLayout.from_lens(q, c, causal=True), MaskMode.ROWS, cfg, kv=True)
              for q, c in (([2] * 5, [20] * 5), ([17], [20]), ([2], [40]))]
    assert all(dominates(k, key) for k in larger[:1]) and not any(dominates(key, k) for k in larger)
    assert not dominates(larger[1], key) and not dominates(larger[2], key)  # fewer rows
    assert model_key_for(BatchLayout.from_lens([1], [2], causal=True), MaskMode.MASK, cfg, kv=True).rows == 1


def test_a_rows_step_runs_its_decodes_apart_from_its_prefills_and_at_most_the_largest_row_bucket():
    """A ROWS step's forwards: each run of one phase (one query row: decode; more:
    prefill) its own, so no decode row pads to a prompt's length; a run longer than the
    largest row bucket splits; every other mode is one forward."""
    cfg = config()
    mixed = BatchLayout.from_lens([1, 1, 30, 1], [20, 9, 30, 5], causal=True)
    assert forwards(mixed, MaskMode.ROWS, cfg) == ((0, 2), (2, 3), (3, 4))
    assert [str(k) for k in step_keys(mixed, MaskMode.ROWS, cfg, kv=True)] == [
        "step/rows/r2t1c32/aot_eager", "step/rows/r1t32c0/aot_eager", "step/rows/r1t1c16/aot_eager"]
    assert forwards(mixed, MaskMode.MASK, cfg) == ((0, 4),)
    assert len(step_keys(mixed, MaskMode.VARLEN, cfg, kv=True)) == 1
    many = BatchLayout.from_lens([1] * 33, [4] * 33, causal=True)
    assert forwards(many, MaskMode.ROWS, cfg) == ((0, 32), (32, 33))
    assert [k.rows for k in step_keys(many, MaskMode.ROWS, cfg, kv=True)] == [32, 1]


def test_a_rows_step_builds_no_host_mask_and_pads_up_to_more_rows(models, monkeypatch):
    """A ROWS step's only bound is its lengths input ``[rows]``: no host-built mask (the
    mask builder is never called, no boolean input); a graph of more rows, longer rows
    and more context serves it padded up."""
    import attnpolicy.engine.runner as runner_module

    model, reference = models
    built = []
    monkeypatch.setattr(runner_module, "mask_for", lambda *a, **k: built.append(a))
    runner = StaticModelRunner(model, config("dynamic", compile_mode="background",
                                             switch_after=1000))
    big = BatchLayout.from_lens([16] * 4, [56] * 4, causal=True)  # 4 chunks of 16 over 40 cached
    runner.warmup([(big, MaskMode.ROWS)])
    seqs = [list(range(1, 13)), list(range(20, 28))]
    kv = KVCache.for_model(model, 2, MAX_LEN)
    first = runner.run(torch.tensor(seqs[0] + seqs[1]), BatchLayout.from_lens([12, 8], causal=True), MaskMode.ROWS,
                       kv=kv, slots=[0, 1])
    torch.testing.assert_close(first[:12], whole(reference, seqs[0]), rtol=0, atol=1e-5)
    torch.testing.assert_close(first[12:], whole(reference, seqs[1]), rtol=0, atol=1e-5)
    step = BatchLayout.from_lens([1, 1], [13, 9], causal=True)
    placed = runner.prepare(torch.tensor([9, 10]), step, MaskMode.ROWS, kv=kv, slots=[0, 1])
    assert not any(x.dtype is torch.bool for x in placed.inputs)
    assert placed.inputs[-1].tolist() == [12, 8]  # each row's context
    got = runner.run(torch.tensor([9, 10]), step, MaskMode.ROWS, kv=kv, slots=[0, 1])
    for i, (row, tokens) in enumerate(zip(got, [seqs[0] + [9], seqs[1] + [10]])):
        torch.testing.assert_close(row, whole(reference, tokens)[-1], rtol=0, atol=1e-5, msg=f"seq {i}")
    stats = runner.stats()
    # the warm r4t16c64 graph served both: the prefill (no context) and the decode (r2t1c16)
    assert stats.background is not None and stats.background.pad_up_calls == 2 and stats.eager_served == 0
    assert built == []
    runner.close()


@pytest.mark.parametrize("mode", list(MaskMode))
def test_a_prefill_key_is_a_step_key_with_no_context_whose_kv_is_not_kept(mode):
    cfg = config()
    layout = BatchLayout.from_lens([5] if mode is MaskMode.CAUSAL else [5, 20, 3], causal=True)
    prefill, step = (model_key_for(layout, mode, cfg, kv=kv) for kv in (False, True))
    assert prefill == ModelKey(step.mode, step.tokens, 0, step.segments, step.backend, kv=False)
    assert str(prefill).startswith("model/") and str(step).startswith("step/")
    # neither graph serves the other: one returns the new KV rows, the other does not
    larger = model_key_for(BatchLayout.from_lens([20] if mode is MaskMode.CAUSAL else [40, 20, 20], causal=True),
                           mode, cfg, kv=False)
    assert dominates(larger, prefill) and not dominates(larger, step)
    dims = SimpleNamespace(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           intermediate_size=128, vocab_size=64, num_hidden_layers=2)
    kv_rows = 4 * 2 * 2 * 1 * 32 * step.tokens  # float32 keys and values of every layer's new rows
    assert estimate_bytes(step, dims) - estimate_bytes(prefill, dims) == kv_rows


def test_a_step_pads_up_to_a_resident_graph_in_the_background(models):
    model, reference = models
    counted = Counted()
    runner = StaticModelRunner(model, config("always-mask", compile_mode="background", switch_after=1000),
                               compile_counter=counted)
    big = BatchLayout.from_lens([1, 1], [40, 40], causal=True)
    runner.warmup([(big, MaskMode.MASK)])
    seqs = [list(range(1, 13)), list(range(20, 28))]
    kv = KVCache.for_model(model, 2, MAX_LEN)
    prefill = BatchLayout.from_lens([12, 8], causal=True)  # 32 rows: more than the warm graph's 16
    runner.logits(torch.tensor(seqs[0] + seqs[1]), prefill, kv=kv, slots=[0, 1])
    step = BatchLayout.from_lens([1, 1], [13, 9], causal=True)  # 16 rows, context 32: the warm graph's, padded up
    got = runner.logits(torch.tensor([9, 10]), step, kv=kv, slots=[0, 1])
    for i, (row, tokens) in enumerate(zip(got, [seqs[0] + [9], seqs[1] + [10]])):
        torch.testing.assert_close(row, whole(reference, tokens)[-1], rtol=0, atol=1e-5, msg=f"seq {i}")
    stats = runner.stats()
    assert stats.background is not None  # one worker serves prefill and step graphs
    assert stats.background.pad_up_calls == 1
    assert stats.eager_served == 1  # the prefill step, while its graph compiles
    runner.close()


def test_strict_raise_on_a_step_compile_after_warmup(models):
    model, _ = models
    runner = StaticModelRunner(model, config("always-mask", strict="raise"))
    warm = BatchLayout.from_lens([1, 1], [8, 8], causal=True)
    assert runner.warmup([(warm, MaskMode.MASK)]) == [*runner.keys_for(warm, MaskMode.MASK, kv=True)]
    kv = KVCache.holding(model, [20], MAX_LEN)
    with pytest.raises(StrictModeError, match="step/mask/t16c32"):
        runner.logits(torch.tensor([3]), BatchLayout.from_lens([1], [21], causal=True), kv=kv, slots=[0])
    assert kv.length(0) == 20  # nothing applied
    assert runner.stats().strict_violations == 1


def test_a_stored_step_graph_loads_in_a_new_runner(models, tmp_path):
    model, _ = models
    layout = BatchLayout.from_lens([1, 2], [5, 4], causal=True)
    outs, disks = [], []
    for _ in range(2):
        runner = StaticModelRunner(model, config("varlen", store_dir=str(tmp_path)))
        kv = KVCache.holding(model, [4, 2], MAX_LEN)
        outs.append(runner.logits(torch.tensor([1, 2, 3]), layout, kv=kv, slots=[0, 1]))
        disk = runner.stats().disk
        assert disk is not None
        disks.append((disk.saves, disk.hits, disk.misses))
        runner.close()
    assert disks == [(1, 0, 1), (0, 1, 0)]  # compiled and saved once, then loaded
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert kv.length(0) == 5 and kv.length(1) == 4


@pytest.mark.parametrize("make,match", [
    (lambda kv: dict(layout=BatchLayout.from_lens([1], [5], causal=True), slots=[0, 1]), "one slot per sequence"),
    (lambda kv: dict(layout=BatchLayout.from_lens([1], [5], causal=True), slots=[0]),
     "sequence 0 has 4 tokens of cached context, but slot 0 holds 2"),
    (lambda kv: dict(layout=BatchLayout.from_lens([1, 1], [3, 3], causal=True), slots=[0, 0]), "distinct"),
    (lambda kv: dict(layout=BatchLayout.from_lens([1], [3], causal=True), slots=[7]), r"slot must be an int in \[0, 2\)"),
    (lambda kv: dict(layout=BatchLayout.from_lens([1], [3], causal=True), slots=None), "kv and slots go together"),
    (lambda kv: dict(layout=BatchLayout.from_lens([1], [3], causal=True), slots=[0], kv=None),
     "kv and slots go together"),
    (lambda kv: dict(layout=BatchLayout.from_lens([60], [62], causal=True), slots=[0]), "max_len=8"),
])
def test_bad_steps_are_refused_before_any_work(models, make, match):
    model, _ = models
    runner = StaticModelRunner(model, config())
    kv = KVCache.holding(model, [2, 0], 8)
    args = {"kv": kv, **make(kv)}
    layout = args.pop("layout")
    with pytest.raises(LayoutError, match=match):
        runner.logits(torch.zeros(layout.q_tokens, dtype=torch.long), layout, **args)
    assert (kv.length(0), kv.length(1)) == (2, 0)
    assert runner.stats().cache.compiles == 0


def test_causal_is_refused_for_a_packed_step(models):
    model, _ = models
    runner = StaticModelRunner(model, config())
    kv = KVCache.holding(model, [2, 2], MAX_LEN)
    with pytest.raises(IllegalModeError, match="2 sequences packed"):
        runner.run(torch.zeros(2, dtype=torch.long), BatchLayout.from_lens([1, 1], [3, 3], causal=True),
                   MaskMode.CAUSAL, kv=kv, slots=[0, 1])


def test_a_kv_cache_refuses_bad_shapes():
    with pytest.raises(ConfigError, match="slots must be an int >= 1, got 0"):
        KVCache(0, 8, layers=1, kv_heads=1, head_dim=4)
    with pytest.raises(ConfigError, match="max_len must be an int >= 1, got 2.5"):
        KVCache(1, 2.5, layers=1, kv_heads=1, head_dim=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="one length per slot"):
        KVCache(2, 8, layers=1, kv_heads=1, head_dim=4, lengths=[1])
    with pytest.raises(ConfigError, match=r"a slot's length must be an int in \[0, 8\], got 9"):
        KVCache(1, 8, layers=1, kv_heads=1, head_dim=4, lengths=[9])


@pytest.mark.parametrize("policy", ["always-mask", "varlen", "always-rows", "dynamic:rows=0.5"])
def test_run_model_serves_whole_requests_and_checks_every_token(tmp_path, capsys, policy):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0000000,{p},{g}\n" for i, (p, g) in enumerate([(40, 6), (9, 12), (70, 3), (3, 5)])))
    out = tmp_path / "run.json"
    name, _, option = policy.partition(":")
    rc = main(["run", "--model", TINY["qwen3"], "--trace", str(trace), "--check", "--policy", name,
               *(["--option", policy] if option else []),
               "--backend", "aot_eager", "--max-seq-len", "128", "--max-num-batched-tokens", "32",
               "--max-num-seqs", "3", "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    assert (result["requests"], result["token_mismatches"], result["passed"]) == (4, 0, True)
    assert 0 < result["context_steps"] < result["batches"]  # chunked prefill (budget 32) and decodes
    assert result["max_abs_err"] <= 1e-5
    assert result["misses"] == result["compiles"] > 0
    if policy == "always-rows":
        assert result["modes"] == {"rows": result["batches"]}
    if option:  # dynamic's rows option at model level: rows where they pad little, mask elsewhere
        assert result["modes"]["rows"] > 0 and result["modes"].get("mask", 0) > 0


def test_the_generate_reference_sees_every_prompt_token_even_the_pad_id():
    """Served prompts are random ids, the pad token's among them; transformers' generate,
    given no attention mask, would infer one from pad_token_id and hide those tokens:
    the check must give it the whole prompt (this workload reported a mismatch before)."""
    from attnpolicy.bench.replay import RequestReplay, replay
    from attnpolicy.workloads.batching import BatchFormer
    from attnpolicy.workloads.traces import Request

    requests = [Request(0.0, 120, 8), Request(0.0, 90, 8), Request(0.0, 150, 8)]
    pad = parse_spec(TINY["qwen3"]).build().generation_config.pad_token_id
    assert any(pad in torch.randint(0, VOCAB, (r.prompt_tokens,), generator=torch.Generator().manual_seed(i)).tolist()
               for i, r in enumerate(requests))  # the prompts RequestReplay draws, seeded per request
    former = BatchFormer(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=256)
    result = replay(RequestReplay(TINY["qwen3"], requests, list(former.steps(requests)),
                                  config().model_copy(update={"max_seq_len": 256, "max_batch_tokens": 1024}),
                                  check=True))
    assert result.token_mismatches == 0 and result.max_abs_err is not None and result.max_abs_err <= 1e-5


def test_run_model_refuses_a_cost_model_without_step_fits_on_whole_requests(tmp_path, capsys):
    path = CostFile(model=of_model(synthetic(), TINY["qwen3"])).save(tmp_path / "m.json")  # prefill fits only
    assert main(["run", "--model", TINY["qwen3"], "--cost-model", str(path), "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no step-graph fits" in err and "--prefill-only" in err


def test_steps_outside_the_calibrated_rows_context_or_sequences_are_counted(tmp_path, capsys):
    """Whole requests are priced on step graphs: a step with more rows, more cached
    context or more sequences than any calibrated step graph is extrapolated, and
    ``run --model --cost-model`` says how many (one line, and its JSON)."""
    from attnpolicy.modelling.ranges import STEP_RANGE, outside_range
    from attnpolicy.modelling.whole_model_costs import StepFits, StepSample

    measured = {"compile_seconds": 1.0, "run_seconds": 1e-3, "rss_bytes": 1, "estimate_bytes": 1}
    fit = synthetic().compile
    samples = (StepSample(mode="mask", tokens=32, context=64, segments=((32, 64),), **measured),
               StepSample(mode="varlen", tokens=2, context=48, segments=((1, 32), (1, 16)), **measured))
    model = synthetic().model_copy(update={"steps": StepFits(compile=fit, run=fit, rss=fit, samples=samples)})
    assert model.step_range == (32, 64, 2) and synthetic().step_range is None
    layouts = [BatchLayout.from_lens([32], [32]),  # within: 32 rows, no context
               BatchLayout.from_lens([1, 1], [40, 25]),  # within: 63 context, 2 sequences
               BatchLayout.from_lens([33], [33]),  # 33 rows
               BatchLayout.from_lens([1, 1], [40, 27]),  # 65 context
               BatchLayout.from_lens([1, 1, 1], [2, 2, 2])]  # 3 sequences
    outside = outside_range(model, layouts, STEP_RANGE)
    assert outside is not None and (outside.outside, outside.batches) == (3, 5)
    assert outside.line() == ("3 of 5 batches priced outside the calibrated range (sizes up to 33 rows, 65 context "
                              "and 3 sequences, calibrated to 32 rows, 64 context and 2 sequences)")
    assert outside_range(synthetic(), layouts, STEP_RANGE) is None  # no step samples: the range is unknown
    path = CostFile(model=of_model(model, TINY["qwen3"])).save(tmp_path / "m.json")
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0,{p},{g}\n" for i, (p, g) in enumerate([(40, 4), (9, 3), (5, 3)])))
    out = tmp_path / "run.json"
    assert main(["run", "--model", TINY["qwen3"], "--cost-model", str(path), "--trace", str(trace),
                 "--backend", "aot_eager", "--max-seq-len", "128", "--max-num-batched-tokens", "32",
                 "--max-num-seqs", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["outside_calibrated_range"]
    assert 0 < data["outside"] < data["batches"]  # steps of three sequences: outside; the first chunk: within
    line = [x for x in capsys.readouterr().err.splitlines() if "calibrated range" in x]
    assert line == [f"attnpolicy: warning: {data['outside']} of {data['batches']} batches priced outside the "
                    f"calibrated range (sizes up to {data['largest']}, calibrated to {data['calibrated']}): their "
                    "seconds are extrapolated ('attnpolicy calibrate --model SPEC --sizes' covers larger steps)"]


def test_the_docs_step_example_runs(capsys):

    (code,) = [b for b in blocks(ROOT / "docs/models.md", "python") if "KVCache" in b]
    exec(compile(code, "docs/models.md", "exec"), {})
    keys, *lengths = capsys.readouterr().out.rsplit(" ", 2)
    assert keys.startswith("['step/mask/t16c0/aot_eager', 'step/mask/t16c16/aot_eager']")
    assert [int(n) for n in lengths] == [6, 10]
