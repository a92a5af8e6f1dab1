"""CPU seconds of the modelling commands, and how soon each prints its first line.

Runs each command ``--repeats`` times in a fresh interpreter (from a neutral working
directory, the checkout given first on ``PYTHONPATH``) and prints, per command, the
user + system CPU seconds of every run (the process and its workers), the wall seconds
until its first line on stdout, and the load average before it. On a shared machine
CPU seconds rise with the load: a pure-Python loop timed before each command (its
``loop s``) says how fast the machine ran then; compare checkouts run by turns::

    python benchmarks/cli_cpu.py --trace PATH [--checkout DIR] [--repeats 3] [--only plan,cost-aware,sweep]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def commands(trace: str, out: str) -> dict[str, list[str]]:
    """The timed commands by name: one planned capacity, one cost-aware dispatcher run, the whole sweep."""
    return {
        "plan": ["plan", "--trace", trace, "--max-graphs", "8", "--out", out],
        "cost-aware": ["simulate", "--trace", trace, "--policies", "cost-aware", "--capacities", "8",
                       "--evictions", "lru"],
        "sweep": ["simulate", "--trace", trace, "--policies", "always-mask,dynamic,varlen,cost-aware",
                  "--capacities", "2,4,8,16,32", "--evictions", "lru,lfu,cost,belady"],
    }


def loop_seconds() -> float:
    """CPU seconds of a fixed pure-Python loop: the machine's speed now."""
    start = time.process_time()
    total = 0
    for i in range(5_000_000):
        total += i
    return time.process_time() - start


def run(argv: list[str], checkout: Path) -> tuple[float, float, float]:
    """(CPU seconds, wall seconds to the first stdout line, wall seconds) of ``attnpolicy argv``."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.Popen([sys.executable, "-m", "attnpolicy", *argv], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()
        first = time.perf_counter() - start
        proc.stdout.read()
        if proc.wait() != 0:
            raise SystemExit(f"attnpolicy {' '.join(argv)} exited {proc.returncode}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, first, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="an Azure-format trace (the issues time the code trace)")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the attnpolicy checkout to time (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="plan,cost-aware,sweep", help="commands to time, of plan,cost-aware,sweep")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        table = commands(str(Path(args.trace).resolve()), out)
        print(f"{'command':<11} {'cpu s':>7} {'first line s':>12} {'wall s':>7} {'loop s':>7}  load")
        for name in args.only.split(","):
            for _ in range(args.repeats):
                load, loop = " ".join(f"{x:.2f}" for x in os.getloadavg()), loop_seconds()
                cpu, first, wall = run(table[name], args.checkout.resolve())
                print(f"{name:<11} {cpu:7.2f} {first:12.2f} {wall:7.2f} {loop:7.2f}  {load}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
