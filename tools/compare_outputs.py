"""Record and compare the modelled outputs of ``simulate --json``, ``plan`` and ``stalls``.

A refactor that keeps behaviour leaves these outputs identical. ``record`` runs the three
commands with a given checkout on ``PYTHONPATH`` and writes their outputs to a folder;
``compare`` says which outputs of two folders differ (timing-only fields are dropped first)::

    python tools/compare_outputs.py record /path/to/base-checkout /tmp/out-base
    python tools/compare_outputs.py record . /tmp/out-head
    python tools/compare_outputs.py compare /tmp/out-base /tmp/out-head

``--trace PATH --limit N`` records an Azure-format trace instead of the built-in workload.
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


def _commands(workload: list[str]) -> dict[str, list[str]]:
    """The three commands, by the name of the output folder each writes to."""
    return {
        "simulate": ["simulate", *workload, "--workers", "1", "--json", "simulate.json"],
        "stalls": ["stalls", *workload, "--json", "stalls.json"],
        "plan": ["plan", *workload, "--max-graphs", "8", "--out", "plan"],
    }


def record(checkout: Path, out: Path, workload: list[str]) -> None:
    """Run the commands with ``checkout`` first on the path; outputs and stdout go to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    for name, args in _commands(workload).items():
        proc = subprocess.run(
            [sys.executable, "-m", "attnpolicy", *args],
            cwd=out, env=env, capture_output=True, text=True, check=False,
        )
        (out / f"{name}.stdout").write_text(proc.stdout)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr}")


def _strip(value: Any) -> Any:
    """``value`` without timing-only keys, at any depth."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _load(path: Path) -> Any:
    if path.suffix == ".json":
        return _strip(json.loads(path.read_text()))
    return path.read_text()


def compare(a: Path, b: Path) -> list[str]:
    """Relative paths of the files that differ or exist on one side only."""
    names_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    names_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    differ = sorted(str(n) for n in names_a ^ names_b)
    differ += sorted(str(n) for n in names_a & names_b if _load(a / n) != _load(b / n))
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run the commands of one checkout")
    rec.add_argument("checkout", type=Path)
    rec.add_argument("out", type=Path)
    rec.add_argument("--trace", default="default")
    rec.add_argument("--limit", type=int, default=None)
    cmp = sub.add_parser("compare", help="compare two recorded folders")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "record":
        workload = ["--trace", args.trace]
        if args.limit is not None:
            workload += ["--limit", str(args.limit)]
        record(args.checkout, args.out, workload)
        return 0
    differ = compare(args.a, args.b)
    for name in differ:
        print(f"differs: {name}")
    print("identical" if not differ else f"{len(differ)} file(s) differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
