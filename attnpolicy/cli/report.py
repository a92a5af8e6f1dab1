"""``attnpolicy report``: the main job (bench, sweep, Belady bound, validation, plots)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from attnpolicy.cli.common import capacity_list, console, int_list, progress, str_list
from attnpolicy.measure.report import ReportSettings, make_report
from attnpolicy.measure.timing import BenchSettings


def register(subparsers: Any) -> None:
    d = ReportSettings()
    p = subparsers.add_parser("report", help="the main job: bench table, policy sweep, Belady bound, plots")
    p.add_argument("--out", default=str(d.out), help="output directory (default: %(default)s)")
    p.add_argument("--trace", default=d.trace, help="'default' (built-in synthetic) or an Azure CSV path")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--policies", type=str_list, default=d.policies, metavar="P[,P...]")
    p.add_argument("--capacities", type=capacity_list, default=d.capacities, metavar="K[,K...]",
                   help="max graphs per run; 'inf' for unbounded (default: 2,4,8,16,32,inf)")
    p.add_argument("--evictions", type=str_list, default=d.evictions, metavar="E[,E...]")
    p.add_argument("--cost-model", default=None, help="a cost model JSON from 'attnpolicy calibrate'")
    p.add_argument("--calibrate", action="store_true", help="calibrate a cost model now (about a minute)")
    p.add_argument("--bench-lengths", type=int_list, default=d.bench.lengths, metavar="L[,L...]",
                   help="total lengths of the bench table (default: %(default)s)")
    p.add_argument("--bench-repeats", type=int, default=d.bench.repeats)
    p.add_argument("--validate-requests", type=int, default=d.validate_requests,
                   help="requests replayed with real compute to check the simulator (default: %(default)s)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    s = ReportSettings(out=Path(args.out), trace=args.trace, limit=args.limit, policies=tuple(args.policies),
                       capacities=tuple(args.capacities), evictions=tuple(args.evictions),
                       cost_model=args.cost_model, calibrate=args.calibrate,
                       validate_requests=args.validate_requests,
                       bench=BenchSettings(lengths=tuple(args.bench_lengths), repeats=args.bench_repeats))
    total = (len(s.bench.lengths) * len(s.bench.seqs) + len(s.policies) * len(s.capacities) * len(s.evictions)
             + len(s.validate_policies) + int(s.calibrate))
    command = "attnpolicy " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with progress(total, "report") as advance:
        data = make_report(s, command, advance)
    console.print(f"wrote {s.out / 'report.md'}, {s.out / 'report.json'} and "
                  f"{', '.join(str(s.out / p) for p in data['plots'])} in {data['seconds']:.0f} s")
    for row in data["summary"]:
        console.print(f"capacity {row['capacity'] or '∞'}: best {row['best_policy']} "
                      f"{row['total_seconds']:.3g} s")
    return 0
