"""``attnpolicy report``: the main job (bench, sweep, Belady bound, validation, plots)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markdown import Markdown

from attnpolicy.bench.calibration_cache import entry_path
from attnpolicy.bench.settings import BenchSettings
from attnpolicy.cli.common import (
    add_workload_args,
    check_evictions,
    check_positions,
    check_writable,
    command,
    console,
    describe_options,
    fail,
    formed,
    former_from,
    former_options,
    int_list,
    model_spec,
    natural_int,
    policy_options,
    positive_int,
    progress,
    settings,
    shown,
    str_list,
    warn,
    writing,
)
from attnpolicy.cli.plan import seconds
from attnpolicy.cli.simulate import add_sweep_args, sweep_size, workload
from attnpolicy.engine.model_specs import spec_config
from attnpolicy.errors import ConfigError
from attnpolicy.kernels.accuracy import MaxAbsError
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.ranges import OutsideRange
from attnpolicy.modelling.warmup_costs import check_fits
from attnpolicy.report.build import ReportSettings, known_model, make_report
from attnpolicy.report.markdown import first_screen

#: The least width the first screen is printed at (a pipe's default, 80, splits the table's cells).
WIDTH = 160

REPORT_FLAGS = {"lengths": "--bench-lengths", "repeats": "--bench-repeats", "seqs": "--bench-lengths",
         "kernel_lengths": "--kernel-lengths", "kernel_skip": "--kernel-skip",
         "validate_requests": "--validate-requests", "plan_max_buckets": "--plan-max-buckets",
         "model": "--model", "model_cost": "--model-cost", "model_lengths": "--model-lengths",
         "model_backend": "--model-backend", "measure_requests": "--measure-requests",
         "measure_seconds": "--measure-seconds",
         "sizes": "--calibrate-sizes"}


def register(subparsers: Any) -> None:
    d = ReportSettings()
    p = command(subparsers, "report",
                "the main job: bench table, policy sweep with Belady's bound, simulator check, plots",
                "attnpolicy report --out report   # minutes (README: a measured time); --limit 40 for a quick look",
                cmd_report)
    p.add_argument("--out", default=str(d.out), metavar="DIR",
                   help=f"output directory: report.md, report.json, PNGs (default: {d.out})")
    add_workload_args(p)
    add_sweep_args(p, d.policies, d.capacities, d.evictions, d.buckets)
    p.add_argument("--cost-model", default=None, metavar="PATH",
                   help="a cost model JSON from 'attnpolicy calibrate' (default: calibrated on this machine, "
                        "see --calibrate)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=d.calibrate,
                   help="calibrate a cost model on this machine, a small grid, reused from the calibration cache "
                        "when it holds one (else kept there); --no-calibrate uses the built-in model; ignored with "
                        "--cost-model (default: on)")
    p.add_argument("--calibrate-sizes", type=int_list, default=d.calibration.sizes, metavar="N[,N...]",
                   help="the pow2 bucket sizes of that grid, e.g. 16,64 for a quick look "
                        f"(default: {shown(d.calibration.sizes)})")
    p.add_argument("--bench-lengths", type=int_list, default=d.bench.lengths, metavar="L[,L...]",
                   help=f"total lengths of the bench table (default: {shown(d.bench.lengths)})")
    p.add_argument("--bench-repeats", type=positive_int, default=d.bench.repeats, metavar="N",
                   help=f"timed runs per bench mode (default: {d.bench.repeats})")
    p.add_argument("--kernel-lengths", type=int_list, default=d.kernel_lengths, metavar="L[,L...]",
                   help=f"total tokens of the kernel table's batches, {d.kernel_seqs} sequences each "
                        f"(default: {shown(d.kernel_lengths)})")
    p.add_argument("--kernel-skip", type=str_list, default=d.kernel_skip, metavar="IMPL[,IMPL...]",
                   help="implementations left out of the kernel table, e.g. flex (default: none)")
    p.add_argument("--validate-requests", type=positive_int, default=d.validate_requests, metavar="N",
                   help="first N requests replayed with real compute to check the simulator "
                        f"(default: {d.validate_requests})")

    p.add_argument("--model", type=model_spec, default=None, metavar="SPEC",
                   help="also time a whole model's forward, MASK vs CAUSAL per --model-lengths, as 'attnpolicy "
                        "bench --model'; SPEC: a built-in spec or a directory (default: off)")
    p.add_argument("--model-lengths", type=int_list, default=d.model_lengths, metavar="L[,L...]",
                   help=f"lengths of --model (default: {shown(d.model_lengths)})")
    p.add_argument("--model-backend", default=d.model_backend, metavar="NAME",
                   help=f"torch.compile backend of --model (default: {d.model_backend})")
    p.add_argument("--model-cost", default=None, metavar="PATH",
                   help="a cost-model file with whole-model step fits, as 'attnpolicy calibrate --model SPEC' "
                        "writes: adds the warm-up schemes on whole requests, as 'attnpolicy plan --family model "
                        "--whole-requests' (default: off)")
    p.add_argument("--measure-requests", type=natural_int, default=None, metavar="N",
                   help="with --model-cost: run the plan's gaudi form and the runtime default of the lowest modelled "
                        "total that runs here on the first N requests, through the cost model's own model, beside "
                        f"their modelled seconds; 0 measures nothing (default: {d.measure_requests})")
    p.add_argument("--measure-seconds", type=seconds, default=None, metavar="S",
                   help="with --model-cost: the most modelled seconds measured on that slice, a row whose modelled "
                        f"total would go over stays modelled (default: {d.measure_seconds:g})")
    p.add_argument("--plan-max-buckets", type=positive_int, default=d.plan_max_buckets, metavar="K",
                   help="most bucket sizes per candidate list of the plan step, as 'attnpolicy plan "
                        f"--max-buckets' (default: {d.plan_max_buckets})")


def check_model_cost(path: str, measure_requests: int, max_model_len: int) -> None:
    """Refuse (exit 2) a --model-cost file without step fits and, when section 5
    measures (``measure_requests``), one whose model cannot be loaded here, differs from
    the fits' dims or holds fewer positions than ``max_model_len``."""
    try:
        cost = CostFile.load(path).model_fits(path, steps=True)
        check_fits(cost)
    except ConfigError as exc:
        fail(f"argument --model-cost: {exc}")
    if measure_requests:
        try:
            differs = cost.model_differs(spec_config(cost.spec), f"its spec {cost.spec}")
        except ConfigError as exc:
            fail(f"argument --model-cost: {path} prices a model that cannot be loaded here to measure on a slice: "
                 f"{exc} (--measure-requests 0 leaves section 5 modelled)")
        if differs:
            fail(f"argument --model-cost: {path} prices another model: {differs}")
        check_positions("--model-cost", cost.spec, max_model_len)


def cmd_report(args: argparse.Namespace) -> int:
    check_writable("--out", args.out, directory=True)
    former = former_from(args)
    options = policy_options(args, "--policies", args.policies)
    check_evictions("--evictions", args.evictions, simulation=True)
    measure = {name: getattr(args, name) for name in ("measure_requests", "measure_seconds")
               if getattr(args, name) is not None}
    if measure and args.model_cost is None:
        fail(f"argument {REPORT_FLAGS[next(iter(measure))]}: needs --model-cost PATH (it measures section 5)")
    requests = workload(args, former)
    bench = settings(BenchSettings, REPORT_FLAGS, lengths=tuple(args.bench_lengths), repeats=args.bench_repeats)
    calibration = settings(partial(dataclasses.replace, ReportSettings().calibration), REPORT_FLAGS,
                           sizes=tuple(args.calibrate_sizes))
    s = settings(ReportSettings, REPORT_FLAGS, out=Path(args.out), trace=args.trace, limit=args.limit,
                 policies=tuple(args.policies), capacities=tuple(args.capacities), evictions=tuple(args.evictions),
                 buckets=tuple(args.buckets) or ("pow2",), max_bytes=tuple(args.max_bytes or (None,)),
                 workers=args.workers,
                 cost_model=args.cost_model, calibrate=args.calibrate, calibration=calibration,
                 validate_requests=args.validate_requests,
                 plan_max_buckets=args.plan_max_buckets,
                 kernel_lengths=tuple(args.kernel_lengths), kernel_skip=tuple(args.kernel_skip),
                 model=args.model, model_cost=args.model_cost, model_lengths=tuple(args.model_lengths),
                 **measure,
                 model_backend=args.model_backend,
                 bench=bench, former=former_options(args), policy_options=options)
    if s.model_cost is not None:
        check_model_cost(s.model_cost, s.measure_requests, former.max_model_len)
    try:
        known = known_model(s, warn)
    except ConfigError as exc:
        fail(f"argument --cost-model: {exc}")
    print(known[1].line() if known else
          f"cost model: calibrated now on this machine, kept in {entry_path(s.calibration)}")
    formed(args, former, requests)
    total = (len(s.bench.lengths) * len(s.bench.seqs) + len(s.kernel_lengths) + sweep_size(args)
             + (len(s.model_lengths) if s.model else 0)
             + len(s.validated_policies) + int(s.calibrates) + 1
             + (int(s.measure_requests > 0) + 1 if s.model_cost is not None else 0))
    command_line = "attnpolicy " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with progress(total, "report") as advance, writing("--out", s.out):  # report.md, plots, the config
        data = make_report(s, command_line, advance, requests, known)
    console.print(f"wrote {s.out / 'report.md'}, {s.out / 'report.json'}, "
                  f"{', '.join(str(s.out / p['file']) for p in data['plots'])} and the config "
                  f"{data['recommendation']['config_dir']} in {data['seconds']:.0f} s "
                  f"(the plan step {data['recommendation']['plan_seconds']:.0f} s)")
    ran = describe_options(options)
    if ran:
        console.print(f"policy options: {ran}")
    if data["cost_model_provenance"]["kind"] == "calibrated" and data["cost_model_provenance"]["file"] is None:
        warn(f"the cost model was {data['cost_model_source']}")
    if (outside := data["outside_calibrated_range"]) and outside["outside"]:
        warn(OutsideRange(**outside).line())
    # the answer, on stdout; wide enough for the first screen's table to keep its cells whole
    Console(width=max(Console().width, WIDTH)).print(Markdown("\n".join(first_screen(data))))
    failed = [v for v in data["validation"] if v["passed"] is False]
    for v in failed:
        warn(f"the check of {v['policy']}'s outputs against the float64 reference failed: "
             f"{MaxAbsError(v['max_abs_err'], v['non_finite']).describe(v['tolerance'])}; "
             "see section 3 of the report")
    return 1 if failed else 0
