"""The whole-model runner against the eager HF model, and the built-in model specs."""

from __future__ import annotations

import json
import re

import pytest
import torch
from docs_blocks import ROOT, blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layouts

from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode, legal_modes
from attnpolicy.engine.keys import ModelKey
from attnpolicy.engine.kv_cache import KVCache
from attnpolicy.engine.model_specs import ModelSpec, load_model, parse_spec
from attnpolicy.engine.runner import MaskMode as RunnerMode
from attnpolicy.engine.runner import StaticModelRunner, eager_logits
from attnpolicy.errors import ConfigError, IllegalModeError, LayoutError, StrictModeError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.report.plots import TT_XLA

TINY = {"qwen3": "qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64",
        "llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128,vocab=64"}
BUCKETS = Buckets(kind="pow2", min=16)


def config(policy: str = "varlen", **fields) -> AttnPolicyConfig:
    return AttnPolicyConfig(policy=policy, backend="aot_eager", buckets=BUCKETS, max_seq_len=64,
                            max_batch_tokens=128, **fields)


class Counted:
    """Counts backend compiles (the runner's ``compile_counter``)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, gm) -> None:
        self.n += 1


@pytest.fixture(scope="module", params=sorted(TINY))
def models(request):
    """(runner model, reference model): two builds of one spec, so equal weights."""
    spec = parse_spec(TINY[request.param])
    assert isinstance(spec, ModelSpec)
    return spec.build(), spec.build()


@pytest.fixture(scope="module")
def served(models):
    model, reference = models
    counted = Counted()
    return StaticModelRunner(model, config(), compile_counter=counted), reference, counted


def causal_prefill(layout: BatchLayout) -> bool:
    return layout.causal and not layout.has_context


def token_ids(layout: BatchLayout, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (layout.q_tokens,), generator=torch.Generator().manual_seed(seed))


def real(layout: BatchLayout) -> torch.Tensor:
    rows = torch.zeros(layout.q_tokens, dtype=torch.bool)
    for s, n in zip(layout.q_starts, layout.q_lens):
        rows[s:s + n] = True
    return rows


@settings(max_examples=6)
@given(layout=layouts(max_seqs=3, max_len=40, max_context=0, max_pad=8).filter(causal_prefill),
       seed=st.integers(0, 2**16))
def test_every_mode_equals_the_eager_model_per_sequence(served, layout, seed):
    runner, reference, counted = served
    ids = token_ids(layout, seed)
    want = eager_logits(reference, ids, layout)
    for mode in legal_modes(layout):
        got = runner.run(ids, layout, mode)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{mode} on {layout.describe()}")
        assert not got[~real(layout)].any()  # padding rows are zero
    stats = runner.stats().cache
    assert stats.compiles == counted.n == stats.misses


@pytest.mark.parametrize("policy", ["always-mask", "varlen", "dynamic", "always-causal"])
@pytest.mark.parametrize("shape", ["single", "packed", "padded"])
def test_fixed_policies_on_single_packed_and_padded_batches(models, policy, shape):
    model, reference = models
    runner = StaticModelRunner(model, config(policy))
    lens = [21] if shape == "single" else [9, 30, 3]
    layout = BatchLayout.from_lens(lens, padded_to=sum(lens) + 5 if shape == "padded" else None)
    ids = token_ids(layout, 7)
    got = runner.logits(ids, layout)
    torch.testing.assert_close(got, eager_logits(reference, ids, layout), rtol=0, atol=1e-5)
    # packed or padded: the guard falls back to varlen (the config's default) for always-causal
    packed = {"always-mask": "mask", "varlen": "varlen", "dynamic": "mask", "always-causal": "varlen"}
    ran = packed[policy] if shape != "single" else "mask" if policy == "always-mask" else "causal"
    assert runner.stats().modes == {ran: 1}
    assert runner.stats().guard_fallbacks == (1 if policy == "always-causal" and shape != "single" else 0)


def test_keys_buckets_and_segments(models):
    runner = StaticModelRunner(models[0], config())
    layout = BatchLayout.from_lens([5, 40, 17])
    assert runner.keys_for(layout, MaskMode.MASK)[0] == ModelKey(MaskMode.MASK, 64, 0, ((64, 0),), "aot_eager", kv=False)
    # largest bucket first, whatever the order of the sequences
    varlen = runner.keys_for(layout, MaskMode.VARLEN)[0]
    assert varlen.segments == ((64, 0), (32, 0), (16, 0)) and varlen.tokens == 112
    assert runner.keys_for(BatchLayout.from_lens([17, 5, 40]), MaskMode.VARLEN)[0] == varlen
    assert str(varlen) == "model/varlen/t64+32+16/aot_eager"
    single = BatchLayout.from_lens([20])
    assert runner.keys_for(single, MaskMode.CAUSAL)[0] == ModelKey(MaskMode.CAUSAL, 32, 0, ((32, 0),), "aot_eager", kv=False)


def test_one_graph_per_key_and_the_mask_is_an_input(models):
    model, reference = models
    counted = Counted()
    runner = StaticModelRunner(model, config(), compile_counter=counted)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lens in ([3, 9], [10, 2], [1, 1, 1, 1]):  # all 12 rows or fewer: one MASK graph of 16 rows
        layout = BatchLayout.from_lens(lens)
        ids = token_ids(layout, sum(lens))
        torch.testing.assert_close(runner.run(ids, layout, MaskMode.MASK), eager_logits(reference, ids, layout),
                                   rtol=0, atol=1e-5)
    stats = runner.stats()
    assert (stats.cache.compiles, stats.cache.hits, stats.cache.graphs) == (1, 2, 1)
    assert counted.n == 1 == torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    (memory,) = stats.memory
    assert memory.key == "model/mask/t16/aot_eager" and memory.estimate_bytes == stats.cache.bytes > 0
    assert memory.device_bytes is None and memory.compile_seconds > 0


def test_eviction_releases_the_graph_and_a_return_compiles_again(models):
    counted = Counted()
    runner = StaticModelRunner(models[0], config(max_graphs=1), compile_counter=counted)
    a, b = BatchLayout.from_lens([20]), BatchLayout.from_lens([40])
    for layout in (a, b, a):
        runner.run(token_ids(layout, 1), layout, MaskMode.CAUSAL)
    stats = runner.stats().cache
    assert (stats.compiles, stats.evictions, stats.graphs, counted.n) == (3, 2, 1, 3)
    assert len(runner.stats().memory) == 3
    runner.close()
    assert len(runner.cache) == 0


def test_strict_raise_after_warmup(models):
    runner = StaticModelRunner(models[0], config("always-mask", strict="raise"))
    warm = BatchLayout.from_lens([4, 4])
    assert runner.warmup([(warm, MaskMode.MASK)]) == [*runner.keys_for(warm, MaskMode.MASK)]
    hit, miss = BatchLayout.from_lens([8, 2, 3]), BatchLayout.from_lens([20])
    runner.logits(token_ids(hit, 0), hit)  # the same 16-row graph
    with pytest.raises(StrictModeError, match="model/mask/t32"):
        runner.logits(token_ids(miss, 0), miss)
    assert runner.stats().strict_violations == 1


@pytest.mark.parametrize("layout,ids,match", [
    (BatchLayout.from_lens([4], causal=False), torch.zeros(4, dtype=torch.long), "causal=False"),
    (BatchLayout.from_lens([4], [6]), torch.zeros(4, dtype=torch.long), "cached context"),
    (BatchLayout.from_lens([4]), torch.zeros(4), "integer dtype, got torch.float32"),
    (BatchLayout.from_lens([4]), torch.zeros(4, dtype=torch.bool), "integer dtype, got torch.bool"),
    (BatchLayout.from_lens([4]), torch.zeros(4, 1, dtype=torch.long), r"1-D tensor .* \(4, 1\)"),
    (BatchLayout.from_lens([4]), torch.zeros(4, dtype=torch.long, device="meta"), "token_ids are on meta"),
    (BatchLayout.from_lens([4]), torch.zeros(5, dtype=torch.long), "5 rows"),
])
def test_bad_input_is_refused_before_any_work(models, layout, ids, match):
    runner = StaticModelRunner(models[0], config())
    with pytest.raises(LayoutError, match=match):
        runner.logits(ids, layout)
    assert runner.stats().cache.misses == 0 and runner.stats().batches == 0


def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(models):
    warm = StaticModelRunner(models[0], config("always-mask"))
    layout = BatchLayout.from_lens([3, 4], padded_to=9)
    ids = token_ids(layout, 0)
    ids[7:] = 2**50  # garbage in the layout's padding rows is never read: no error
    warm.logits(ids, layout)
    for bad in (64, -1, 2**40):
        ids[5] = bad
        for runner in (warm, StaticModelRunner(models[0], config("always-mask"))):  # graph cached, and not
            before = runner.stats()
            with pytest.raises(LayoutError, match=rf"token_ids outside the vocabulary \[0, 64\): {bad} at row 5$"):
                runner.logits(ids, layout)
            with pytest.raises(LayoutError, match=rf"{bad} at row 5"):
                runner.run(ids, layout, MaskMode.VARLEN)
            after = runner.stats()
            assert (after.batches, after.modes, after.cache.misses, after.cache.hits) == (
                before.batches, before.modes, before.cache.misses, before.cache.hits)


@pytest.mark.parametrize("serve", ["logits", "run", "logits-step"])
def test_a_batch_checks_its_inputs_once(models, monkeypatch, serve):
    """One check (and its one read of the token ids to the host) per batch served."""
    runner = StaticModelRunner(models[0], config("always-mask"))
    checks = []
    check = StaticModelRunner._check
    monkeypatch.setattr(StaticModelRunner, "_check", lambda self, *a: (checks.append(a), check(self, *a))[1])
    layout = BatchLayout.from_lens([3, 4])
    if serve == "logits":
        runner.logits(token_ids(layout, 0), layout)
    elif serve == "run":
        runner.run(token_ids(layout, 0), layout, MaskMode.VARLEN)
    else:
        step = BatchLayout.from_lens([1, 1], [3, 4])
        kv = KVCache.holding(models[0], [2, 3], 8)
        runner.logits(token_ids(step, 0), step, kv=kv, slots=[0, 1])
    assert len(checks) == 1


@pytest.mark.parametrize("form", ["int32", "int16", "uint8", "strided", "expanded"])
def test_token_ids_of_any_integer_form_run_as_int64(served, form):
    """Token ids of another integer dtype, a strided view or an expanded tensor reach the
    compiled graphs as the contiguous int64 ids on the model's device they were compiled
    for: the logits are those of the int64 ids, and the eager model's."""
    runner, reference, _ = served
    layout = BatchLayout.from_lens([5, 3])
    ids = token_ids(layout, 3)
    given = {"int32": ids.int(), "int16": ids.short(), "uint8": ids.to(torch.uint8),
             "strided": torch.stack([ids, torch.full_like(ids, -1)], 1)[:, 0],
             "expanded": ids[:1].expand(layout.q_tokens)}[form]
    plain = given.long().contiguous()
    for mode in legal_modes(layout):
        placed = runner.prepare(given, layout, mode)
        assert all(t.is_contiguous() and t.device == runner.device for t in placed.inputs)
        assert placed.inputs[0].dtype == placed.inputs[1].dtype == torch.long
        got = runner.run(given, layout, mode)
        assert torch.equal(got, runner.run(plain, layout, mode)), mode
        torch.testing.assert_close(got, eager_logits(reference, plain, layout), rtol=0, atol=1e-5)


def test_an_illegal_mode_is_refused(models):
    runner = StaticModelRunner(models[0], config())
    with pytest.raises(IllegalModeError, match="2 sequences packed"):
        runner.run(torch.zeros(4, dtype=torch.long), BatchLayout.from_lens([2, 2]), RunnerMode.CAUSAL)


def test_specs_parse_with_defaults_and_sizes():
    default = parse_spec("qwen3")
    assert isinstance(default, ModelSpec)
    assert (default.layers, default.hidden, default.heads, default.kv_heads, default.dim) == (4, 256, 8, 2, 32)
    small = parse_spec("llama:layers=2,hidden=128,heads=4,kv_heads=2")
    assert isinstance(small, ModelSpec) and (small.arch, small.layers, small.dim) == ("llama", 2, 32)
    assert parse_spec(small.describe()) == small


@pytest.mark.parametrize("spec,match", [
    ("gpt2", "architecture 'gpt2' is not built in"),
    ("qwen3:depth=2", "unknown field 'depth'"),
    ("qwen3:layers=two", "layers must be an integer, got 'two'"),
    ("qwen3:layers=0", "layers .* got 0"),
    ("qwen3:heads=8,kv_heads=3", r"kv_heads \(3\) must divide heads \(8\)"),
    ("qwen3:layers=2,layers=3", "given twice"),
    ("qwen3:layers", "field=value"),
    ("", "model spec must be"),
])
def test_bad_specs_name_the_field_and_value(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_spec(spec)


def test_a_spec_builds_seeded_weights_and_a_directory_loads(tmp_path):
    a, _ = load_model(TINY["llama"])
    b, _ = load_model(TINY["llama"])
    c, _ = load_model(TINY["llama"] + ",seed=1")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    a.save_pretrained(tmp_path)
    loaded, described = load_model(str(tmp_path))
    assert described == str(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), loaded.parameters()))
    with pytest.raises(ConfigError, match="no config.json"):
        parse_spec(str(tmp_path / ".."))


@pytest.mark.inductor
def test_inductor_graphs_equal_the_eager_model(models):
    model, reference = models
    runner = StaticModelRunner(model, config().model_copy(update={"backend": "inductor"}))
    layout = BatchLayout.from_lens([7, 12])
    ids = token_ids(layout, 3)
    for mode in (MaskMode.MASK, MaskMode.VARLEN):
        torch.testing.assert_close(runner.run(ids, layout, mode), eager_logits(reference, ids, layout),
                                   rtol=0, atol=1e-5)


def test_bench_model_reports_every_mode_per_shape_beside_tt_xla(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", TINY["qwen3"], "--lengths", "128", "--seqs", "1,2", "--split", "spread",
                 "--backend", "aot_eager", "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["seq_len"], r["num_seqs"], r["split"], r["mode"]) for r in report["rows"]] == [
        (128, 1, "spread", "causal"), (128, 1, "spread", "mask"), (128, 1, "spread", "rows"),
        (128, 2, "spread", "mask"), (128, 2, "spread", "varlen"), (128, 2, "spread", "rows")]
    for row in report["rows"]:
        assert row["compile_s"] > 0 and row["compiled_ms"] > 0 and row["eager_ms"] > 0
        assert row["estimate_mib"] > 0 and row["device_mib"] is None
    by = {(r["num_seqs"], r["mode"]): r for r in report["rows"]}
    one, two = report["ratios"]
    assert one["compiled"]["mask"] == pytest.approx(by[(1, "mask")]["compiled_ms"] / by[(1, "causal")]["compiled_ms"])
    assert two["compiled"]["rows"] == pytest.approx(by[(2, "rows")]["compiled_ms"] / by[(2, "mask")]["compiled_ms"])
    table = capsys.readouterr().out
    assert "tt-xla mask/causal" in table and f"{TT_XLA[128]:g}" in table
    assert re.search(r"│ 128 │ +2 │ spread +│ rows +│.*× mask", table), table


def test_bench_model_refuses_a_bad_spec(capsys):
    assert main(["bench", "--model", "qwen3:depth=2", "--lengths", "16"]) == 2
    assert "attnpolicy: error: argument --model: model spec 'qwen3:depth=2': unknown field 'depth'" in (
        capsys.readouterr().err)


def test_the_docs_example_runs():
    (code,) = [b for b in blocks(ROOT / "docs/models.md", "python") if "StaticModelRunner(" in b and "KVCache" not in b]
    scope: dict = {}
    exec(compile(code, "docs/models.md", "exec"), scope)
    stats = scope["runner"].stats()
    assert stats.modes == {"mask": 1} and stats.cache.compiles == 1
    assert scope["logits"].shape == (14, 64)


@pytest.mark.parametrize("policy, steps", [
    # (q_lens, served by): a miss runs eagerly while nothing larger is resident, then padded up
    ("always-causal", [([30], "eager"), ([20], "eager"), ([10], "pad"), ([12], "pad"), ([14], "graph"), ([25], "graph"),
                      ([40], "eager"), ([35], "eager"), ([33], "graph")]),
    ("varlen", [([30, 10], "eager"), ([20, 12], "eager"), ([9, 11], "pad"), ([10, 3], "pad"), ([5, 5], "graph"),
                ([40, 3], "eager"), ([33, 2], "eager"), ([50, 1], "graph")]),
    ("always-mask", [([30, 20], "eager"), ([25, 20], "eager"), ([5, 5], "pad"), ([3, 4], "pad"), ([6, 2], "graph"),
                     ([60, 40], "eager"), ([50, 30], "eager"), ([64, 60], "graph")]),
])
def test_background_compiles_pad_up_then_switch_in(models, policy, steps):
    model, reference = models
    counted = Counted()
    runner = StaticModelRunner(model, config(policy, compile_mode="background", switch_after=2),
                               compile_counter=counted)
    served = {"eager": 0, "pad": 0, "graph": 0}
    for step, (lens, by) in enumerate(steps):
        layout = BatchLayout.from_lens(lens)
        ids = token_ids(layout, step)
        before = runner.stats()
        torch.testing.assert_close(runner.logits(ids, layout), eager_logits(reference, ids, layout),
                                   rtol=0, atol=1e-5)
        after = runner.stats()
        assert before.background is not None and after.background is not None
        took = {"eager": after.eager_served - before.eager_served,
                "pad": after.background.pad_up_calls - before.background.pad_up_calls}
        took["graph"] = 1 - took["eager"] - took["pad"]
        assert took[by] == 1, (step, lens, took)
        served[by] += 1
    stats = runner.stats()
    bg = stats.background
    assert bg is not None
    assert (stats.eager_served, bg.pad_up_calls) == (served["eager"], served["pad"])
    assert (bg.requested, bg.switched, bg.failed) == (3, 3, 0)
    assert stats.cache.compiles == counted.n == 3 == len(stats.cache.per_key) == len(stats.memory)
    assert bg.compile_seconds > 0
    runner.close()
    assert len(runner.cache) == 0


def _fill_store(model, store, *lens: int) -> None:
    """Graphs of one sequence of each of ``lens`` (CAUSAL) saved in ``store``."""
    runner = StaticModelRunner(model, config(store_dir=str(store)))
    for n in lens:
        layout = BatchLayout.from_lens([n])
        runner.run(token_ids(layout, n), layout, MaskMode.CAUSAL)
    assert runner.stats().disk.saves == len(lens)
    runner.close()


def test_a_graph_loaded_after_warm_up_is_no_strict_violation(models, tmp_path):
    model, reference = models
    _fill_store(model, tmp_path, 30)  # t32
    runner = StaticModelRunner(model, config("always-causal", strict="raise", store_dir=str(tmp_path)))
    warm = BatchLayout.from_lens([10])
    runner.warmup([(warm, MaskMode.CAUSAL)])  # t16, compiled
    layout = BatchLayout.from_lens([25])
    ids = token_ids(layout, 3)
    with pytest.warns(RuntimeWarning, match="model/causal/t32/aot_eager loaded from the store after warm-up"):
        got = runner.logits(ids, layout)  # t32: loaded, no compile: allowed under strict="raise"
    torch.testing.assert_close(got, eager_logits(reference, ids, layout), rtol=0, atol=1e-5)
    stats = runner.stats()
    assert stats.strict_violations == 0 and stats.loaded_after_warmup == 1
    assert (stats.cache.compiles, stats.cache.loads) == (1, 1)
    with pytest.raises(StrictModeError, match="model/causal/t64"):  # not in the store: a compile
        runner.logits(token_ids(BatchLayout.from_lens([50]), 0), BatchLayout.from_lens([50]))
    assert runner.stats().strict_violations == 1
    runner.close()


def test_background_compiles_load_what_the_store_holds(models, tmp_path):
    model, reference = models
    _fill_store(model, tmp_path, 30, 10)  # t32 and t16
    runner = StaticModelRunner(model, config("always-causal", compile_mode="background", switch_after=1,
                                             store_dir=str(tmp_path)))
    for step, n in enumerate((30, 10, 12)):  # eager while t32 loads; padded up to t32 while t16 loads; t16
        layout = BatchLayout.from_lens([n])
        ids = token_ids(layout, step)
        torch.testing.assert_close(runner.logits(ids, layout), eager_logits(reference, ids, layout),
                                   rtol=0, atol=1e-5)
    stats = runner.stats()
    bg = stats.background
    assert bg is not None and (bg.requested, bg.switched, bg.loaded, bg.pad_up_calls) == (2, 2, 2, 1)
    assert (stats.cache.compiles, stats.cache.loads, stats.disk.hits, stats.disk.saves) == (0, 2, 2, 0)
    runner.close()


def test_a_resident_graph_runs_as_compiled_while_torch_fx_traces(models, monkeypatch):
    """While any thread traces (the background worker compiling beside a batch served
    padded up), torch.fx's tracer has replaced ``torch.nn.Module.__call__`` process-wide
    with a pass-through wrapper: a resident graph called then checks nothing of it and
    compiles nothing again."""
    model, reference = models
    counted = Counted()
    runner = StaticModelRunner(model, config(), compile_counter=counted)
    layout = BatchLayout.from_lens([9, 11])
    ids = token_ids(layout, 0)
    runner.run(ids, layout, MaskMode.VARLEN)
    call = torch.nn.Module.__call__

    def module_call_wrapper(mod, *args, **kwargs):  # as torch.fx.Tracer.trace installs it
        return call(mod, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", module_call_wrapper)
    got = runner.run(ids, layout, MaskMode.VARLEN)
    monkeypatch.undo()
    torch.testing.assert_close(got, eager_logits(reference, ids, layout), rtol=0, atol=1e-5)
    assert counted.n == runner.stats().cache.compiles == 1
