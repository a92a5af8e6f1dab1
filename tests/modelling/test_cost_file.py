"""The cost-model file: one strict validation, before any work, for every command that
reads one; whatever a command writes is strict JSON.

The fuzz is a table: each mutation of a valid file (a section or fit missing, a value
of another type, huge, tiny, NaN or infinite, another model's) breaks one part of the
file, and every command that reads that part refuses it in one line naming the field,
before any work (nothing printed, nothing written); the valid extremes (coefficients
at their bound, run fits at their floor) run every command, whose every output file is
strict JSON."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cost_models import of_model, with_rows, with_steps

from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.dispatch import Dispatcher
from attnpolicy.graphs.costmodel import MAX_COEFFICIENT, MIN_RUN_SECONDS, CostModel
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.layout_stream import LayoutStreamWriter
from attnpolicy.workloads.traces import load_trace

pytestmark = pytest.mark.usefixtures("fresh_plugins")

TINY = "qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64"
LIMITS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-seq-len", "256"]
MODES = ("causal", "mask", "varlen", "rows")


def strict_json(text: str) -> Any:
    """``text`` parsed as strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` are errors."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Any]:
    """A valid file's JSON (the built-in attention fits, a tiny model's whole-model fits),
    a short trace, a layout stream recorded on the attention fits' tensor spec and the
    config it was recorded under."""
    tmp = tmp_path_factory.mktemp("cost_file")
    trace = tmp / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0,{p},{g}\n" for i, (p, g) in enumerate([(40, 4), (9, 3), (60, 3), (25, 2)])))
    config = AttnPolicyConfig(policy="varlen", max_graphs=4, backend="none", max_seq_len=256, max_batch_tokens=1024)
    spec = CostModel.default().spec
    layouts = tmp / "layouts.jsonl"
    writer, dispatcher = LayoutStreamWriter(layouts, config, spec), Dispatcher(config)
    for step in BatchFormer(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256).steps(
            load_trace(str(trace), None)):
        decision = dispatcher.prepare(step.layout, spec).decision
        writer.write_step(step.layout, decision.mode, dispatcher.context_for(spec).keys_for(step.layout, decision.mode),
                          dispatcher.cache.stats().to_json())
    writer.close()
    config.save(tmp / "config")
    data = CostFile(CostModel.default(), of_model(with_rows(with_steps(compile_base=0.05)), TINY)).to_json()
    return {"data": data, "trace": str(trace), "layouts": str(layouts), "config": str(tmp / "config")}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation setting (``value``) or deleting (``DELETE``) the field at a dotted path."""
    def mutate(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        here: Any = data
        for part in parents:
            here = here[int(part)] if isinstance(here, list) else here[part]
        if value is DELETE:
            del here[last]
        else:
            here[last] = value
    return mutate


DELETE = object()


def _each(paths: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        for path in paths:
            _set(path, value)(data)
    return mutate


def _at_the_floor(data: dict[str, Any]) -> None:
    """Every run fit predicting :data:`MIN_RUN_SECONDS` for every call."""
    _each([*_fits("model.steps.run", MODEL_TERMS), *_fits("model.run", MODEL_TERMS), *_fits("run", ATTENTION_TERMS)],
          0.0)(data)
    _each([f"{fits}.{mode}.base" for fits in ("model.steps.run", "model.run", "run") for mode in MODES],
          MIN_RUN_SECONDS)(data)


def _only_model(data: dict[str, Any]) -> None:
    for key in [k for k in data if k not in ("version", "model")]:
        del data[key]


def _fits(prefix: str, terms: tuple[str, ...]) -> list[str]:
    return [f"{prefix}.{mode}.{term}" for mode in MODES for term in terms]


MODEL_TERMS = ("base", "per_token", "per_context", "per_cell", "per_segment")
ATTENTION_TERMS = ("base", "per_cell", "per_token")

#: (id, mutation, the part of the file it breaks, what the error says). The parts:
#: ``attention`` and ``model`` (the sections), ``steps`` (the step-graph fits whole
#: requests run on), ``model spec`` (the model calibrated: --model SPEC is compared),
#: ``tensor spec`` (the attention fits' tensors: a recorded stream's are compared);
#: ``None``: a valid file.
MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], str | None, str]] = [
    ("no steps.run.mask", _set("model.steps.run.mask", DELETE), "model", "steps.run: needs a fit of every mode"),
    ("no run.varlen", _set("model.run.varlen", DELETE), "model", "run: needs a fit of every mode"),
    ("no attention run.mask", _set("run.mask", DELETE), "attention", "run needs a fit for every call kind"),
    ("no dims", _set("model.dims", DELETE), "model", "dims: Field required"),
    ("no model section", _set("model", DELETE), "model", "holds no whole-model fits"),
    ("no attention section", _only_model, "attention", "holds no attention fits"),
    ("no steps", _set("model.steps", DELETE), "steps", "holds no step-graph fits"),
    ("no steps.run.rows", _set("model.steps.run.rows", DELETE), "rows steps", "holds no step-graph fits of mode=rows"),
    ("base true", _set("model.steps.run.mask.base", True), "model", "steps.run.mask.base: Input should be a valid number"),
    ("base '0.1'", _set("model.steps.run.mask.base", "0.1"), "model", "steps.run.mask.base: Input should be a valid number"),
    ("heads '8'", _set("heads", "8"), "attention", "heads: Input should be a valid integer"),
    ("hidden 64.5", _set("model.dims.hidden", 64.5), "model", "dims.hidden: Input should be a valid integer"),
    ("version true", _set("model.version", True), "model", "unsupported model cost model version True"),
    ("fits a list", _set("model.compile", []), "model", "compile: Input should be an object"),
    ("huge base", _set("model.steps.run.mask.base", 1e308), "model", "steps.run.mask.base: must be at most 1e+12"),
    ("huge per_token", _set("model.steps.run.mask.per_token", 1e300), "model", "steps.run.mask.per_token"),
    ("huge per_cell", _set("run.mask.per_cell", 1e300), "attention", "run.mask.per_cell: must be at most"),
    ("huge warm-up", _set("model.warmup_seconds", 1e300), "model", "warmup_seconds: must be at most"),
    ("huge vocab", _set("model.dims.vocab", 10**300), "model", "dims.vocab: Input should be less than or equal to"),
    ("huge heads", _each(["heads", "kv_heads"], 10**30), "attention", "heads: Input should be less than or equal to"),
    ("huge sample", _set("samples.0.seconds", 1e300), "attention", "samples.0.seconds: must be at most"),
    ("zero runs", _each(_fits("model.steps.run", MODEL_TERMS), 0.0), "model", "causal predicts 0 s"),
    ("tiny runs", _each(_fits("run", ATTENTION_TERMS), 5e-324), "attention", "run.causal predicts"),
    ("negative", _set("model.run.causal.base", -1.0), "model", "run.causal.base: Input should be greater than"),
    ("NaN", _set("model.steps.compile.mask.per_token", float("nan")), "model", "per_token: Input should be a finite"),
    ("Infinity", _set("call_overhead_seconds", float("inf")), "attention", "call_overhead_seconds: Input should be"),
    ("-Infinity", _set("model.rss.mask.base", float("-inf")), "model", "rss.mask.base: Input should be"),
    ("another model", _each(["model.dims.hidden", "model.dims.intermediate"], 256), "model spec",
     "prices another model: calibrated on qwen3:layers=1"),
    ("another tensor spec", _each(["heads", "kv_heads"], 4), "tensor spec",
     "prices another tensor spec than run"),
    ("at the bound", _each(["model.steps.run.mask.per_cell", "model.steps.compile.mask.base", "model.warmup_seconds",
                            "run.mask.per_cell", "compile.mask.base", "warmup_seconds"], MAX_COEFFICIENT), None, ""),
    ("at the floor", _at_the_floor, None, ""),
]

#: (id, argv before the file and the outputs, the parts of the file it reads, whether a run is
#: too slow to make for every valid file). ``{trace}``, ``{layouts}``, ``{config}`` and ``{out}`` are filled in.
ATTENTION_SWEEP = ["--policies", "varlen", "--capacities", "4"]
COMMANDS: list[tuple[str, list[str], set[str], bool]] = [
    ("simulate", ["simulate", *ATTENTION_SWEEP, "--evictions", "lru", "--json", "{out}/s.json", "--cost-model"],
     {"attention"}, False),
    ("stalls", ["stalls", *ATTENTION_SWEEP, "--warm", "none", "--json", "{out}/s.json", "--cost-model"],
     {"attention"}, False),
    ("plan", ["plan", "--policies", "varlen", "--evictions", "lru", "--out", "{out}", "--cost-model"],
     {"attention"}, False),
    ("simulate --layouts", ["simulate", "--layouts", "{layouts}", *ATTENTION_SWEEP, "--evictions", "lru", "--json",
                            "{out}/s.json", "--cost-model"], {"attention", "tensor spec"}, False),
    ("plan --layouts", ["plan", "--layouts", "{layouts}", "--policies", "varlen", "--evictions", "lru", "--out",
                        "{out}", "--cost-model"], {"attention", "tensor spec"}, False),
    ("replan", ["replan", "--config", "{config}", "--layouts", "{layouts}", "--out", "{out}", "--cost-model"],
     {"attention", "tensor spec"}, False),
    ("report", ["report", "--out", "{out}", "--no-calibrate", "--cost-model"], {"attention"}, True),
    ("simulate --family model", ["simulate", "--family", "model", *ATTENTION_SWEEP, "--json", "{out}/s.json",
                                 "--cost-model"], {"model"}, False),
    ("stalls --family model", ["stalls", "--family", "model", *ATTENTION_SWEEP, "--json", "{out}/s.json",
                               "--cost-model"], {"model"}, False),
    ("plan --family model", ["plan", "--family", "model", "--out", "{out}", "--cost-model"], {"model"}, False),
    ("plan --whole-requests", ["plan", "--family", "model", "--whole-requests", "--out", "{out}", "--cost-model"],
     {"model", "steps", "rows steps"}, False),
    ("run --model", ["run", "--model", TINY, "--backend", "none", "--json", "{out}/r.json", "--cost-model"],
     {"model", "steps", "model spec"}, True),
    ("report --model-cost", ["report", "--out", "{out}", "--no-calibrate", "--model-cost"],
     {"model", "steps", "rows steps", "model spec"}, True),
]


def _cases() -> list[Any]:
    cases = []
    for mutation in MUTATIONS:
        for command in COMMANDS:
            breaks, reads, slow = mutation[2], command[2], command[3]
            refused = breaks in reads
            if refused or (breaks is None and (not slow or (command[0] == "run --model"
                                                            and mutation[0] == "at the bound"))):
                cases.append(pytest.param(mutation, command, refused, id=f"{mutation[0]}-{command[0]}"))
    return cases


@pytest.mark.parametrize(("mutation", "command", "refused"), _cases())
def test_every_command_refuses_a_bad_cost_model_in_one_line_or_writes_strict_json(
        files, tmp_path, capsys, mutation, command, refused):
    _, mutate, _, says = mutation
    data = copy.deepcopy(files["data"])
    mutate(data)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    out = tmp_path / "out"
    argv = [a.format(out=out, **files) for a in command[1]]
    workload = [] if argv[0] == "replan" else ["--trace", files["trace"], *LIMITS]
    status = main([*argv, str(path), *workload])
    captured = capsys.readouterr()
    if refused:
        lines = captured.err.strip().splitlines()
        flag = "--model-cost" if "--model-cost" in argv else "--cost-model"
        assert status == 2 and len(lines) == 1, captured.err
        assert lines[0].startswith(f"attnpolicy: error: argument {flag}: ") and says in lines[0], lines[0]
        assert captured.out == "" and not out.exists()  # before any work
    else:
        assert status == 0, captured.err
        written = [p for p in out.rglob("*") if p.suffix in (".json", ".jsonl")] if out.is_dir() else []
        assert written, "the command wrote no JSON"
        for file in written:
            strict_json(file.read_text())


def test_the_table_covers_every_mutation_and_command():
    """Each mutation that breaks the file is refused by some command, and each command
    refuses some mutation (the table is not vacuous)."""
    cases = [c.values for c in _cases()]
    assert {m[0] for m in MUTATIONS if m[2] is not None} == {m[0] for m, _, refused in cases if refused}
    assert {c[0] for c in COMMANDS} == {c[0] for _, c, refused in cases if refused}


def test_the_error_of_a_missing_phase_names_the_flag(files, tmp_path, capsys):
    """A model cost model without step fits is refused by plan --whole-requests before
    any work, with its flag, as every other problem of the file."""
    data = copy.deepcopy(files["data"])
    del data["model"]["steps"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--family", "model", "--whole-requests", "--cost-model", str(path), "--out",
                 str(tmp_path / "p"), "--trace", files["trace"], *LIMITS]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("attnpolicy: error: argument --cost-model: the cost model of")
    assert captured.out == ""


def test_run_model_refuses_a_cost_model_of_another_model_naming_both(files, tmp_path, capsys):
    path = CostFile(model=of_model(with_steps(), TINY)).save(tmp_path / "m.json")
    other = "llama:layers=1,hidden=32,heads=2,kv_heads=1,intermediate=128,vocab=64"
    assert main(["run", "--model", other, "--cost-model", str(path), "--trace", files["trace"], *LIMITS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (f"prices another model: calibrated on {TINY} (model_type qwen3, hidden 64, head_dim 32), not on "
            f"--model {other} (model_type llama, hidden 32, head_dim 16)") in err


def test_a_stream_of_another_tensor_spec_is_said_on_the_default_model(files, tmp_path, capsys):
    """Without --cost-model the command prices with this machine's calibration or the
    built-in model: another tensor spec than the stream's is one warning naming both
    (the recorded counts still replay), not an error."""
    stream = Path(files["layouts"]).read_text().replace('"heads":8,"kv_heads":8,"head_dim":64',
                                                        '"heads":4,"kv_heads":1,"head_dim":8')
    stream = stream.replace("/h8kv8d64/", "/h4kv1d8/").replace('"dtype":"float32"', '"dtype":"float16"')
    stream = stream.replace("/float32/", "/float16/")
    layouts = tmp_path / "layouts.jsonl"
    layouts.write_text(stream)
    assert main(["simulate", "--layouts", str(layouts), *ATTENTION_SWEEP, "--evictions", "lru"]) == 0
    [warned] = [x for x in capsys.readouterr().err.splitlines() if "another tensor spec" in x]
    assert warned.startswith("attnpolicy: warning: the cost model prices another tensor spec than run ")
    assert warned.endswith("of the layout stream: calibrated on float32 h8/kv8/d64, not float16 h4/kv1/d8; its "
                           "seconds are not this run's (attnpolicy calibrate --dtype float16 --heads 4 --kv-heads 1 "
                           "--head-dim 8 --out FILE calibrates one, and give it to --cost-model)")
