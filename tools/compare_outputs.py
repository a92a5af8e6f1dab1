"""Record and compare the outputs of ``simulate --json``, ``stalls --json``, ``plan`` and
``run --check --json``, at the attention-call and the whole-model level.

A refactor that keeps behaviour leaves these outputs identical. ``record`` runs the
commands with a given checkout on ``PYTHONPATH`` and writes their outputs to a folder;
``compare`` says which outputs of two folders differ (timing-only fields are dropped first)::

    python tools/compare_outputs.py record /path/to/base-checkout /tmp/out-base --model-cost m.json --run
    python tools/compare_outputs.py record . /tmp/out-head --model-cost m.json --run
    python tools/compare_outputs.py compare /tmp/out-base /tmp/out-head

``--trace PATH --limit N`` records an Azure-format trace instead of the built-in workload.
``--cost-model PATH`` prices the attention-level commands with that file (without it each
checkout uses its own cached calibration, or the built-in model where a change moved the
calibrated code's identity). ``--model-cost PATH`` adds the three modelled commands on whole-model graphs with that cost
file (passed as ``--cost-model PATH --family model``, or as ``--model-cost PATH`` to a checkout
whose CLI predates ``--family``; the line a command prints naming the flag is compared as one);
``--run`` adds real ``run --check`` replays (a small spec, ``aot_eager``) at the
attention level and, with ``--run-model SPEC``, at the model level. A real run's measured
seconds differ between any two runs, so only its counts, modes, errors and config are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Keys whose values are measured wall time, not modelled results.
TIMING_KEYS = frozenset({"wall_seconds", "elapsed_seconds"})
#: Keys of a real run's stall distribution (measured seconds).
RUN_STALL_KEYS = frozenset({"p50", "p99", "max"})
#: A small attention spec and limits for real runs: seconds of compile, not minutes.
RUN_FLAGS = ["--backend", "aot_eager", "--max-seq-len", "512", "--max-num-batched-tokens", "512",
             "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--check"]


def model_flags(checkout: Path, model_cost: Path) -> list[str]:
    """The flags that model whole-model graphs with the cost file ``model_cost`` in the CLI of
    ``checkout``: ``--cost-model FILE --family model`` where it takes ``--family``, else the
    earlier ``--model-cost FILE``."""
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    proc = subprocess.run([sys.executable, "-m", "attnpolicy", "simulate", "--help"], cwd=checkout, env=env,
                          capture_output=True, text=True, check=True)
    path = str(model_cost.resolve())
    return ["--cost-model", path, "--family", "model"] if "--family" in proc.stdout else ["--model-cost", path]


def prefill_flags(checkout: Path) -> list[str]:
    """``--prefill-only`` where the ``run --model`` of ``checkout`` serves whole requests
    by default (an earlier one replays prefill only): both record the same workload."""
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    proc = subprocess.run([sys.executable, "-m", "attnpolicy", "run", "--help"], cwd=checkout, env=env,
                          capture_output=True, text=True, check=True)
    return ["--prefill-only"] if "--prefill-only" in proc.stdout else []


def _commands(workload: list[str], model_cost: list[str] | None = None, run: bool = False,
              run_model: str | None = None, prefill_only: tuple[str, ...] = (),
              cost: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The commands, by the name of the output each writes (stdout goes to ``NAME.stdout``);
    ``model_cost``: the flags of :func:`model_flags`; ``prefill_only``: of :func:`prefill_flags`;
    ``cost``: the attention-level commands' ``--cost-model PATH``, if given."""
    commands = {
        "simulate": ["simulate", *workload, *cost, "--workers", "1", "--json", "simulate.json"],
        "stalls": ["stalls", *workload, *cost, "--json", "stalls.json"],
        "plan": ["plan", *workload, *cost, "--max-graphs", "8", "--out", "plan"],
    }
    if model_cost is not None:
        commands |= {
            "model_simulate": ["simulate", *workload, *model_cost, "--json", "model_simulate.json"],
            "model_stalls": ["stalls", *workload, *model_cost, "--json", "model_stalls.json"],
            "model_plan": ["plan", *workload, *model_cost, "--max-graphs", "8", "--out", "model_plan"],
        }
    if run:
        commands["run"] = ["run", *workload, *RUN_FLAGS, "--json", "run.json"]
        if run_model is not None:
            commands["model_run"] = ["run", *workload, "--model", run_model, *RUN_FLAGS[:6], "--check",
                                     "--max-num-seqs", "1", *prefill_only, "--json", "model_run.json"]
    return commands


def record(checkout: Path, out: Path, workload: list[str], model_cost: Path | None = None,
           run: bool = False, run_model: str | None = None, cost_model: Path | None = None) -> None:
    """Run the commands with ``checkout`` first on the path; outputs and stdout go to ``out``
    (a real run's stdout, all measured seconds, is not kept)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    flags = None if model_cost is None else model_flags(checkout, model_cost)
    prefill = tuple(prefill_flags(checkout)) if run_model is not None else ()
    cost = () if cost_model is None else ("--cost-model", str(cost_model.resolve()))
    for name, args in _commands(workload, flags, run, run_model, prefill, cost).items():
        proc = subprocess.run(
            [sys.executable, "-m", "attnpolicy", *args],
            cwd=out, env=env, capture_output=True, text=True, check=False,
        )
        if args[0] != "run":
            (out / f"{name}.stdout").write_text(proc.stdout)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr}")


def _strip(value: Any, measured: bool = False) -> Any:
    """``value`` without timing-only keys, at any depth; ``measured`` (a real run's output):
    also without any key naming seconds and the stall distribution's quantiles."""
    if isinstance(value, dict):
        return {k: _strip(v, measured) for k, v in value.items()
                if k not in TIMING_KEYS and not (measured and ("seconds" in k or k in RUN_STALL_KEYS))}
    if isinstance(value, list):
        return [_strip(v, measured) for v in value]
    return value


#: The earlier flag naming the whole-model cost file → its name now, as the commands print it.
FLAG_RENAMES = {"(--model-cost)": "(--cost-model)"}


def _load(path: Path, roots: tuple[Path, ...]) -> Any:
    """``path``'s content, the absolute paths of the folders ``roots`` compared written as
    ``<out>`` (host settings name their own files by absolute path)."""
    text = path.read_text()
    for root in roots:
        text = text.replace(str(root.resolve()), "<out>")
    if path.suffix == ".json":
        return _strip(json.loads(text), measured=path.name.endswith("run.json"))
    for old, new in FLAG_RENAMES.items():
        text = text.replace(old, new)
    return text


def compare(a: Path, b: Path) -> list[str]:
    """Relative paths of the files that differ or exist on one side only."""
    names_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    names_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    differ = sorted(str(n) for n in names_a ^ names_b)
    differ += sorted(str(n) for n in names_a & names_b if _load(a / n, (a, b)) != _load(b / n, (a, b)))
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run the commands of one checkout")
    rec.add_argument("checkout", type=Path)
    rec.add_argument("out", type=Path)
    rec.add_argument("--trace", default="default")
    rec.add_argument("--limit", type=int, default=None)
    rec.add_argument("--model-cost", type=Path, default=None, help="also the whole-model level, with this file")
    rec.add_argument("--cost-model", type=Path, default=None,
                     help="the attention-level cost model (default: the checkout's cached calibration or built-in "
                          "model, which a change to the calibrated code's identity moves)")
    rec.add_argument("--run", action="store_true", help="also real run --check replays")
    rec.add_argument("--run-model", default=None, metavar="SPEC", help="with --run: a real model-level run too")
    cmp = sub.add_parser("compare", help="compare two recorded folders")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "record":
        workload = ["--trace", args.trace]
        if args.limit is not None:
            workload += ["--limit", str(args.limit)]
        record(args.checkout, args.out, workload, args.model_cost, args.run, args.run_model, args.cost_model)
        return 0
    differ = compare(args.a, args.b)
    for name in differ:
        print(f"differs: {name}")
    print("identical" if not differ else f"{len(differ)} file(s) differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
