"""``attnpolicy run --model`` on a tiny one-layer model: its check, its KV cache, its
counts under background compiles and with a graph store."""

from __future__ import annotations

import json

import pytest

from attnpolicy.cli import main

SPEC = "qwen3:layers=1,hidden=32,heads=2,kv_heads=1,intermediate=32,vocab=64"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _trace(tmp_path, prompts, output=3):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "".join(f"2023-11-16 18:17:{i:02d}.0,{n},{output}\n" for i, n in enumerate(prompts)))
    return str(path)


def _strict(path):
    return json.loads(path.read_text(), parse_constant=pytest.fail)


@pytest.mark.parametrize("prefill_only", [False, True], ids=["whole-requests", "prefill-only"])
def test_the_check_fails_on_logits_that_hold_nan(tmp_path, capsys, monkeypatch, prefill_only):
    """Attention that returns NaN in the first row of each prefill (one layer: only that
    row's logits; the greedy tokens come from the last row and agree): the check fails,
    naming the non-finite values, and the JSON stays strict."""
    from plugin_kernels import nan_row_0

    from attnpolicy.kernels import attention

    monkeypatch.setitem(attention._IMPL_FNS, "sdpa", nan_row_0)  # the kernel every model graph binds
    out = tmp_path / "run.json"
    argv = ["run", "--model", SPEC, "--trace", _trace(tmp_path, [20, 29, 38]), "--backend", "none",
            "--max-seq-len", "128", "--check", "--json", str(out)]
    assert main(argv + ["--prefill-only"] * prefill_only) == 1
    err = capsys.readouterr().err
    assert "the check failed: " in err and "non-finite values in the outputs or their reference" in err
    data = _strict(out)
    assert data["passed"] is False and data["non_finite"] > 0
    assert data.get("token_mismatches") in (0, None)  # the tokens alone would pass


def test_the_kv_cache_holds_what_runs_not_the_formers_bounds(tmp_path, capsys):
    """256 sequences × 10⁸ tokens would be terabytes: two short requests run in a cache of
    their own size. One request too long for any machine is refused before the first
    step, in one line naming the flags and the bytes."""
    spec = SPEC + ",max_positions=2000000000000000"
    out = tmp_path / "run.json"
    assert main(["run", "--model", spec, "--trace", _trace(tmp_path, [20, 29], output=2), "--backend", "none",
                 "--max-seq-len", "100000000", "--max-num-seqs", "256", "--json", str(out)]) == 0
    assert _strict(out)["requests"] == 2
    capsys.readouterr()
    huge = 10**15  # tokens: 1.28e17 bytes of keys and values, past any address space
    assert main(["run", "--model", spec, "--trace", _trace(tmp_path, [huge], output=2), "--backend", "none",
                 "--max-seq-len", str(2 * huge), "--no-chunked-prefill", "--json", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("attnpolicy: error: argument --max-num-seqs/--max-seq-len: a KV cache of 1 slots x "
                                f"{huge + 1} tokens"), lines
    assert f"needs {2 * (huge + 1) * 16 * 4} bytes" in lines[-1] and "Traceback" not in "\n".join(lines)


def test_a_slot_plan_reuses_a_finished_requests_slot():
    """Requests served one at a time share one slot; each holds its prompt and the tokens
    fed back (output − 1: the last one is never fed)."""
    from attnpolicy.bench.replay import SlotPlan
    from attnpolicy.workloads.batching import BatchFormer
    from attnpolicy.workloads.traces import Request

    requests = [Request(0.0, 20, 13), Request(0.0, 9, 5), Request(0.1, 30, 1)]  # hold 32, 13, 30
    one = SlotPlan.of(requests, list(BatchFormer(max_num_seqs=1, max_model_len=64).steps(requests)))
    assert (one.count, one.longest) == (1, 32) and set(one.slots) == {(0,)}
    together = SlotPlan.of(requests, list(BatchFormer(max_num_seqs=3, max_model_len=64).steps(requests)))
    assert together.count == 3 and together.longest == 32
    assert sum(len(f) for f in together.freed) == 3  # every request done, its slot freed once


def test_background_compiles_count_one_hit_or_miss_per_batch_with_their_figures(tmp_path, capsys):
    """Under background compiles hits + misses are the batches, as in a synchronous run,
    every miss padded up (the second prompt on the first's graph, its decode on the first
    decode's) or run eagerly; the table and the JSON carry the background figures."""
    trace = _trace(tmp_path, [47, 20], output=2)
    runs = {}
    for mode in ("sync", "background"):
        out = tmp_path / f"{mode}.json"
        assert main(["run", "--model", SPEC, "--trace", trace, "--backend", "none", "--policy", "always-mask",
                     "--max-seq-len", "64", "--max-num-seqs", "1", "--compile-mode", mode, "--switch-after", "1",
                     "--json", str(out)]) == 0
        runs[mode] = _strict(out)
    for data in runs.values():
        assert data["hits"] + data["misses"] == data["batches"] == 4
    bg = runs["background"]["background"]
    assert runs["sync"]["background"] is None
    assert (bg["pad_up_calls"], bg["eager_batches"]) == (2, 2) and runs["background"]["misses"] == 4
    assert (bg["requested"], bg["switched"], bg["pending"]) == (4, 3, 1)  # the last decode's: after the last batch
    table = capsys.readouterr().out.split("attnpolicy run --model")[-1]
    assert "eager batches" in table and "4 requested, 3 switched, 1 pending" in table


def test_a_second_run_on_a_store_loads_and_says_so(tmp_path, capsys):
    """The second run loads every graph: no compile, its seconds under load s, and loads
    and the store's figures in the table and the JSON, as at the attention level."""
    argv = ["run", "--model", SPEC, "--trace", _trace(tmp_path, [20, 29], output=2), "--backend", "eager",
            "--policy", "always-mask", "--max-seq-len", "64", "--store", str(tmp_path / "store"), "--json"]
    assert main([*argv, str(tmp_path / "1.json")]) == 0
    assert main([*argv, str(tmp_path / "2.json")]) == 0
    first, second = _strict(tmp_path / "1.json"), _strict(tmp_path / "2.json")
    assert first["compiles"] == second["loads"] > 0 and first["loads"] == second["compiles"] == 0
    assert second["compile_seconds"] == 0 and second["load_seconds"] > 0
    assert second["disk"]["hits"] == second["loads"] and first["disk"]["saves"] == first["compiles"]
    table = capsys.readouterr().out.split("attnpolicy run --model")[-1]
    assert "load s (cpu)" in table and "store loads / saves / evictions" in table


#: the workload flags of the refusals below: the limits a plan's graph sets are checked against
LIMITS = ["--max-seq-len", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "2"]


@pytest.fixture
def plan(tmp_path):
    """A plan directory whose graph_sets.json holds one gaudi set at :data:`LIMITS`' limits."""
    from attnpolicy.modelling.peer_buckets import PeerGraph, PeerLimits, PeerWarmSet
    from attnpolicy.modelling.runtime_sets import GRAPH_SETS_FILE, GraphSetsFile

    warm = PeerWarmSet.of("plan", [PeerGraph("decode", 2, 1, 1), PeerGraph("prefill", 1, 32, 0)])
    saved = GraphSetsFile.of(PeerLimits(2, 32, 64), {"plan (gaudi form)": ("gaudi", warm)})
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / GRAPH_SETS_FILE).write_text(saved.model_dump_json())
    return folder


REFUSED = [
    (["--graph-set", "tpu"], ["--graph-set", "graph set 'tpu' does not run here", "ragged"]),
    (["--graph-set", "vllm"], ["--graph-set", "graph set 'vllm' does not run here", "ragged"]),
    (["--graph-set", "nosuch"], ["--graph-set", "'nosuch'", "gaudi-exponential", "plan's graph_sets.json"]),
    (["--graph-set", "rbln", "--policy", "varlen"], ["--policy", "not taken with --graph-set/--plan"]),
    (["--graph-set", "rbln", "--prefill-only", "--max-num-batched-tokens", "64"],  # a budget a prompt fits
     ["--prefill-only", "not taken with --graph-set/--plan"]),
    (["--plan", "PLAN", "--max-seq-len", "128"], ["--plan", "was planned for", "'max_model_len': 64",
                                                  "'max_model_len': 128", "--max-seq-len"]),
    (["--plan", "PLAN", "--graph-set", "no such label"], ["--plan", "no graph set 'no such label'",
                                                          "'plan (gaudi form)'"]),
    # a plan that cannot be read is --plan's, whichever set --graph-set names
    (["--plan", "PLAN/missing", "--graph-set", "rbln"], ["--plan", "missing"]),
]


@pytest.mark.parametrize(("argv", "named"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_graph_set_run_is_refused_in_one_line_naming_the_flag_before_any_work(tmp_path, capsys, monkeypatch,
                                                                                  plan, argv, named):
    work: list[str] = []
    monkeypatch.setattr("attnpolicy.cli.run.workload", lambda *a: work.append("trace"))
    monkeypatch.setattr("attnpolicy.engine.model_specs.ModelSpec.build", lambda *a: work.append("build"))
    out = tmp_path / "run.json"
    argv = [a.replace("PLAN", str(plan)) for a in argv]
    assert main(["run", "--model", SPEC, "--trace", _trace(tmp_path, [20]), *LIMITS, *argv, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnpolicy: error: argument {named[0]}: "), captured.err
    for word in named[1:]:
        assert word in lines[0], lines[0]
    assert work == [] and not out.exists() and captured.out == ""


@pytest.mark.parametrize("flag", ["--graph-set", "--plan"])
def test_a_graph_set_without_model_is_refused_not_ignored(tmp_path, capsys, plan, flag):
    """Without --model the run replays attention calls, which no graph set serves."""
    value = "rbln" if flag == "--graph-set" else str(plan)
    assert main(["run", "--trace", _trace(tmp_path, [20]), flag, value]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"attnpolicy: error: argument {flag}: {value}: needs --model SPEC (without it the run replays "
                     "attention calls)"]
