"""The whole-model-graph forms of ``calibrate``, ``simulate``, ``stalls`` and ``plan``
(``calibrate --model SPEC``, ``simulate --model-cost FILE``, ``stalls --model-cost FILE``,
``plan --model-cost FILE``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnpolicy.cli.common import (
    check_writable,
    console,
    fail,
    formed,
    former_from,
    print_table,
    progress,
    settings,
    warn,
    writing,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.core.layout import BatchLayout
from attnpolicy.engine.model_specs import max_positions
from attnpolicy.errors import ConfigError, GraphTooLargeError
from attnpolicy.modelling.bucket_schemes import bucket_scheme
from attnpolicy.modelling.model_costmodel import ModelCostModel
from attnpolicy.modelling.model_simulation import (
    ModelSimRow,
    model_config,
    model_layouts,
    simulate_model,
)
from attnpolicy.modelling.model_stalls import ModelStallRow, compare_model_stalls
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.ranges import model_outside_range
from attnpolicy.planning.host_settings import GAUDI_FILE, host_settings
from attnpolicy.planning.model_plan import plan_model_graphs
from attnpolicy.workloads.batching import BatchFormer, Workload
from attnpolicy.workloads.traces import TraceError, load_trace

DEFAULT_MODEL_COSTMODEL_PATH = "attnpolicy_model_costmodel.json"
#: The stateless policies simulated and planned on model graphs by default.
MODEL_POLICIES = ("always-mask", "dynamic", "varlen")


def cmd_calibrate_model(args: argparse.Namespace, default_out: str) -> int:
    from attnpolicy.bench.model_calibration import ModelCalibrationSettings, calibrate_model, grid

    out = DEFAULT_MODEL_COSTMODEL_PATH if args.out == default_out else args.out
    check_writable("--out", out)
    s = settings(ModelCalibrationSettings, {"spec": "--model"}, spec=args.model, backend=args.backend,
                 sizes=tuple(args.sizes) if args.sizes else None, repeats=args.repeats, threads=args.threads,
                 clock=args.clock or "cpu", quick=args.quick)
    try:
        with progress(len(grid(s)) + s.repeats, "calibrate --model") as advance:
            model = calibrate_model(s, advance)
    except ConfigError as exc:
        fail(f"argument --model: {exc}")
    with writing("--out", out):
        path = model.save(out)
    rows = []
    for x in model.samples:
        key = x.key(model.backend)
        rows.append((x.mode, "+".join(map(str, x.segments)), x.compile_seconds, model.compile_seconds(key),
                     x.run_seconds * 1e3, model.run_seconds(key) * 1e3, x.rss_bytes / 2**20,
                     x.estimate_bytes / 2**20))
    print_table(f"model cost model, {model.spec}, {model.backend}, {model.clock} seconds, "
                f"{model.threads} thread(s)",
                ("mode", "buckets", "compile s", "model s", "run ms", "model ms", "RSS MiB", "estimate MiB"), rows)
    console.print(f"the first compile in the process paid {model.warmup_seconds:.3g} s more (warmup_seconds); "
                  f"wrote {path}")
    return 0


def load_model_cost(path: str) -> ModelCostModel:
    """The model of --model-cost; an error names the flag."""
    try:
        return ModelCostModel.load(path)
    except ConfigError as exc:
        fail(f"argument --model-cost: {exc}")


def flag_model_range(model: ModelCostModel, path: str, layouts: Sequence[BatchLayout]) -> dict[str, Any]:
    """Warn (one line) when some of ``layouts`` are priced outside ``model``'s calibrated
    range; returns the JSON fields of the cost model (provenance and that count)."""
    outside = model_outside_range(model, layouts)
    if outside is not None and outside.outside:
        warn(f"{outside.line()}: their seconds are extrapolated ('attnpolicy calibrate --model SPEC --sizes' "
             "covers larger graphs)")
    return {"cost_model_provenance": {"kind": "file", "file": path, "created": None},
            "outside_calibrated_range": None if outside is None else outside.to_json()}


def model_workload(args: argparse.Namespace, former: BatchFormer) -> tuple[list[BatchLayout], Workload]:
    """The prefill-only batches ``former`` (``former_from(args, prefill_only=True)``)
    makes of --trace/--limit, and what it made of the trace (printed after the line
    naming --model-cost, when given; rejections warned about)."""
    try:
        requests = load_trace(args.trace, args.limit)
    except TraceError as exc:
        fail(f"argument --trace: {exc}")
    if not any(former.fits(r) for r in requests):
        fail(f"argument --trace: no request of {args.trace!r} fits --max-seq-len {former.max_model_len}")
    if args.model_cost:
        print(f"cost model: {args.model_cost} (--model-cost)")
    steps, w = formed(args, former, requests)
    return model_layouts(steps), w


def _attention_only(args: argparse.Namespace) -> None:
    """Refuse the flags of simulate and plan that model graphs do not take."""
    if args.layouts:
        fail("argument --layouts: a recorded layout stream holds attention batches; with --model-cost the "
             "workload is --trace (prefill only)")
    if args.config:
        fail("argument --config: with --model-cost the config is derived from the model cost model and the flags")
    for flag in ("plot", "strict", "option", "warmup_seconds"):
        if getattr(args, flag, None):
            fail(f"argument --{flag.replace('_', '-')}: not taken with --model-cost")


def _policies(args: argparse.Namespace, default: tuple[str, ...]) -> tuple[str, ...]:
    return MODEL_POLICIES if tuple(args.policies) == tuple(default) else tuple(args.policies)


def print_model_rows(title: str, rows: list[ModelSimRow]) -> None:
    print_table(title, ("policy", "buckets", "graphs", "eviction", "distinct", "misses", "evictions",
                        "compile s", "run s", "total s", "peak MiB"),
                [(r.policy, r.buckets, "∞" if r.max_graphs is None else r.max_graphs, r.eviction, r.graphs,
                  r.misses, r.evictions, r.compile_seconds + r.warmup_seconds, r.run_seconds, r.total_seconds,
                  r.peak_bytes / 2**20) for r in rows])


def cmd_simulate_model(args: argparse.Namespace, default_policies: tuple[str, ...]) -> int:
    check_writable("--json", args.json)
    _attention_only(args)
    former = former_from(args, prefill_only=True)
    model = load_model_cost(args.model_cost)
    layouts, w = model_workload(args, former)
    fields = flag_model_range(model, args.model_cost, layouts)
    schemes = args.buckets or ("pow2",)
    configs = []
    max_len, tokens = former.max_model_len, former.max_num_batched_tokens
    try:
        for policy in _policies(args, default_policies):
            for scheme in schemes:
                buckets = bucket_scheme(scheme, max_len, tokens).buckets
                for capacity in args.capacities:
                    configs += [model_config(model, max_len, tokens, policy=policy,
                                             buckets=buckets, max_graphs=capacity, max_bytes=max_bytes)
                                for max_bytes in args.max_bytes or (None,)]
        rows = simulate_model(layouts, model, configs, args.evictions)
    except (ConfigError, GraphTooLargeError) as exc:
        fail(str(exc))
    print_model_rows(f"simulated {len(layouts)} model-graph batches of {args.trace}, {model.spec} "
                     f"({model.backend}, {model.clock} s)", rows)
    return _write_rows(args, layouts, w, model, rows, fields)


def _write_rows(args: argparse.Namespace, layouts: list[BatchLayout], w: Workload, model: ModelCostModel,
                rows: list[ModelSimRow] | list[ModelStallRow], fields: dict[str, Any]) -> int:
    """Write ``rows`` to --json, if given, with the workload, the model and its ``fields``
    (:func:`flag_model_range`)."""
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, {"trace": args.trace, "limit": args.limit, "batches": len(layouts),
                                   "workload": w.to_json(), "model": model.spec, **fields,
                                   "rows": [r.to_json() for r in rows]})
    return 0


def cmd_stalls_model(args: argparse.Namespace, default_policies: tuple[str, ...], default_warm: tuple[str, ...]
                     ) -> int:
    """``stalls --model-cost FILE``: sync against background compiles on whole-model graphs."""
    check_writable("--json", args.json)
    for flag in ("config", "cost_model"):
        if getattr(args, flag):
            fail(f"argument --{flag.replace('_', '-')}: not taken with --model-cost (the config is derived "
                 "from the model cost model and the flags)")
    if tuple(args.warm) != tuple(default_warm):
        fail("argument --warm: not taken with --model-cost (no warm-up is modelled)")
    former = former_from(args, prefill_only=True)
    model = load_model_cost(args.model_cost)
    layouts, w = model_workload(args, former)
    priced = flag_model_range(model, args.model_cost, layouts)
    fields = {} if args.switch_after is None else {"switch_after": args.switch_after}
    try:
        configs = [model_config(model, former.max_model_len, former.max_num_batched_tokens, policy=policy,
                                max_graphs=capacity, **fields)
                   for policy in _policies(args, default_policies) for capacity in args.capacities]
        rows = compare_model_stalls(layouts, model, configs)
    except (ConfigError, GraphTooLargeError) as exc:
        fail(str(exc))
    print_model_stalls(f"modelled {len(layouts)} model-graph batches of {args.trace}, {model.spec} "
                       f"({model.backend}), switch_after={rows[0].switch_after}", rows)
    return _write_rows(args, layouts, w, model, rows, priced)


def print_model_stalls(title: str, rows: list[ModelStallRow]) -> None:
    sync = {(r.policy, r.capacity): r.total_seconds for r in rows if r.compile_mode == "sync"}
    print_table(title, ("policy", "capacity", "mode", "compiles", "pad-ups", "eager", "stalled", "stall p99 s",
                        "stall s", "total s", "vs sync"),
                [(r.policy, "∞" if r.capacity is None else r.capacity, r.compile_mode, r.compiles, r.padded_up,
                  r.eager_served, f"{r.stalled_batches}/{r.batches}", r.stall_p99, r.stall_seconds,
                  r.total_seconds, f"{r.total_seconds / sync[r.policy, r.capacity]:.3f}×") for r in rows],
                caption="total: run seconds as served (padded up or eager) + stalls, modelled")


def cmd_plan_model(args: argparse.Namespace, default_policies: tuple[str, ...]) -> int:
    check_writable("--out", args.out, directory=True)
    _attention_only(args)
    former = former_from(args, prefill_only=True)
    model = load_model_cost(args.model_cost)
    layouts, w = model_workload(args, former)
    fields = flag_model_range(model, args.model_cost, layouts)
    evictions = [e for e in args.evictions if e != "belady"]
    try:
        base = model_config(model, former.max_model_len, former.max_num_batched_tokens,
                            max_graphs=args.max_graphs, max_bytes=args.max_bytes)
        with progress(None, "plan --model-cost") as advance:
            plan = plan_model_graphs(layouts, base, model, _policies(args, default_policies), evictions,
                                     args.max_buckets, advance, args.align)
    except ConfigError as exc:
        fail(str(exc))
    out = Path(args.out)
    source = args.trace + (f" (first {args.limit} requests)" if args.limit else "")
    with writing("--out", out):
        plan.config.save(out)
        write_json(out / "plan.json", {"source": source, "model": model.spec, "batches": len(layouts),
                                       "rejected": w.rejected, "workload": w.to_json(), **fields,
                                       **plan.to_json()})
        write_host_settings(out, layouts, plan.chosen.buckets, plan.config, former.max_num_batched_tokens,
                            former.max_num_seqs, args.max_buckets)
    cap = "∞" if args.max_graphs is None else args.max_graphs
    print_table(f"attnpolicy plan on model graphs: {source}, {model.spec}, max_graphs {cap}",
                ("policy", "buckets", "eviction", "plan s", "pow2 lru s", "pow2 belady s", "× lru", "× belady"),
                [(p.policy + (" *" if p is plan.chosen else ""), ",".join(map(str, p.buckets)), p.row.eviction,
                  p.row.total_seconds, p.base_lru.total_seconds, p.base_belady.total_seconds,
                  p.base_lru.total_seconds / p.row.total_seconds,
                  p.base_belady.total_seconds / p.row.total_seconds) for p in plan.policies],
                caption="* chosen")
    print(f"wrote {out / 'attnpolicy_config.json'}, {out / 'plan.json'}, {out / 'host_settings.json'}")
    return 0


def write_host_settings(out: Path, steps: Sequence[BatchLayout], buckets: Sequence[int], config: AttnPolicyConfig,
                        max_num_batched_tokens: int, max_num_seqs: int, max_buckets: int) -> Path:
    """``host_settings.json`` next to ``plan.json``, and vllm-gaudi's bucketing file next to
    it: each host's settings from the planned ``steps`` and ``buckets`` (at most
    ``--max-buckets`` sizes per dimension) for a server of ``--max-num-batched-tokens``,
    ``--max-num-seqs`` and ``config``'s ``max_seq_len``."""
    path, gaudi = out / "host_settings.json", out / GAUDI_FILE
    settings = host_settings(steps, buckets, PeerLimits(max_num_seqs, max_num_batched_tokens, config.max_seq_len),
                             max_buckets, str(gaudi.resolve()))
    write_text_atomic(gaudi, settings.gaudi_file)
    write_json(path, settings.sections)
    return path



def cmd_run_model(args: argparse.Namespace, former: BatchFormer, config: AttnPolicyConfig) -> int:
    """``run --model SPEC``: the prefill-only batches of ``former`` through a runner of
    SPEC's model under ``config``; --max-seq-len must fit the model's positions."""
    from attnpolicy.bench.model_replay import TOLERANCE, replay_model

    positions = max_positions(args.model)
    if positions is not None and former.max_model_len > positions:
        fail(f"argument --max-seq-len: {former.max_model_len} is more than the {positions} positions of --model "
             f"{args.model}: set --max-seq-len {positions} or less")
    cost = load_model_cost(args.model_cost) if args.model_cost else None
    clock = args.clock or "cpu"
    if cost is not None and cost.backend != config.backend:
        warn(f"--model-cost was calibrated with backend {cost.backend}, the run uses {config.backend}")
    layouts, w = model_workload(args, former)
    try:
        with progress(len(layouts), "run --model") as advance:
            result = replay_model(args.model, layouts, config, check=args.check, cost=cost, clock=clock,
                                  progress=advance)
    except ConfigError as exc:
        fail(f"argument --model: {exc}")
    rows: list[tuple[str, object]] = [
        ("model", result.spec), ("policy", config.policy), ("backend", config.backend),
        ("buckets", config.buckets.describe()), ("max graphs", config.max_graphs or "∞"),
        ("batches", result.batches), ("batches per mode", ", ".join(f"{m} {n}" for m, n in result.modes.items())),
        ("hits / misses", f"{result.hits} / {result.misses}"), ("evictions", result.evictions),
        (f"compile s ({result.clock})", result.compile_seconds), (f"run s ({result.clock})", result.run_seconds),
        (f"total s ({result.clock})", result.total_seconds)]
    if result.predicted is not None:
        p = result.predicted
        rows += [("predicted misses", p.misses), ("predicted compile s", p.compile_seconds + p.warmup_seconds),
                 ("predicted total s", p.total_seconds)]
        rows += [(f"predicted/measured {k}", v) for k, v in result.ratios().items()]
    if result.max_abs_err is not None:
        rows += [("max abs err", result.max_abs_err),
                 ("check", f"{'pass' if result.passed else 'FAIL'} (tolerance {TOLERANCE:g})")]
    print_table(f"attnpolicy run --model: {args.trace}", ("", "value"), rows)
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, {"trace": args.trace, "limit": args.limit, "workload": w.to_json(),
                                   "config": config.model_dump(mode="json"),
                                   **result.to_json()})
    if result.passed is False:
        warn(f"max abs err {result.max_abs_err:.3g} exceeds the tolerance {TOLERANCE:g}")
        return 1
    return 0
