"""A plan fitted on the first half of a trace, evaluated on the second half, with and without re-planning.

For each capacity: the plan fitted on the first half's batches; its modelled total on
the second half (no re-planning); the re-planned total (the drift of the first-half
plan is measured on the first ``--window`` of the second half; above the threshold,
the plan refitted on that window serves the rest, its graphs compiled in line from a
cold cache, so the switch is charged in full); and pow2 buckets with LRU and with
Belady's offline eviction on the second half. Modelled seconds (compile + run)::

    python benchmarks/replan_halves.py --trace PATH [--capacities 4,8,16] [--window 0.1]
"""

from __future__ import annotations

import argparse

from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.simulation import simulation_config
from attnpolicy.planning.call_table import CallTable
from attnpolicy.planning.graph_set import layouts_of, plan_graphs, with_fields
from attnpolicy.planning.replan import DRIFT_THRESHOLD, measure_drift, modelled_row
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import load_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument("--policy", default="varlen")
    parser.add_argument("--capacities", default="4,8,16")
    parser.add_argument("--window", type=float, default=0.1, help="fraction of the second half refitted on")
    parser.add_argument("--threshold", type=float, default=DRIFT_THRESHOLD)
    args = parser.parse_args(argv)
    model = CostModel.default()
    former = BatchFormer()
    steps = layouts_of(list(former.steps(load_trace(args.trace))))
    half = len(steps) // 2
    first, second = steps[:half], steps[half:]
    cut = max(1, int(len(second) * args.window))
    window, rest = second[:cut], second[cut:]
    base0 = with_fields(simulation_config(model, former), policy=args.policy)
    print(f"{args.trace}: {len(steps)} batches; fitted on {len(first)}, evaluated on {len(second)} "
          f"(refit on the first {cut}); policy {args.policy}, drift threshold {args.threshold}")
    print("| max graphs | drift | plan (no re-plan) | re-planned | pow2 + LRU | pow2 + Belady "
          "| re-planned vs Belady |")
    print("|---|---|---|---|---|---|---|")
    table = CallTable(second, args.policy, base0, model)
    for capacity in (int(c) for c in args.capacities.split(",")):
        base = with_fields(base0, max_graphs=capacity)
        fit = plan_graphs(first, base, model, [args.policy]).config
        kept = modelled_row(second, fit, model).total_seconds
        drift = measure_drift(window, fit, model, [args.policy], threshold=args.threshold)
        if drift.replan:
            replanned = (drift.current.total_seconds
                         + modelled_row(rest, drift.refit.config, model).total_seconds)
        else:
            replanned = kept
        lru, belady = (r.total_seconds for r in table.rows(base, ["lru", "belady"], "pow2"))
        print(f"| {capacity} | {drift.drift:.3f} | {kept:.4g} | {replanned:.4g} | {lru:.4g} | {belady:.4g} "
              f"| {belady / replanned:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
