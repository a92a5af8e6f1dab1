"""``attnpolicy stalls``: compile stalls per batch, synchronous against background
compiles with pad-up, on the cost model's clock."""

from __future__ import annotations

import argparse
from typing import Any

from attnpolicy.cli.common import (
    add_capacities_arg,
    add_cost_args,
    add_policies_arg,
    add_workload_args,
    check_policies,
    check_writable,
    fail,
    family_of,
    formed,
    former_from,
    former_options,
    not_taken,
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
    model_sweep,
    priced,
    priced_model,
    provenance_json,
    with_store,
    workload,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.simulation import check_model, model_config, simulation_config
from attnpolicy.modelling.stalls import (
    ModelStallRow,
    StallRow,
    compare_model_stalls,
    compare_stalls,
    stall_configs,
    warm_layouts,
)

STALLS_POLICIES = ("varlen",)
STALLS_CAPACITIES = (8, 16, None)
WARM = ("none", "prefix:20", "all")


def register(subparsers: Any) -> None:
    from attnpolicy.cli.common import command

    s = command(subparsers, "stalls",
                "model compile stalls per batch: synchronous compiles against background compiles with pad-up",
                "attnpolicy stalls --limit 100 --capacities 8,inf --warm prefix:20", cmd_stalls)
    add_workload_args(s)
    add_policies_arg(s, STALLS_POLICIES)
    add_capacities_arg(s, STALLS_CAPACITIES)
    s.add_argument("--warm", type=str_list, default=WARM, metavar="W[,W...]",
                   help="warm-up sets: 'none', 'all' (every key the workload uses) or 'prefix:N' (the keys "
                        f"of its first N batches) (default: {shown(WARM)})")
    s.add_argument("--switch-after", type=positive_int, default=None, metavar="N",
                   help="batches from a background compile's request to its switch into the cache "
                        "(default: the config's switch_after)")
    add_cost_args(s)
    s.add_argument("--config", metavar="PATH",
                   help="base attnpolicy config (default: derived from the cost model and the batch former)")
    add_store_args(s)
    s.add_argument("--json", metavar="PATH", help="write the rows as JSON (default: none)")


def cmd_stalls(args: argparse.Namespace) -> int:
    check_policies("--policies", args.policies)
    check_writable("--json", args.json)
    family = family_of(args)
    if family == "model":
        not_taken(args, "with --family model (the config is derived from the cost model and the flags)",
                  "config", "store_bytes", "store_warm")
        if tuple(args.warm) != WARM:
            fail("argument --warm: not taken with --family model (no warm-up is modelled)")
        cost, provenance = priced_model(args)
    else:
        model, provenance = priced(args)
    former = former_from(args, prefill_only=family == "model")
    if family == "attention":
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
            fail(f"argument --capacities: {exc}" + (f" (the config of --config {args.config})" if args.config
                                                    else ""))
    requests = workload(args, former)
    print(provenance.line())
    steps, w = formed(args, former, requests)
    fields: dict[str, Any] = {"trace": args.trace, "workload": w.to_json()}
    if family == "model":
        switch = {} if args.switch_after is None else {"switch_after": args.switch_after}
        layouts, model_rows = model_sweep(
            args, STALLS_POLICIES, steps, cost, provenance, fields,
            lambda policy: [model_config(cost, former.max_model_len, former.max_num_batched_tokens, policy=policy,
                                         max_graphs=capacity, **switch) for capacity in args.capacities],
            lambda layouts, configs: compare_model_stalls(layouts, cost, configs))
        print_model_stalls(f"modelled {len(layouts)} model-graph batches of {args.trace}, {cost.spec} "
                           f"({cost.backend}), switch_after={model_rows[0].switch_after}", model_rows)
    else:
        outside = flag_range(model, steps)
        total = len(args.policies) * len(args.capacities) * len(args.warm) * 2
        with progress(total, "stalls") as advance:
            rows = compare_stalls(steps, base, args.policies, args.capacities, args.warm, args.switch_after, model,
                                  progress=advance, store_warm=args.store_warm)
        print_stalls(f"modelled {w.admitted} requests of {args.trace} ({w.rejected} rejected, {w.batches} "
                     f"batches), cost model {model.impl}/{model.backend}, "
                     f"switch_after={rows[0].switch_after if rows else '-'}", rows)
        fields |= {"requests": len(requests), "former": former_options(args), "config": base.model_dump(mode="json"),
                   **provenance_json(provenance, outside), "rows": [r.to_json() for r in rows]}
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, fields)
    return 0


def print_model_stalls(title: str, rows: list[ModelStallRow]) -> None:
    sync = {(r.policy, r.capacity): r.total_seconds for r in rows if r.compile_mode == "sync"}
    print_table(title, ("policy", "capacity", "mode", "compiles", "pad-ups", "eager", "stalled", "stall p99 s",
                        "stall s", "total s", "vs sync"),
                [(r.policy, "∞" if r.capacity is None else r.capacity, r.compile_mode, r.compiles, r.padded_up,
                  r.eager_served, f"{r.stalled_batches}/{r.batches}", r.stall_p99, r.stall_seconds,
                  r.total_seconds, f"{r.total_seconds / sync[r.policy, r.capacity]:.3f}×") for r in rows],
                caption="total: run seconds as served (padded up or eager) + stalls, modelled")


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
