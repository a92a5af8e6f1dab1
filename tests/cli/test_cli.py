"""The command line as a user meets it, through ``attnpolicy.cli.main``: one-line
errors before any work, per-policy options, discoverability, help texts, outputs."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re

import cachetools
import pytest

from attnpolicy import __version__
from attnpolicy.cli import build_parser, main
from attnpolicy.config import AttnPolicyConfig, WarmShape
from attnpolicy.core.modes import Decision, MaskMode
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.ranges import CALL_RANGE, outside_range
from attnpolicy.modelling.simulation import simulation_config
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import load_trace

pytestmark = pytest.mark.usefixtures("fresh_plugins")

CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
SMALL = ["--limit", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]


def one_error_line(capsys, argv):
    """Run ``argv``; assert exit 2 and exactly one stderr line; return that line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("attnpolicy: error: ")
    assert captured.out == ""
    return lines[0]


# -- every mistake: exit 2, one line naming the flag and value, nothing done ------------------


MISTAKES = [
    (["simulate", "--policies", "varln"], ["--policies", "'varln'", "varlen"]),
    (["simulate", "--evictions", "lru,mru"], ["--evictions", "'mru'", "lru"]),
    (["simulate", "--limit", "0"], ["--limit", "'0'"]),
    (["simulate", "--capacities", "2,0"], ["--capacities", "'2,0'"]),
    (["simulate", "--capacities", "two"], ["--capacities", "'two'"]),
    (["simulate", "--option", "varlen:x"], ["--option", "'varlen:x'"]),
    (["simulate", "--option", "nope:x=1"], ["--option", "'nope'"]),
    (["simulate", "--policies", "varlen", "--option", "varlen:x=1"], ["--option", "'varlen'", "'x'"]),
    (["simulate", "--max-num-seqs", "32", "--max-num-batched-tokens", "16"], ["--max-num-batched-tokens", "16"]),
    (["simulate", "--cost-model", "/nonexistent/model.json"], ["--cost-model", "/nonexistent/model.json"]),
    (["simulate", "--trace", "/nonexistent/trace.csv"], ["--trace", "/nonexistent/trace.csv"]),
    (["plan", "--policies", "varln"], ["--policies", "'varln'"]),
    (["plan", "--policies", "cost-aware"], ["--policies", "'cost-aware'", "stateless"]),
    (["plan", "--evictions", "belady"], ["--evictions", "'belady'"]),
    (["plan", "--warmup-seconds", "-1"], ["--warmup-seconds", "'-1'"]),
    (["plan", "--max-graphs", "0"], ["--max-graphs", "'0'"]),
    (["run", "--policy", "varln"], ["--policy", "'varln'"]),
    (["run", "--eviction", "belady"], ["--eviction", "'belady'", "simulation-only"]),
    (["run", "--eviction", "mru"], ["--eviction", "'mru'"]),
    (["run", "--max-graphs", "0"], ["--max-graphs", "'0'"]),
    (["run", "--backend", "tpu"], ["--backend", "'tpu'"]),
    (["run", "--heads", "8", "--kv-heads", "3"], ["--kv-heads", "3", "--heads 8"]),
    (["run", "--limit", "0"], ["--limit", "'0'"]),
    (["run", "--limit", "-1"], ["--limit", "'-1'"]),
    (["run", "--model", ""], ["--model", "got ''"]),
    (["run", "--model", "nope"], ["--model", "'nope'"]),
    (["run", "--model", "qwen3:layers=0"], ["--model", "layers", "got 0"]),
    (["run", "--model", "qwen3:layers=1,head_dim=3"], ["--model", "head_dim (3) must be even"]),
    (["run", "--model", "qwen3:hidden=24,heads=8"], ["--model", "hidden/heads (24/8 = 3) must be even"]),
    (["run", "--model", "qwen3:head_dim=1"], ["--model", "head_dim (1) must be even"]),
    (["run", "--model", "qwen3:max_positions=1024"], ["--max-seq-len", "8192", "1024 positions"]),
    (["run", "--model", "qwen3", "--prefill-only", "--max-num-batched-tokens", "1024"],
     ["--max-num-batched-tokens", "1024", "--max-seq-len=8192", "whole-model graphs"]),
    (["run", "--model", "qwen3", "--heads", "4"], ["--heads", "4", "not taken with --model"]),
    (["run", "--model", "qwen3", "--prefill-only", "--compile-mode", "background"],
     ["--prefill-only", "compile_mode background"]),
    (["run", "--cost-model", "m.json"], ["--cost-model", "m.json", "needs --model"]),
    (["run", "--prefill-only"], ["--prefill-only", "needs --model"]),
    (["run", "--family", "model"], ["--family", "model", "needs --model SPEC"]),
    (["run", "--family", "attention", "--model", "qwen3"], ["--family", "attention", "not taken with --model"]),
    (["calibrate", "--family", "model"], ["--family", "model", "needs --model SPEC"]),
    (["simulate", "--family", "model"], ["--cost-model", "--family model needs a cost-model file"]),
    (["simulate", "--family", "model", "--cost-model", "m.json", "--strict"], ["--strict", "--family model"]),
    (["plan", "--family", "model", "--cost-model", "m.json", "--config", "c.json"], ["--config", "--family model"]),
    (["stalls", "--family", "model", "--cost-model", "m.json", "--warm", "all"], ["--warm", "--family model"]),
    (["simulate", "--model-cost", "m.json"], ["unrecognized arguments: --model-cost"]),
    (["run", "--clock", "wall"], ["--clock", "wall", "needs --model"]),
    (["stalls", "--policies", "varln"], ["--policies", "'varln'"]),
    (["stalls", "--policies", "varln", "--family", "model", "--cost-model", "m.json"], ["--policies", "'varln'"]),
    (["report", "--limit", "0"], ["--limit", "'0'"]),
    (["report", "--policies", "varln"], ["--policies", "'varln'"]),
    (["report", "--evictions", "mru"], ["--evictions", "'mru'"]),
    (["report", "--bench-repeats", "0"], ["--bench-repeats", "'0'"]),
    (["bench", "--seqs", "8", "--lengths", "4"], ["--seqs", "8", "--lengths", "4"]),
    (["bench", "--repeats", "0"], ["--repeats", "'0'"]),
    (["bench", "--split", "even"], ["--split", "'equal' or 'spread'", "even"]),
    (["bench", "--split", "spread,spread"], ["--split", "['spread', 'spread']", "each split once"]),
    (["bench", "--model", "qwen3", "--seqs", "8", "--lengths", "4"], ["--seqs", "8", "--lengths", "4"]),
    (["bench", "--model", "qwen3", "--split", "even"], ["--split", "'equal' or 'spread'", "even"]),
    (["bench", "--kv-heads", "3"], ["--kv-heads", "3"]),
    (["bench", "--dtype", "float64"], ["--dtype", "'float64'"]),
    (["bench", "--model", ""], ["--model", "got ''"]),
    (["bench", "--model", "qwen3:head_dim=3"], ["--model", "head_dim (3) must be even"]),
    (["bench", "--model", "qwen3", "--dtype", "float16"], ["--dtype", "float16", "not taken with --model"]),
    (["bench", "--model", "qwen3", "--overhead"], ["--overhead", "not taken with --model"]),
    (["bench", "--model", "qwen3", "--kernels"], ["--kernels", "not taken with --model"]),
    (["bench", "--family", "model"], ["--family", "model", "needs --model SPEC"]),
    (["bench", "--family", "attention", "--model", "qwen3"], ["--family", "attention", "not taken with --model"]),
    (["calibrate", "--model", ""], ["--model", "got ''"]),
    (["calibrate", "--model", "qwen3:head_dim=5"], ["--model", "head_dim (5) must be even"]),
    (["calibrate", "--clock", "wall"], ["--clock", "wall", "needs --model"]),
    (["report", "--model", ""], ["--model", "got ''"]),
    (["calibrate", "--impl", "flash"], ["--impl", "--partition-len"]),
    (["calibrate", "--max-len", "8"], ["--max-len", "8"]),
    (["decide", "--policy", "nope", "--seq-lens", "8"], ["'nope'"]),
    (["decide", "--policy", "dynamic", "--seq-lens", "0"], ["--seq-lens", "'0'"]),
    (["decide", "--policy", "dynamic", "--seq-lens", "99999999999999999999"],
     ["--seq-lens", "99999999999999999999", "--max-seq-len 8192"]),
    (["decide", "--policy", "dynamic", "--seq-lens", "8", "--kv-lens", "9000", "--max-seq-len", "8999"],
     ["--kv-lens", "9000", "--max-seq-len 8999"]),
    (["config", "validate", "/nonexistent/dir"], ["/nonexistent/dir"]),
    (["config"], ["show", "validate"]),
    (["nope"], ["'nope'"]),
]


@pytest.mark.parametrize(("argv", "named"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_mistakes_exit_2_with_one_line_before_any_work(capsys, tmp_path, argv, named):
    out = tmp_path / "out"
    extra = {"report": ["--out", str(out)], "simulate": ["--json", str(out)], "run": ["--json", str(out)],
             "bench": ["--json", str(out)], "calibrate": ["--out", str(out)], "plan": ["--out", str(out)]}.get(argv[0], [])
    line = one_error_line(capsys, [*argv, *extra])
    for word in named:
        assert word in line, line
    assert not out.exists()  # nothing written, no folder left behind


#: (argv before the path, the flag, whether the path is a folder): every output path, and --store.
UNWRITABLE = [(["simulate", "--json"], False), (["simulate", "--plot"], False), (["stalls", "--json"], False),
              (["plan", "--out"], True), (["run", "--json"], False), (["run", "--store"], True),
              (["report", "--out"], True), (["bench", "--json"], False), (["calibrate", "--out"], False),
              (["calibrate", "--model", "qwen3", "--out"], False), (["bench", "--model", "qwen3", "--json"], False),
              (["run", "--model", "qwen3", "--json"], False),
              (["replan", "--config", "c", "--layouts", "l", "--out"], True)]


@pytest.fixture
def no_work(monkeypatch):
    """What ran: any work at all (a trace read, a cost model loaded) is recorded here."""
    ran: list[str] = []
    monkeypatch.setattr("attnpolicy.workloads.traces.synthetic_default", lambda *a: ran.append("trace") or [])
    monkeypatch.setattr("attnpolicy.graphs.costmodel.CostModel.default", lambda: ran.append("model"))
    monkeypatch.setattr("attnpolicy.engine.model_specs.ModelSpec.build", lambda *a: ran.append("build"))
    return ran


@pytest.mark.parametrize(("argv", "folder"), UNWRITABLE, ids=[" ".join(a) for a, _ in UNWRITABLE])
def test_an_unwritable_output_path_is_one_line_before_any_work(capsys, tmp_path, no_work, argv, folder):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flag = argv[-1]
    line = one_error_line(capsys, [*argv, str(blocker / "sub" / "out.json")])
    assert flag in line and "a-file is not a directory" in line, line
    wrong_kind = blocker if folder else tmp_path  # a file where a folder goes, or the reverse
    line = one_error_line(capsys, [*argv, str(wrong_kind)])
    assert f"{flag}: {wrong_kind} is {'not ' if folder else ''}a directory" in line, line
    assert no_work == []


def test_run_refuses_a_configs_store_dir_that_is_a_file_before_any_work(capsys, tmp_path, no_work):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "c.json").write_text(json.dumps({"store_dir": str(tmp_path / "a-file")}))
    line = one_error_line(capsys, ["run", "--config", str(tmp_path / "c.json")])
    assert f"--config {tmp_path / 'c.json'} (its store_dir): {tmp_path / 'a-file'} is not a directory" in line, line
    assert no_work == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize(("argv", "folder"), UNWRITABLE, ids=[" ".join(a) for a, _ in UNWRITABLE])
def test_a_folder_no_file_can_be_made_in_is_refused_before_any_work_even_for_root(capsys, no_work, argv, folder):
    # the permission bits of /proc let root write; creating a file there fails for anyone
    line = one_error_line(capsys, [*argv, "/proc/attnpolicy-test/out"])
    assert f"{argv[-1]}: cannot write /proc/attnpolicy-test/out: /proc is not writable" in line, line
    assert no_work == []


#: Cheap runs of the commands that write files (flag, path under tmp_path, folder).
WRITERS = [(["simulate", *SMALL, "--policies", "varlen", "--capacities", "4", "--evictions", "lru", "--workers", "1"],
            "--json", "s.json"),
           (["stalls", *SMALL, "--capacities", "4", "--warm", "none"], "--json", "s.json"),
           (["plan", *SMALL, "--policies", "varlen", "--evictions", "lru", "--max-buckets", "2"], "--out", "plan"),
           (["run", *SMALL, "--backend", "none", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"],
            "--json", "r.json"),
           (["bench", "--lengths", "16", "--seqs", "1", "--repeats", "1", "--warmup", "0", "--heads", "2",
             "--kv-heads", "1", "--head-dim", "8"], "--json", "b.json")]


@pytest.mark.parametrize(("argv", "flag", "name"), WRITERS, ids=[a[0] for a, _, _ in WRITERS])
def test_a_write_that_fails_after_the_work_is_one_line_and_exit_1(capsys, tmp_path, monkeypatch, argv, flag, name):
    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("attnpolicy.core.jsonfile.write_text_atomic", full_disk)
    assert main([*argv, flag, str(tmp_path / name)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"attnpolicy: error: argument {flag}: cannot write {tmp_path / name}\S*: "
                        "No space left on device", last), last


def test_run_model_with_the_default_workload_flags_runs_and_checks(capsys, tmp_path):
    """The prefill-only model-graph workload runs each prompt in one step: --max-num-batched-tokens
    defaults, as vLLM's without chunked prefill, to at least --max-seq-len."""
    trace = tmp_path / "t.csv"
    trace.write_text(CSV_HEADER + "".join(f"2023-11-16 18:17:0{i}.0,{20 + 9 * i},3\n" for i in range(3)))
    out = tmp_path / "run.json"
    spec = "qwen3:layers=1,hidden=32,heads=2,kv_heads=1,intermediate=32,vocab=64"
    assert main(["run", "--model", spec, "--prefill-only", "--trace", str(trace), "--limit", "3", "--backend",
                 "eager", "--check", "--json", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    former = result["workload"]["former"]
    assert (former["max_num_batched_tokens"], former["max_model_len"]) == (8192, 8192)
    assert result["config"]["max_batch_tokens"] == 8192 and result["passed"] is True
    assert result["workload"]["admitted"] == 3


def test_no_chunked_prefill_takes_the_default_token_budget_of_vllm(capsys, tmp_path):
    out = tmp_path / "s.json"
    assert main(["simulate", "--limit", "8", "--no-chunked-prefill", "--policies", "varlen", "--capacities", "4",
                 "--evictions", "lru", "--workers", "1", "--json", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["former"]["max_num_batched_tokens"] == 8192
    capsys.readouterr()
    line = one_error_line(capsys, ["simulate", "--no-chunked-prefill", "--max-num-batched-tokens", "4096"])
    assert "--max-num-batched-tokens=4096 must be >= --max-seq-len=8192 with --no-chunked-prefill" in line, line


# -- one workload by default, and no request dropped unsaid ----------------------------------------

#: 12 short requests (more than the report's former used to run at once) and one over max_model_len 8192.
ONE_TOO_LONG = CSV_HEADER + "".join(f"2023-11-16 18:17:{i:02d}.0000000,{20 + i},30\n" for i in range(12)) + (
    "2023-11-16 18:17:30.0000000,9000,3\n")
#: The cheapest report: no calibration, no real-compute validation (always-mask is not validated).
CHEAP_REPORT = ["--no-calibrate", "--policies", "always-mask", "--buckets", "pow2", "--capacities", "inf",
                "--evictions", "lru", "--workers", "1", "--bench-lengths", "64", "--bench-repeats", "1",
                "--kernel-lengths", "64", "--kernel-skip", "flex", "--plan-max-buckets", "2"]
REJECTED = "1 of 13 requests rejected: longer than max_model_len=8192 tokens (prompt + output; the first: 9000 + 3)"


@pytest.fixture(scope="module")
def one_trace(tmp_path_factory):
    """simulate, stalls, plan, report and run with their defaults on one trace: per command
    its stdout, stderr and the folder of its files."""
    out = tmp_path_factory.mktemp("one-trace")
    trace = out / "trace.csv"
    trace.write_text(ONE_TOO_LONG)
    commands = {
        "simulate": ["simulate", "--policies", "varlen", "--capacities", "4", "--evictions", "lru", "--workers", "1",
                     "--json", str(out / "simulate.json")],
        "stalls": ["stalls", "--capacities", "4", "--warm", "none", "--json", str(out / "stalls.json")],
        "plan": ["plan", "--policies", "varlen", "--out", str(out / "plan")],
        "report": ["report", "--out", str(out / "report"), *CHEAP_REPORT],
        "run": ["run", "--backend", "none", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                "--json", str(out / "run.json")],
    }
    printed = {}
    for name, argv in commands.items():
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            assert main([*argv, "--trace", str(trace)]) == 0, stderr.getvalue()
        printed[name] = stdout.getvalue(), stderr.getvalue()
    return trace, out, printed


def test_every_command_forms_one_workload_by_default_and_prints_it_first(one_trace):
    trace, out, printed = one_trace
    batches = len(list(BatchFormer().steps(load_trace(str(trace)))))
    # the commands that price say their cost model first (run measures), then the workload
    assert {name for name, (stdout, _) in printed.items() if stdout.startswith("cost model: built-in (")} == {
        "simulate", "stalls", "plan", "report"}
    firsts = {name: next(line for line in stdout.splitlines() if not line.startswith("cost model: "))
              for name, (stdout, _) in printed.items()}
    assert set(firsts.values()) == {
        f"workload: {trace}: 13 requests (12 admitted, 1 rejected) → {batches} batches; batch former "
        "max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=8192, chunked_prefill=True"}, firsts
    assert json.loads((out / "report" / "report.json").read_text())["workload"]["batches"] == batches
    assert f"→ {batches} batches" in (out / "report" / "report.md").read_text().splitlines()[2]


def test_a_rejected_request_is_warned_once_and_counted_in_every_output(one_trace):
    _, out, printed = one_trace
    for name, (stdout, stderr) in printed.items():
        warnings = [line for line in stderr.splitlines() if "rejected" in line]
        assert warnings == [f"attnpolicy: warning: {REJECTED}: left out of every figure (raise --max-seq-len to "
                            "admit them)"], (name, stderr)
        assert "(12 admitted, 1 rejected)" in stdout, name
    simulate_out = " ".join(printed["simulate"][0].split())
    assert "simulated 12 requests of" in simulate_out and "(1 rejected," in simulate_out
    assert "(1 rejected," in " ".join(printed["stalls"][0].split())
    assert re.search(r"requests \(rejected\)\s+│\s+13 \(1\)", printed["run"][0])
    for path in ("simulate.json", "stalls.json", "run.json", "plan/plan.json", "report/report.json",
                 "report/config/plan.json"):
        data = json.loads((out / path).read_text())
        assert (data["workload"]["rejected"], data["workload"]["why_rejected"]) == (1, REJECTED), path
    assert {r["rejected"] for r in json.loads((out / "simulate.json").read_text())["rows"]} == {1}
    for path in ("plan/plan.json", "report/config/plan.json"):
        plan = json.loads((out / path).read_text())
        assert plan["rejected"] == 1 and {p["row"]["rejected"] for p in plan["policies"]} == {1}, path
    for path in ("plan/plan.md", "report/config/plan.md"):
        assert "(12 admitted, 1 rejected)" in (out / path).read_text() and REJECTED in (out / path).read_text()
    top = "\n".join((out / "report" / "report.md").read_text().splitlines()[:6])
    assert "(12 admitted, 1 rejected)" in top and f"WARNING: {REJECTED}" in top
    assert "(12 admitted, 1 rejected)" in printed["report"][0].splitlines()[1]


def test_a_configs_warm_set_neither_crashes_nor_changes_a_sweep_under_other_buckets(tmp_path, capsys):
    model = CostModel.default()
    shapes = [WarmShape(kind="causal", q_bucket=n, kv_bucket=n, causal=True, context=False) for n in (16, 48)]
    shapes.append(WarmShape(kind="varlen", q_bucket=16, kv_bucket=48, causal=True, context=True))
    warm = simulation_config(model, BatchFormer(), buckets={"kind": "list", "sizes": [16, 48, 8192, 131072]},
                             warmup=shapes)
    warm.save(tmp_path / "warm")
    warm.model_copy(update={"warmup": ()}).save(tmp_path / "cold")
    sweep = ["simulate", *SMALL, "--policies", "varlen", "--buckets", "pow2", "--capacities", "2,inf",
             "--evictions", "lru", "--workers", "1"]
    for name in ("warm", "cold"):
        assert main([*sweep, "--config", str(tmp_path / name), "--json", str(tmp_path / f"{name}.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("warm-up set") == 1
    assert f"the warm-up set of --config {tmp_path / 'warm'} (3 graphs) is not simulated" in err
    rows = {name: json.loads((tmp_path / f"{name}.json").read_text())["rows"] for name in ("warm", "cold")}
    assert rows["warm"] == rows["cold"] and {r["buckets"] for r in rows["warm"]} == {"pow2"}
    # stalls warms the config's set up: a capacity below it is one line naming the flag and the value
    line = one_error_line(capsys, ["stalls", *SMALL, "--config", str(tmp_path / "warm"), "--capacities", "8,2"])
    assert "argument --capacities: capacity 2: warmup has 3 distinct graphs, more than max_graphs=2" in line
    # plan chooses its own warm set: a previous one need not fit the new capacity
    assert main(["plan", *SMALL, "--policies", "varlen", "--config", str(tmp_path / "warm"), "--max-graphs", "2",
                 "--out", str(tmp_path / "plan")]) == 0
    assert len(AttnPolicyConfig.load(tmp_path / "plan").warmup) <= 2


def test_plan_warns_when_its_byte_budget_holds_no_graph(capsys, tmp_path):
    assert main(["plan", *SMALL, "--policies", "varlen", "--max-bytes", "1", "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert "--max-bytes 1: no graph of this plan fits" in err
    assert main(["plan", *SMALL, "--policies", "varlen", "--max-bytes", str(2**40), "--out",
                 str(tmp_path / "q")]) == 0
    assert "no graph of this plan fits" not in capsys.readouterr().err


def test_report_on_an_empty_workload_writes_nothing(capsys, tmp_path):
    trace = tmp_path / "empty.csv"
    trace.write_text(CSV_HEADER)
    line = one_error_line(capsys, ["report", "--trace", str(trace), "--out", str(tmp_path / "r")])
    assert "--trace" in line and "no requests" in line
    assert not (tmp_path / "r").exists()


def test_a_workload_whose_every_request_is_rejected_is_an_error(capsys, tmp_path):
    trace = tmp_path / "long.csv"
    trace.write_text(CSV_HEADER + "2023-11-16 18:17:03.9799600,9000,3\n")
    line = one_error_line(capsys, ["simulate", "--trace", str(trace), "--max-seq-len", "4096"])
    assert "--max-seq-len" in line and "4096" in line and "9003" in line


def test_a_bad_config_file_is_one_line(capsys, tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"max_graphs": 0, "eviction": "lru"}))
    line = one_error_line(capsys, ["simulate", "--config", str(tmp_path / "c.json")])
    assert "max_graphs" in line and "(got 0)" in line


# -- per-policy options ----------------------------------------------------------------------


class Threshold:
    """A plugin policy with options: MASK below ``threshold`` tokens, else VARLEN."""

    name = "threshold-demo"
    description = "MASK below threshold tokens"

    def __init__(self, threshold: int = 512, label: str = "t") -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an int >= 1, got {threshold!r}")
        self.threshold = threshold

    def decide(self, layout, ctx):
        if layout.max_kv_len < self.threshold:
            return Decision(MaskMode.MASK, "short")
        return Decision(MaskMode.VARLEN, "long")


class ThresholdPlugin:
    @hookimpl
    def attnpolicy_register_policies(self, register):
        register(Threshold)


@pytest.fixture
def threshold_plugin():
    get_plugin_manager().register(ThresholdPlugin(), name="threshold-plugin")


def test_sweep_with_a_plugin_policy_and_its_options_next_to_builtins(threshold_plugin, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, "--policies", "varlen,threshold-demo,dynamic", "--capacities", "4",
                 "--evictions", "lru", "--option", "threshold-demo:threshold=100000", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "threshold-demo threshold=100000" in " ".join(stdout.split())
    data = json.loads(out.read_text())
    assert data["policy_options"] == {"varlen": {}, "threshold-demo": {"threshold": 100000}, "dynamic": {}}
    rows = {r["policy"]: r for r in data["rows"]}
    assert rows["threshold-demo"]["policy_options"] == {"threshold": 100000}
    assert rows["varlen"]["policy_options"] == {} and rows["dynamic"]["policy_options"] == {}
    # the option ran: every batch is shorter than 100000 tokens, so every batch ran MASK
    # (with the default threshold of 512 the long ones run VARLEN)
    assert rows["threshold-demo"]["modes"] == {"causal": 0, "mask": rows["threshold-demo"]["batches"], "varlen": 0,
                                               "rows": 0}


def test_a_bad_plugin_option_is_refused_before_the_sweep(threshold_plugin, capsys):
    line = one_error_line(capsys, ["simulate", *SMALL, "--policies", "varlen,threshold-demo",
                                   "--option", "threshold-demo:threshold=0"])
    assert "threshold-demo" in line and "threshold must be an int >= 1, got 0" in line


def test_config_policy_options_apply_only_to_their_policy(threshold_plugin, tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"policy": "threshold-demo", "policy_options": {"threshold": 32},
                                  "backend": "aot_eager"}))
    out = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, "--config", str(config), "--policies", "varlen,threshold-demo",
                 "--capacities", "inf", "--evictions", "lru", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["threshold-demo"]["policy_options"] == {"threshold": 32}
    assert rows["varlen"]["policy_options"] == {}


def test_run_takes_options_of_its_policy(threshold_plugin, tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["run", *SMALL, "--policy", "threshold-demo", "--option", "threshold-demo:threshold=64",
                 "--backend", "none", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["policy_options"] == {"threshold": 64}
    assert "threshold=64" in capsys.readouterr().out
    line = one_error_line(capsys, ["run", "--policy", "varlen", "--option", "threshold-demo:threshold=64"])
    assert "--option" in line and "threshold-demo" in line


# -- discoverability ---------------------------------------------------------------------------


def test_policies_json_lists_options_and_evictions(threshold_plugin, capsys):
    assert main(["policies", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    by = {(e["kind"], e["name"]): e for e in entries}
    assert by["policy", "threshold-demo"]["options"] == {"threshold": 512, "label": "t"}
    assert by["policy", "threshold-demo"]["plugin"] == "threshold-plugin"
    assert by["policy", "dynamic"]["options"] == {"rows": None}
    assert {"lru", "lfu", "fifo", "cost", "belady"} <= {n for k, n in by if k == "eviction"}


@pytest.mark.usefixtures("fresh_plugins")
def test_policies_json_is_strict_json_with_non_json_defaults(capsys):
    class Inf:
        @hookimpl
        def attnpolicy_register_evictions(self, register):
            register("inf-default", lambda maxsize=float("inf"): cachetools.LRUCache(maxsize))

    get_plugin_manager().register(Inf(), name="inf-plugin")
    assert main(["policies", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert {e["name"]: e for e in entries}["inf-default"]["options"] == {"maxsize": "inf"}


def test_policies_table_shows_options_and_evictions(threshold_plugin, capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "threshold=512" in out and 'label="t"' in out
    assert "eviction" in out and "belady" in out and "lfu" in out


def test_version_and_bare_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"attnpolicy {__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("report", "simulate", "run", "bench", "calibrate", "policies", "decide", "config"):
        assert re.search(rf"^\s+{name}\b", out, re.M), name
    assert "attnpolicy simulate --limit 20" in out


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_every_subcommand_and_flag_is_documented():
    commands = dict(_subparsers(build_parser()))
    assert {"report", "simulate", "run", "bench", "calibrate", "policies", "decide", "config",
            "config show", "config validate"} <= set(commands)
    for name, sub in commands.items():
        assert sub.description, name
        assert "example:\n  attnpolicy " in (sub.epilog or ""), name
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = "/".join(action.option_strings) or action.dest
            assert action.help, f"{name} {flag} has no help"
            assert re.search(r"\((default: [^)]+|required)\)$", action.help), f"{name} {flag}: {action.help}"
            assert not re.search(r"\(\d+, |\('|None", action.help), f"{name} {flag}: {action.help}"


def test_a_command_line_naming_a_subcommand_parses_with_that_subcommand_alone():
    commands = {name: sub for name, sub in _subparsers(build_parser()) if " " not in name}
    for name, sub in commands.items():
        alone = dict(_subparsers(build_parser(name)))
        assert alone[name].format_help() == sub.format_help(), name
        assert {n.split()[0] for n in alone} < set(commands) or len(commands) == 1, name
    args = build_parser("decide").parse_args(["decide", "--policy", "varlen", "--seq-lens", "3"])
    assert args.command == "decide"


# -- outputs ----------------------------------------------------------------------------------


def test_bench_says_which_mode_is_faster_per_shape_and_split(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--lengths", "32", "--seqs", "1,2", "--repeats", "1", "--warmup", "0",
                 "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert len(re.findall(r"(causal|mask|varlen|rows) \d+\.\d\d× faster", text)) == 3
    assert "1 thread(s)" in text
    for split in ("equal", "spread"):
        assert [m for m in ("mask", "varlen", "rows") if re.search(rf"│ +32 │ +2 │ {split} +│ {m} +│", text)] == [
            "mask", "varlen", "rows"], text
    speedups = json.loads(out.read_text())["speedups"]
    assert [(sp["num_seqs"], sp["split"]) for sp in speedups] == [(1, "equal"), (2, "equal"), (2, "spread")]
    assert main(["bench", "--lengths", "32", "--seqs", "2", "--split", "equal", "--repeats", "1", "--warmup", "0",
                 "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]) == 0
    assert "spread" not in capsys.readouterr().out


def test_run_check_prints_pass_against_its_tolerance(capsys):
    assert main(["run", *SMALL, "--policy", "varlen", "--backend", "none", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "8", "--check"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"check\s+│\s+pass \(tolerance 0\.0001\)", out), out
    assert "peak graph MiB" in out


def test_simulate_counts_the_batches_priced_outside_the_calibrated_range(tmp_path, capsys):
    model = CostModel.default()
    short = model.model_copy(update={"samples": tuple(s for s in model.samples if s.cols <= 2048)})
    path = short.save(tmp_path / "short.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", "--limit", "5", "--policies", "varlen", "--capacities", "inf", "--evictions", "lru",
                 "--cost-model", str(path), "--json", str(out)]) == 0
    err = capsys.readouterr().err
    steps = list(BatchFormer().steps(load_trace("default", 5)))
    sizes = [max(s.layout.total_tokens, s.layout.max_kv_len) for s in steps]
    outside = sum(n > 2048 for n in sizes)
    assert 0 < outside < len(steps)
    line = (f"{outside} of {len(steps)} batches priced outside the calibrated range (sizes up to {max(sizes)} "
            "tokens, calibrated to 2048 tokens)")
    assert [x for x in err.splitlines() if "calibrated range" in x] == [
        f"attnpolicy: warning: {line}: their seconds are extrapolated ('attnpolicy calibrate --max-len N' covers "
        "longer batches)"]
    assert json.loads(out.read_text())["outside_calibrated_range"] == {
        "outside": outside, "batches": len(steps), "largest": f"{max(sizes)} tokens", "calibrated": "2048 tokens"}
    assert outside_range(short, steps, CALL_RANGE).line() == line
    assert outside_range(model.model_copy(update={"samples": ()}), steps, CALL_RANGE) is None  # range unknown
    assert outside_range(model, [s for s in steps if max(s.layout.total_tokens, s.layout.max_kv_len) <= 4096],
                         CALL_RANGE).outside == 0


def test_plot_of_capacities_that_tie(tmp_path, capsys):
    # 3 requests never need 32 graphs: capacity 32 and unbounded give the same row
    png = tmp_path / "sweep.png"
    assert main(["simulate", "--limit", "3", "--policies", "varlen", "--capacities", "32,inf",
                 "--evictions", "lru", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_table_explains_its_units(capsys):
    assert main(["simulate", *SMALL, "--policies", "varlen", "--capacities", "2,inf", "--evictions", "lru"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "peak MiB" in out and "batches c/m/v" in out and "batches run causal / mask / varlen" in out


def test_a_guard_fallback_is_reported_once(capsys):
    assert main(["decide", "--policy", "always-causal", "--seq-lens", "3,4"]) == 0
    captured = capsys.readouterr()
    assert "[guard fell back]" in captured.out and captured.err == ""
