"""``attnpolicy stalls``: compile stalls per batch, synchronous against background
compiles with pad-up, on the cost model's clock."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.cli.common import (
    add_capacities_arg,
    add_policies_arg,
    add_workload_args,
    check_policies,
    check_writable,
    fail,
    formed,
    former_from,
    former_options,
    positive_int,
    print_table,
    progress,
    shown,
    str_list,
    writing,
)
from attnpolicy.cli.simulate import (
    add_store_args,
    flag_range,
    priced,
    provenance_json,
    with_store,
    workload,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.simulation import check_model, simulation_config
from attnpolicy.modelling.stalls import StallRow, compare_stalls, stall_configs, warm_layouts

POLICIES = ("varlen",)
CAPACITIES = (8, 16, None)
WARM = ("none", "prefix:20", "all")


def register(subparsers: Any) -> None:
    from attnpolicy.cli.common import command

    s = command(subparsers, "stalls",
                "model compile stalls per batch: synchronous compiles against background compiles with pad-up",
                "attnpolicy stalls --limit 100 --capacities 8,inf --warm prefix:20", cmd_stalls)
    add_workload_args(s)
    add_policies_arg(s, POLICIES)
    add_capacities_arg(s, CAPACITIES)
    s.add_argument("--warm", type=str_list, default=WARM, metavar="W[,W...]",
                   help="warm-up sets: 'none', 'all' (every key the workload uses) or 'prefix:N' (the keys "
                        f"of its first N batches) (default: {shown(WARM)})")
    s.add_argument("--switch-after", type=positive_int, default=None, metavar="N",
                   help="batches from a background compile's request to its switch into the cache "
                        "(default: the config's switch_after)")
    s.add_argument("--cost-model", metavar="PATH",
                   help="cost model JSON from 'attnpolicy calibrate' (default: this machine's cached calibration, "
                        "else the built-in one)")
    s.add_argument("--model-cost", metavar="PATH",
                   help="model stalls on whole-model graphs with a model cost model from 'attnpolicy calibrate "
                        "--model', prefill-only batches (default: attention graphs)")
    s.add_argument("--config", metavar="PATH",
                   help="base attnpolicy config (default: derived from the cost model and the batch former)")
    add_store_args(s)
    s.add_argument("--json", metavar="PATH", help="write the rows as JSON (default: none)")


def cmd_stalls(args: argparse.Namespace) -> int:
    check_policies("--policies", args.policies)
    if args.model_cost:
        from attnpolicy.cli.model_graphs import cmd_stalls_model

        return cmd_stalls_model(args, POLICIES, WARM)
    check_writable("--json", args.json)
    model, provenance = priced(args)
    former = former_from(args)
    base = AttnPolicyConfig.load(args.config) if args.config else simulation_config(model, former)
    check_model(base, model)
    base = with_store(args, base, model)
    for warm in args.warm:
        try:
            warm_layouts([], warm)
        except ConfigError as exc:
            fail(f"argument --warm: {exc}")
    try:
        stall_configs(base, args.policies, args.capacities, args.switch_after)
    except ConfigError as exc:
        fail(f"argument --capacities: {exc}" + (f" (the config of --config {args.config})" if args.config else ""))
    requests = workload(args, former)
    print(provenance.line())
    steps, w = formed(args, former, requests)
    outside = flag_range(model, steps)
    total = len(args.policies) * len(args.capacities) * len(args.warm) * 2
    with progress(total, "stalls") as advance:
        rows = compare_stalls(steps, base, args.policies, args.capacities, args.warm, args.switch_after, model,
                              progress=advance, store_warm=args.store_warm)
    print_stalls(f"modelled {w.admitted} requests of {args.trace} ({w.rejected} rejected, {w.batches} "
                 f"batches), cost model {model.impl}/{model.backend}, "
                 f"switch_after={rows[0].switch_after if rows else '-'}", rows)
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, {"trace": args.trace, "requests": len(requests), "former": former_options(args),
                                   "workload": w.to_json(), "config": base.model_dump(mode="json"),
                                   **provenance_json(provenance, outside), "rows": [r.to_json() for r in rows]})
    return 0


def print_stalls(title: str, rows: list[StallRow]) -> None:
    sync = {(r.policy, r.capacity, r.warm): r.total_seconds for r in rows if r.compile_mode == "sync"}
    print_table(title, ("policy", "capacity", "warm", "compiles", "mode", "pad-ups", "stalled", "stall p50 s",
                        "stall p99 s", "stall max s", "stall s", "total s", "vs sync"),
                [(r.policy, "∞" if r.capacity is None else r.capacity, r.warm,
                  f"{r.warm_keys}+{r.compiles}", r.compile_mode, r.pad_up_calls,
                  f"{r.stalled_batches}/{r.batches}", r.stall_p50, r.stall_p99, r.stall_max, r.stall_seconds,
                  r.total_seconds, f"{r.total_seconds / sync[r.policy, r.capacity, r.warm]:.3f}×")
                 for r in rows],
                caption="compiles: warm-up keys + compiles after warm-up; total: run seconds (padding "
                        "included) + stalls, modelled; warm-up compiles are not in it")
    stored = [r for r in rows if r.store is not None]
    if stored:
        print_table("graph store: misses after warm-up it served by a load instead of a compile",
                    ("policy", "capacity", "warm", "mode", "compiles", "loads", "load s", "disk evictions"),
                    [(r.policy, "∞" if r.capacity is None else r.capacity, r.warm, r.compile_mode, r.compiles,
                      r.store.loads, r.store.load_seconds, r.store.disk_evictions)
                     for r in stored if r.store is not None])
