"""``attnpolicy stalls``: compile stalls per batch, synchronous against background
compiles with pad-up, on the cost model's clock."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from attnpolicy.cli.common import (
    add_capacities_arg,
    add_cost_args,
    add_policies_arg,
    add_workload_args,
    by_family,
    check_policies,
    check_writable,
    fail,
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
    priced,
    priced_model,
    provenance_json,
    whole_model_policies,
    with_store,
    workload,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError, GraphTooLargeError
from attnpolicy.modelling.cost_file import Family
from attnpolicy.modelling.ranges import CALL_RANGE, GRAPH_RANGE
from attnpolicy.modelling.simulation import check_model, model_config, model_layouts, simulation_config
from attnpolicy.modelling.stalls import (
    MODES,
    WARM_NONE,
    AttentionLevel,
    StallLevel,
    StallRow,
    WholeModelLevel,
    compare_stalls,
    stall_configs,
    warm_layouts,
)
from attnpolicy.workloads.batching import ScheduledBatch, Workload

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
    level = by_family(args, STALLS_LEVELS)(args)
    requests = workload(args, level.former)
    print(level.provenance.line())
    steps, w = formed(args, level.former, requests)
    fields: dict[str, Any] = {"trace": args.trace, "workload": w.to_json()}
    layouts, configs, head = level.sweep(args, steps, len(requests))
    with progress(len(configs) * len(level.warm) * len(MODES), "stalls") as advance:
        try:
            rows = compare_stalls(layouts, level.stalls, configs, level.warm, advance, args.store_warm)
        except (ConfigError, GraphTooLargeError) as exc:
            fail(str(exc))
    print_stalls(f"{level.title(args, w, layouts)}, switch_after={rows[0].switch_after if rows else '-'}", rows,
                 level.columns, level.caption)
    fields |= head | {"rows": [r.to_json() for r in rows]}
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, fields)
    return 0


#: A table column: its header and its cell of a row.
Column = tuple[str, Callable[[StallRow], Any]]
_POLICY: Column = ("policy", lambda r: r.policy)
_CAPACITY: Column = ("capacity", lambda r: "∞" if r.capacity is None else r.capacity)
_MODE: Column = ("mode", lambda r: r.compile_mode)
_PAD_UPS: Column = ("pad-ups", lambda r: r.pad_up_calls)
_STALLED: Column = ("stalled", lambda r: f"{r.stalled_batches}/{r.batches}")


class _Attention:
    """``stalls`` on attention calls: a base config (``--config`` or derived), warm-up sets
    and an optional graph store."""

    warm: tuple[str, ...]
    columns: tuple[Column, ...] = (
        _POLICY, _CAPACITY, ("warm", lambda r: r.warm), ("compiles", lambda r: f"{r.warm_keys}+{r.compiles}"),
        _MODE, _PAD_UPS, _STALLED, ("stall p50 s", lambda r: r.stall_p50), ("stall p99 s", lambda r: r.stall_p99),
        ("stall max s", lambda r: r.stall_max), ("stall s", lambda r: r.stall_seconds),
        ("total s", lambda r: r.total_seconds))
    caption = ("compiles: warm-up keys + compiles after warm-up; total: run seconds (padding included) + stalls, "
               "modelled; warm-up compiles are not in it")

    def __init__(self, args: argparse.Namespace) -> None:
        model, self.provenance = priced(args)
        self.former = former_from(args)
        base = AttnPolicyConfig.load(args.config) if args.config else simulation_config(model, self.former)
        check_model(base, model)
        self.base = with_store(args, base, model)
        for warm in args.warm:
            try:
                warm_layouts([], warm)
            except ConfigError as exc:
                fail(f"argument --warm: {exc}")
        try:
            self.configs = stall_configs(self.base, args.policies, args.capacities, args.switch_after)
        except ConfigError as exc:
            fail(f"argument --capacities: {exc}" + (f" (the config of --config {args.config})" if args.config
                                                    else ""))
        self.warm = tuple(args.warm)
        self.stalls: StallLevel[Any, Any] = AttentionLevel(model)
        self.model = model

    def sweep(self, args: argparse.Namespace, steps: list[ScheduledBatch], requests: int
              ) -> tuple[list[ScheduledBatch], list[AttnPolicyConfig], dict[str, Any]]:
        """The batches and configs to replay, and the --json head."""
        return steps, self.configs, {"requests": requests, "former": former_options(args),
                                     "config": self.base.model_dump(mode="json"),
                                     **provenance_json(self.provenance, flag_range(self.model, steps, CALL_RANGE))}

    def title(self, args: argparse.Namespace, w: Workload, layouts: Sequence[object]) -> str:
        return (f"modelled {w.admitted} requests of {args.trace} ({w.rejected} rejected, {w.batches} batches), "
                f"cost model {self.model.impl}/{self.model.backend}")


class _WholeModel:
    """``stalls --family model``: configs derived from the cost model and the flags per
    policy and capacity, prefill batches, no warm-up and no store."""

    warm = (WARM_NONE,)
    columns: tuple[Column, ...] = (
        _POLICY, _CAPACITY, _MODE, ("compiles", lambda r: r.compiles), _PAD_UPS,
        ("eager", lambda r: r.eager_served), _STALLED, ("stall p99 s", lambda r: r.stall_p99),
        ("stall s", lambda r: r.stall_seconds), ("total s", lambda r: r.total_seconds))
    caption = "total: run seconds as served (padded up or eager) + stalls, modelled"

    def __init__(self, args: argparse.Namespace) -> None:
        not_taken(args, "with --family model (the config is derived from the cost model and the flags)",
                  "config", "store_bytes", "store_warm")
        if tuple(args.warm) != WARM:
            fail("argument --warm: not taken with --family model (no warm-up is modelled)")
        self.model, self.provenance = priced_model(args)
        self.former = former_from(args, prefill_only=True)
        self.stalls: StallLevel[Any, Any] = WholeModelLevel(self.model)

    def sweep(self, args: argparse.Namespace, steps: list[ScheduledBatch], requests: int
              ) -> tuple[list[BatchLayout], list[AttnPolicyConfig], dict[str, Any]]:
        """The prefill batches, the config of each policy (:func:`whole_model_policies`) ×
        capacity, and the --json head."""
        layouts = model_layouts(steps)
        head = {"limit": args.limit, "batches": len(layouts), "model": self.model.spec,
                **provenance_json(self.provenance, flag_range(self.model, layouts, GRAPH_RANGE))}
        switch = {} if args.switch_after is None else {"switch_after": args.switch_after}
        try:
            configs = [model_config(self.model, self.former.max_model_len, self.former.max_num_batched_tokens,
                                    policy=policy, max_graphs=capacity, **switch)
                       for policy in whole_model_policies(args, STALLS_POLICIES) for capacity in args.capacities]
        except ConfigError as exc:
            fail(str(exc))
        return layouts, configs, head

    def title(self, args: argparse.Namespace, w: Workload, layouts: Sequence[object]) -> str:
        return f"modelled {len(layouts)} model-graph batches of {args.trace}, {self.model.spec} ({self.model.backend})"


def print_stalls(title: str, rows: list[StallRow], columns: Sequence[Column], caption: str) -> None:
    """The rows as ``columns`` and each row's total over its ``sync`` row's; then what a
    modelled graph store served, where one was."""
    sync = {(r.policy, r.capacity, r.warm): r.total_seconds for r in rows if r.compile_mode == "sync"}
    print_table(title, (*(name for name, _ in columns), "vs sync"),
                [(*(cell(r) for _, cell in columns), f"{r.total_seconds / sync[r.policy, r.capacity, r.warm]:.3f}×")
                 for r in rows], caption=caption)
    stored = [r for r in rows if r.store is not None]
    if stored:
        print_table("graph store: misses after warm-up it served by a load instead of a compile",
                    ("policy", "capacity", "warm", "mode", "compiles", "loads", "load s", "disk evictions"),
                    [(r.policy, "∞" if r.capacity is None else r.capacity, r.warm, r.compile_mode, r.compiles,
                      r.store.loads, r.store.load_seconds, r.store.disk_evictions)
                     for r in stored if r.store is not None])


#: What ``stalls`` runs per --family.
STALLS_LEVELS: dict[Family, type[_Attention] | type[_WholeModel]] = {"attention": _Attention, "model": _WholeModel}
