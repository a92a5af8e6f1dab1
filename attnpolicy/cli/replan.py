"""``attnpolicy replan``: measure a plan's drift on a recorded layout stream and refit it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from attnpolicy.cli.common import (
    check_writable,
    command,
    fail,
    positive_int,
    str_list,
    warn,
    writing,
)
from attnpolicy.cli.plan import check_plannable, plan_caption, print_plan, seconds
from attnpolicy.cli.simulate import check_recorded_spec, flag_range, priced, provenance_json
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.modelling.ranges import CALL_RANGE
from attnpolicy.planning.graph_set import plan_markdown
from attnpolicy.planning.replan import DRIFT_THRESHOLD, measure_drift, switch_set
from attnpolicy.workloads.layout_stream import read_layout_stream, select_run


def register(subparsers: Any) -> None:
    p = command(subparsers, "replan", "measure a plan's drift on a recorded layout stream; refit it when it drifted",
                "attnpolicy replan --config plan --layouts layouts.jsonl --window 2000 --out plan2", cmd_replan)
    p.add_argument("--config", required=True, metavar="PATH",
                   help="the config in use (a plan's directory or an attnpolicy_config.json) (required)")
    p.add_argument("--layouts", required=True, metavar="FILE",
                   help="the recorded layout stream (ATTNPOLICY_LAYOUT_LOG) (required)")
    p.add_argument("--run", metavar="RUN", help="the run to read when FILE holds several (default: the only one)")
    p.add_argument("--window", type=positive_int, default=None, metavar="N",
                   help="refit on the run's last N steps (default: every step)")
    p.add_argument("--threshold", type=seconds, default=DRIFT_THRESHOLD, metavar="D",
                   help=f"drift above which the refit plan is written (default: {DRIFT_THRESHOLD})")
    p.add_argument("--policies", type=str_list, default=None, metavar="P[,P...]",
                   help="stateless policies the refit may choose (default: the config's policy)")
    p.add_argument("--cost-model", metavar="PATH",
                   help="cost model JSON from 'attnpolicy calibrate' (default: this machine's cached calibration, "
                        "else the built-in one)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write replan.json, and the refit plan when it drifted (required)")


def cmd_replan(args: argparse.Namespace) -> int:
    check_writable("--out", args.out, directory=True)
    model, provenance = priced(args)
    try:
        current = AttnPolicyConfig.load(args.config)
    except ConfigError as exc:
        fail(f"argument --config: {exc}")
    try:
        run = select_run(read_layout_stream(args.layouts), args.run, args.layouts)
    except ConfigError as exc:
        fail(f"argument --layouts: {exc}")
    check_plannable("--config", [current.policy], current)
    check_plannable("--policies", args.policies or [], current)
    check_recorded_spec(model, provenance, run)
    steps = run.layouts[-args.window:] if args.window else run.layouts
    outside = flag_range(model, steps, CALL_RANGE)
    differs = [name for name in type(current).model_fields if getattr(run.config, name) != getattr(current, name)]
    if differs:
        warn(f"the layout stream was recorded under a config that differs from --config in {', '.join(differs)}: "
             "the drift is that of --config on the recorded traffic")
    try:
        drift = measure_drift(steps, current, model, args.policies, run.spec, args.threshold)
    except (ConfigError, PolicyError) as exc:
        fail(str(exc))
    out = Path(args.out)
    new = drift.refit.config
    switch = switch_set(current, new) if drift.replan else ()
    source = f"{args.layouts} run {run.run}, last {len(steps)} steps"
    with writing("--out", out):
        write_json(out / "replan.json", {
            "source": source, "recorded_config_differs": differs, "steps": len(steps), "drift": drift.drift,
            "threshold": drift.threshold, **provenance_json(provenance, outside),
            "replan": drift.replan, "current_total_seconds": drift.current.total_seconds,
            "refit_total_seconds": drift.refit.chosen.row.total_seconds,
            "switch": [w.model_dump(mode="json") for w in switch]})
    print(provenance.line())
    print(f"drift {drift.drift:.4f} (current {drift.current.total_seconds:.4g} s, refit "
          f"{drift.refit.chosen.row.total_seconds:.4g} s modelled on {len(steps)} steps; threshold {drift.threshold})")
    if drift.replan:
        with writing("--out", out):
            new.save(out)
            write_json(out / "plan.json", {"source": source, "rejected": 0, **drift.refit.to_json()})
            write_text_atomic(out / "plan.md", plan_markdown(drift.refit, source))
        print_plan(drift.refit, f"attnpolicy plan: {source}", drift.refit.base_buckets, plan_caption(drift.refit))
        print(f"replan: {len(switch)} new warm graphs to compile in the background; "
              f"wrote {out / 'attnpolicy_config.json'}, {out / 'plan.md'}, {out / 'plan.json'}, {out / 'replan.json'}")
    else:
        print(f"no replan (drift at most {drift.threshold}); wrote {out / 'replan.json'}")
    return 0
