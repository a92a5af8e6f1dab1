"""The graph store under the dispatcher's cache: a miss loads from disk or compiles
ahead of time and saves; warm restarts load the warm set; every tier is counted."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from reference import reference_for
from strategies import random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, GraphCache
from attnpolicy.core.modes import CallKind
from attnpolicy.dispatch.call_graphs import example_inputs
from attnpolicy.errors import GraphCompileError
from attnpolicy.graphs import backend_setup
from attnpolicy.graphs.aot import aot_compile_graph
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec

SPEC = TensorSpec("float32", 2, 2, 16)
WARM = ({"family": "causal", "q_bucket": 16, "kv_bucket": 16},
        {"family": "causal", "q_bucket": 32, "kv_bucket": 32})
LAYOUTS = (BatchLayout.from_lens([12]), BatchLayout.from_lens([30]), BatchLayout.from_lens([9, 14]))


def _config(store: Path, **fields: object) -> AttnPolicyConfig:
    return AttnPolicyConfig(**{"backend": "aot_eager", "max_seq_len": 64, "store_dir": str(store), **fields})


_qkv = partial(random_qkv, heads=2)  # 2 heads of 16


def _outputs(d: Dispatcher) -> list[torch.Tensor]:
    outs = []
    for layout in LAYOUTS:
        q, k, v = _qkv(layout)
        out = d.attend(q, k, v, layout)
        torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
        outs.append(out)
    return outs


def test_a_second_dispatcher_loads_the_warm_set_and_computes_the_same(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="attnpolicy.dispatch")
    cold = Dispatcher(_config(tmp_path, warmup=WARM))
    keys = cold.warmup(SPEC)
    assert "cold start: 0 loaded from the store, 2 compiled" in caplog.text
    first = _outputs(cold)
    s = cold.stats()
    assert s.cache.compiles == s.cache.misses > 0 and s.cache.loads == 0
    assert s.disk is not None and s.disk.saves == s.cache.compiles == s.disk.entries

    warm = Dispatcher(_config(tmp_path, warmup=WARM))
    assert warm.warmup(SPEC) == keys
    assert all(key in warm.cache for key in keys)  # ready before the first request
    assert warm.stats().cache.loads == len(keys)
    assert "warm start: 2 loaded from the store, 0 compiled" in caplog.text
    second = _outputs(warm)
    s = warm.stats()
    assert s.cache.compiles == 0 and s.cache.loads == s.cache.misses == s.disk.hits
    assert s.disk.saves == 0
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert s.to_json()["disk"]["hits"] == s.cache.loads


def test_an_evicted_graph_reloads_from_disk(tmp_path):
    d = Dispatcher(_config(tmp_path, max_graphs=1))
    a, b = BatchLayout.from_lens([12]), BatchLayout.from_lens([30])
    for layout in (a, b, a):
        q, k, v = _qkv(layout)
        torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout),
                                   atol=1e-5, rtol=1e-5)
    c = d.stats().cache
    assert (c.compiles, c.loads, c.evictions) == (2, 1, 2)
    assert c.per_key[next(k for k in c.per_key if "q16" in k)].loads == 1


def test_what_is_not_stored(tmp_path):
    key = GraphKey(CallKind.MASK, 16, 16, False, SPEC, "flex", None, "aot_eager")
    d = Dispatcher(_config(tmp_path))
    assert not d.source.stored(key)  # flex graphs take a BlockMask: compiled, not stored
    assert d.source.stored(GraphKey(CallKind.MASK, 16, 16, False, SPEC, "sdpa", None, "aot_eager"))
    assert Dispatcher(_config(tmp_path, backend="none")).source.store is not None
    assert not Dispatcher(_config(tmp_path, backend="none")).source.stored(
        GraphKey(CallKind.MASK, 16, 16, False, SPEC, "sdpa", None, "none"))
    custom = Dispatcher(_config(tmp_path), builder=lambda call, key, spec: graph_fn(call, "sdpa", None, None))
    assert custom.source.store is None and custom.stats().disk is None
    assert Dispatcher(AttnPolicyConfig(backend="aot_eager")).stats().disk is None


def test_aot_compile_leaves_the_functions_dynamo_cache_alone():
    """An ahead-of-time compile installs nothing on the code object's Dynamo cache
    (which holds 8 entries): any number of stored graphs of one function compile."""
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    call = Call(CallKind.MASK, 0, 16, 0, 16, 16, 16, True)
    fn = graph_fn(call, "sdpa", None, None)
    graph = aot_compile_graph(fn, "aot_eager", example_inputs(call, SPEC))
    assert entries(fn.__code__) == []
    ins = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in example_inputs(call, SPEC))
    assert torch.equal(graph(*ins), fn(*ins))


def _run(store: Path, config: Path, trace: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "attnpolicy", "run", "--config", str(config), "--trace", str(trace),
           "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--max-seq-len", "64", "--heads", "2",
           "--kv-heads", "2", "--head-dim", "16", "--store", str(store), "--check", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    data: dict = json.loads(out.read_text())
    return data


@pytest.mark.slow
def test_two_runs_against_one_store_the_second_loads(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,20,2\n"
                     "2023-11-16 18:15:46.7805900,30,1\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"backend": "aot_eager", "warmup": WARM}))
    store = tmp_path / "store"
    cold = _run(store, config, trace, tmp_path / "cold.json")
    warm = _run(store, config, trace, tmp_path / "warm.json")
    assert cold["passed"] and warm["passed"]
    assert warm["max_abs_err"] == cold["max_abs_err"]  # the same outputs
    assert cold["cache"]["compiles"] > 0 and cold["warmup_loads"] == 0 and cold["disk"]["saves"] > 0
    assert warm["cache"]["compiles"] == 0 and warm["warmup_loads"] == warm["warmup_graphs"] == len(WARM)
    assert warm["cache"]["loads"] == cold["cache"]["compiles"] == warm["disk"]["hits"]
    assert warm["startup_seconds"] > 0 and cold["startup_seconds"] > 0


MODEL_RUN = """
import json, sys, torch
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.engine.model_specs import parse_spec
from attnpolicy.engine.runner import StaticModelRunner, eager_logits

store, out = sys.argv[1], sys.argv[2]
spec = parse_spec("qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64")
model, reference = spec.build(), spec.build()
config = AttnPolicyConfig(backend="aot_eager", buckets=Buckets(kind="pow2", min=16), max_seq_len=64,
                          max_batch_tokens=128, store_dir=store)
runner = StaticModelRunner(model, config)
logits, err = [], 0.0
for lens, mode in (([12], MaskMode.CAUSAL), ([9, 14], MaskMode.MASK), ([30], MaskMode.CAUSAL),
                   ([9, 14], MaskMode.VARLEN), ([12, 30], MaskMode.VARLEN)):
    layout = BatchLayout.from_lens(lens)
    ids = torch.randint(0, 64, (layout.q_tokens,), generator=torch.Generator().manual_seed(sum(lens)))
    got = runner.run(ids, layout, mode)
    err = max(err, float((got - eager_logits(reference, ids, layout)).abs().max()))
    logits.append(got)
torch.save(logits, out)
s = runner.stats()
print(json.dumps({"compiles": s.cache.compiles, "loads": s.cache.loads, "saves": s.disk.saves,
                  "hits": s.disk.hits, "err": err}))
"""


def _model_run(store: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", MODEL_RUN, str(store), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    data: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return data


@pytest.mark.slow
def test_model_graphs_persist_a_second_process_loads_them(tmp_path):
    store = tmp_path / "store"
    cold = _model_run(store, tmp_path / "cold.pt")
    warm = _model_run(store, tmp_path / "warm.pt")
    # CAUSAL 16 and 32, MASK 32, VARLEN 16+16 and 32+16
    assert (cold["compiles"], cold["loads"], cold["saves"]) == (5, 0, 5)
    assert (warm["compiles"], warm["loads"], warm["hits"], warm["saves"]) == (0, 5, 5, 0)
    assert cold["err"] < 1e-4 and warm["err"] < 1e-4  # against the eager model, per sequence
    for a, b in zip(torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt"), strict=True):
        assert torch.equal(a, b)


def test_only_inductor_on_cpu_has_a_setup_to_start_ahead():
    for backend, device in (("aot_eager", "cpu"), ("eager", "cpu"), ("none", "cpu"), ("inductor", "cuda")):
        setup = backend_setup.start(backend, device)
        assert setup.thread is None, (backend, device)
        setup.join()  # a no-op


PICK = """
import sys
from attnpolicy.graphs import backend_setup
from torch._inductor import cpu_vec_isa
if sys.argv[1] == "ahead":
    setup = backend_setup.start("inductor", "cpu")
    assert setup.thread is not None
    setup.join()
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1  # inductor's own answer, kept
    assert backend_setup.start("inductor", "cpu").thread is None  # probed once per process
print(cpu_vec_isa.pick_vec_isa())
"""


@pytest.mark.inductor
def test_the_vector_isa_probed_ahead_is_the_one_inductor_picks_itself():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    picks = [subprocess.run([sys.executable, "-c", PICK, how], env=env, capture_output=True, text=True,
                            timeout=600, check=True).stdout.strip() for how in ("ahead", "inductor")]
    assert picks[0] == picks[1] != ""


def test_the_cache_counts_a_load_apart_from_a_compile():
    cache: GraphCache[str] = GraphCache(max_graphs=1)
    built: list[str] = []

    def build(key: str):
        return lambda: built.append(key) or f"built {key}"

    assert cache.get_or_compile("a", build("a"), load=lambda: "loaded a") == "loaded a"
    assert cache.get_or_compile("a", build("a"), load=lambda: "loaded again") == "loaded a"  # a hit
    assert cache.get_or_compile("b", build("b"), load=lambda: None) == "built b"  # not on disk: built
    assert built == ["b"]
    with pytest.raises(GraphCompileError, match="OSError"):
        cache.get_or_compile("c", build("c"), load=lambda: (_ for _ in ()).throw(OSError("gone")))
    s = cache.stats()
    assert (s.hits, s.misses, s.loads, s.compiles, s.compile_failures, s.evictions) == (1, 3, 1, 1, 1, 1)
    assert s.misses == s.loads + s.compiles + s.compile_failures + s.refused
    assert (s.per_key["a"].loads, s.per_key["a"].compiles, s.per_key["b"].loads) == (1, 0, 0)
    assert "c" not in cache and cache.get_or_compile("c", build("c")) == "built c"  # free again
