"""``attnpolicy simulate``: replay a workload with a cost model, policies × capacities × evictions."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from attnpolicy.bench.calibration_cache import Provenance, resolve
from attnpolicy.bench.settings import CalibrationSettings
from attnpolicy.cli.common import (
    add_capacities_arg,
    add_cost_args,
    add_option_arg,
    add_policies_arg,
    add_workload_args,
    by_family,
    byte_list,
    check_evictions,
    check_policies,
    check_writable,
    describe_options,
    fail,
    formed,
    former_from,
    former_options,
    int_list,
    not_taken,
    policy_options,
    positive_int,
    print_table,
    progress,
    settings,
    shown,
    str_list,
    warn,
    writing,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.jsonfile import write_json
from attnpolicy.core.layout import BatchLayout
from attnpolicy.engine.model_specs import spec_config
from attnpolicy.errors import ConfigError, GraphTooLargeError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.bucket_schemes import BucketScheme, bucket_scheme
from attnpolicy.modelling.cost_file import CostFile, Family
from attnpolicy.modelling.ranges import CALL_RANGE, GRAPH_RANGE, STEP_RANGE, M, OutsideRange, Reach, outside_range
from attnpolicy.modelling.simulation import (
    SimRow,
    check_model,
    lower_bounds,
    model_config,
    model_layouts,
    packed_tokens,
    replay_key_streams,
    simulate_layouts,
    simulate_run,
    simulation_config,
    sweep_configs,
)
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.report.plots import plot_sweep
from attnpolicy.report.units import MIB
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch, Workload
from attnpolicy.workloads.layout_stream import LayoutRun, read_layout_stream, select_run
from attnpolicy.workloads.traces import Request, TraceError, load_trace

SIMULATE_POLICIES = ("always-mask", "dynamic", "varlen", "cost-aware")
SIMULATE_CAPACITIES = (2, 4, 8, 16)
SIMULATE_EVICTIONS = ("lru", "belady")
#: Worker processes of a sweep (this machine has 2 cores).
WORKERS = 2


def register(subparsers: Any) -> None:
    from attnpolicy.cli.common import command

    s = command(subparsers, "simulate", "replay a workload with a cost model: policies × capacities × evictions",
                "attnpolicy simulate --limit 20 --policies dynamic,varlen --capacities 4,inf",
                cmd_simulate)
    add_workload_args(s)
    add_sweep_args(s, SIMULATE_POLICIES, SIMULATE_CAPACITIES, SIMULATE_EVICTIONS, ())
    add_store_args(s)
    add_cost_args(s)
    s.add_argument("--config", metavar="PATH",
                   help="base attnpolicy config; its policy_options apply to its own policy only "
                        "(default: derived from the cost model and the batch former)")
    s.add_argument("--layouts", metavar="FILE",
                   help="replay a recorded layout stream (ATTNPOLICY_LAYOUT_LOG) instead of --trace, "
                        "under its recorded config unless --config is given (default: none)")
    s.add_argument("--run", metavar="RUN",
                   help="with --layouts: the run to replay when FILE holds several (default: the only one)")
    s.add_argument("--strict", action="store_true",
                   help="with --layouts: exit 1 unless the row under the recorded config reproduces the "
                        "recorded hits, misses and evictions; that row must be in the sweep (default: off)")
    s.add_argument("--row-buckets", type=int_list, default=None, metavar="N[,N...]",
                   help="the rows a rows graph may hold (row_buckets): a runtime's fixed batch size (e.g. 8) or its "
                        "batch buckets (e.g. 1,8) (default: the base config's, 1,2,4,8,16,32)")
    s.add_argument("--whole-requests", action="store_true",
                   help="with --family model: whole requests (chunked prefill and decode, every step on a step "
                        "graph over a KV cache, as 'run --model' serves them) instead of prefill-only batches "
                        "(default: off)")
    s.add_argument("--json", metavar="PATH", help="write the rows as JSON (default: none)")
    s.add_argument("--plot", metavar="PATH.png",
                   help="plot peak graph MiB vs total seconds per policy and eviction (default: none)")


def add_sweep_args(p: argparse.ArgumentParser, policies: tuple[str, ...], capacities: tuple[int | None, ...],
                   evictions: tuple[str, ...], buckets: tuple[str, ...]) -> None:
    """--policies, --buckets, --capacities, --max-bytes, --evictions, --option and
    --workers (simulate and report); ``buckets`` empty: the base config's."""
    add_policies_arg(p, policies)
    p.add_argument("--buckets", type=str_list, default=buckets, metavar="S[,S...]",
                   help="bucket schemes side by side: pow2 (tt-xla), vllm (vLLM's default capture sizes), "
                        "exact, gaudi-linear, gaudi-exponential, rbln, tpu (those runtimes' prefill lengths), "
                        "or the path of an attnpolicy config (its buckets) "
                        f"(default: {shown(buckets) if buckets else 'the base config’s, pow2'})")
    add_capacities_arg(p, capacities)
    p.add_argument("--max-bytes", type=byte_list, default=None, metavar="B[,B...]",
                   help="graph-cache byte bounds (max_bytes), e.g. 256MiB,1GiB,inf; every capacity × bound "
                        "is a row (default: the base config's, unbounded)")
    p.add_argument("--evictions", type=str_list, default=evictions, metavar="E[,E...]",
                   help="eviction strategies; 'belady' is the offline optimum (the fewest misses any "
                        f"eviction could achieve) (default: {shown(evictions)})")
    add_option_arg(p)
    p.add_argument("--workers", type=positive_int, default=WORKERS, metavar="N",
                   help=f"processes for the dispatcher runs of cache-aware policies (default: {WORKERS})")


#: The store directory a config gets from --store-bytes when it names none.
DEFAULT_STORE_DIR = "attnpolicy_store"


def add_store_args(p: argparse.ArgumentParser) -> None:
    """--store-bytes and --store-warm: model a graph store under the memory cache."""
    p.add_argument("--store-bytes", type=byte_list, default=None, metavar="B",
                   help="model a graph store on disk of B bytes (max_disk_bytes, e.g. 2GiB): a miss of a graph on "
                        "it loads instead of compiling; a config's own store_dir and max_disk_bytes are "
                        "modelled without it (default: none)")
    p.add_argument("--store-warm", action="store_true",
                   help="the store starts with what a previous run of the same traffic and config left on it "
                        "(default: off, an empty store)")


def with_row_buckets(args: argparse.Namespace, base: AttnPolicyConfig) -> AttnPolicyConfig:
    """``base`` with --row-buckets when given (checked: one error line naming the flag)."""
    if args.row_buckets is None:
        return base
    return settings(AttnPolicyConfig, {"row_buckets": "--row-buckets"},
                    **{**base.model_dump(), "row_buckets": args.row_buckets})


def with_store(args: argparse.Namespace, base: AttnPolicyConfig, model: CostModel) -> AttnPolicyConfig:
    """``base`` with the store of --store-bytes (``store_dir`` :data:`DEFAULT_STORE_DIR`
    unless it has one); errors name the flag."""
    if args.store_bytes is not None:
        if len(args.store_bytes) != 1 or args.store_bytes[0] is None:
            fail(f"argument --store-bytes: one bound in bytes, got {args.store_bytes!r}")
        base = base.model_copy(update={"store_dir": base.store_dir or DEFAULT_STORE_DIR,
                                       "max_disk_bytes": args.store_bytes[0]})
        base = AttnPolicyConfig.model_validate(base.model_dump())
    if base.store_dir is None and args.store_warm:
        fail("argument --store-warm: needs a store (--store-bytes, or a config with store_dir)")
    if base.store_dir is not None and not model.knows_store:
        fail(f"argument --store-bytes: {CostModel.__name__} {args.cost_model or 'default'} has no store_load or "
             "store_bytes fits: run attnpolicy calibrate to model a store")
    return base


def schemes(args: argparse.Namespace, base: AttnPolicyConfig) -> list[BucketScheme] | None:
    """The schemes of --buckets (``None`` without it); an error names the flag."""
    if not args.buckets:
        return None
    try:
        return [bucket_scheme(spec, base.max_seq_len, base.max_batch_tokens) for spec in args.buckets]
    except ConfigError as exc:
        fail(f"argument --buckets: {exc}")


def priced(args: argparse.Namespace) -> tuple[CostModel, Provenance]:
    """The cost model of a run and where it comes from: the file of --cost-model (an
    error names the flag), else this machine's newest cached calibration for the
    backend and impl of --config (default: a calibration's), else the built-in model.
    The command prints ``provenance.line()`` first, once its arguments are checked."""
    d = CalibrationSettings()
    backend: str = d.backend
    impl: str = d.impl
    if getattr(args, "config", None):
        try:
            config = AttnPolicyConfig.load(args.config)
            backend, impl = config.backend, config.attn_impl or impl
        except ConfigError:
            pass  # the command reads --config itself and says what is wrong with it
    try:
        model, provenance = resolve(args.cost_model, backend, impl, warn)
    except ConfigError as exc:
        fail(f"argument --cost-model: {exc}")
    return model, provenance


def priced_model(args: argparse.Namespace, *, steps: bool = False, model: str | None = None,
                 flag: str = "--model") -> tuple[ModelCostModel, Provenance]:
    """The whole-model fits of the file of --cost-model and where they come from
    (``--family model`` needs the file; ``steps``: with step-graph fits); ``model``: the
    SPEC of ``flag``, whose model the file must have been calibrated on. Errors name the
    flag, before any work."""
    path = args.cost_model
    if path is None:
        fail("argument --cost-model: --family model needs a cost-model file with whole-model fits (attnpolicy "
             "calibrate --model SPEC --out FILE writes them)")
    try:
        cost = CostFile.load(path).model_fits(path, steps=steps)
        differs = None if model is None else cost.model_differs(spec_config(model), f"{flag} {model}")
    except ConfigError as exc:
        fail(f"argument --cost-model: {exc}")
    if differs:
        fail(f"argument --cost-model: {path} prices another model: {differs} (attnpolicy calibrate --model SPEC "
             "--out FILE calibrates one)")
    return cost, Provenance("file", path)


def check_recorded_spec(model: CostModel, provenance: Provenance, run: LayoutRun) -> None:
    """Refuse (exit 2) a --cost-model file calibrated on another tensor spec than the
    recorded ``run``'s; say it in one warning when the model is not the user's file (this
    machine's calibration or the built-in one: the recorded counts still replay)."""
    differs = model.spec_differs(run.spec)
    if differs is None:
        return
    s = run.spec
    fix = (f"attnpolicy calibrate --dtype {s.dtype} --heads {s.heads} --kv-heads {s.kv_heads} --head-dim "
           f"{s.head_dim} --out FILE calibrates one")
    if provenance.kind == "file":
        fail(f"argument --cost-model: {provenance.file} prices another tensor spec than run {run.run} of the "
             f"layout stream: {differs} ({fix})")
    warn(f"the cost model prices another tensor spec than run {run.run} of the layout stream: {differs}; its "
         f"seconds are not this run's ({fix}, and give it to --cost-model)")


def flag_range(model: M, steps: Sequence[ScheduledBatch | BatchLayout], reach: Reach[M]) -> OutsideRange | None:
    """Warn (one line) when some of ``steps`` are priced outside ``model``'s calibrated
    range in the dimensions of ``reach`` (its level's); returns the count (``None``: the
    range is unknown)."""
    outside = outside_range(model, steps, reach)
    if outside is not None and outside.outside:
        warn(f"{outside.line()}: their seconds are extrapolated ({reach.covers})")
    return outside


def provenance_json(provenance: Provenance, outside: OutsideRange | None) -> dict[str, Any]:
    """The --json fields of the cost model: where it comes from and the batches it
    priced outside its calibrated range."""
    return {"cost_model_provenance": provenance.to_json(),
            "outside_calibrated_range": None if outside is None else outside.to_json()}


def workload(args: argparse.Namespace, former: BatchFormer) -> list[Request]:
    """The requests of --trace/--limit; an empty workload is an error."""
    try:
        requests = load_trace(args.trace, args.limit)
    except TraceError as exc:
        fail(f"argument --trace: {exc}")
    if not requests:
        fail(f"argument --trace: {args.trace!r} holds no requests")
    if not any(former.fits(r) for r in requests):
        longest = min(r.prompt_tokens + r.output_tokens for r in requests)
        fail(f"argument --max-seq-len: every request of {args.trace!r} is longer than {args.max_seq_len} "
             f"tokens (the shortest has {longest}); nothing to run")
    return requests


def note_warmup(base: AttnPolicyConfig, what: str) -> None:
    """Say once that ``base``'s warm set is not simulated (the rows start with an
    empty cache, whatever their buckets and bounds), when it has one."""
    if base.warmup:
        warn(f"the warm-up set of {what} ({len(base.warmup)} graphs) is not simulated: every row starts with an "
             "empty cache, under any --buckets and --capacities ('attnpolicy stalls' models warm-up)")


#: The stateless policies simulated and planned on whole-model graphs by default.
MODEL_POLICIES = ("always-mask", "dynamic", "varlen")
#: The flags of simulate, stalls and plan that whole-model graphs do not take.
ATTENTION_ONLY = ("layouts", "config", "plot", "strict", "option", "warmup_seconds", "store_bytes", "store_warm")


def whole_model_policies(args: argparse.Namespace, default: tuple[str, ...]) -> tuple[str, ...]:
    """--policies on whole-model graphs; left at the command's ``default``: :data:`MODEL_POLICIES`."""
    same = tuple(args.policies) == tuple(default)
    return MODEL_POLICIES if same else tuple(args.policies)


def cmd_simulate(args: argparse.Namespace) -> int:
    check_policies("--policies", args.policies)
    check_writable("--json", args.json)
    check_writable("--plot", args.plot)
    level = by_family(args, SIMULATE_LEVELS)(args)
    if (replayed := level.prepare(args)) is not None:
        return replayed
    requests = workload(args, level.former)
    print(level.provenance.line())
    steps, w = formed(args, level.former, requests)
    fields: dict[str, Any] = {"trace": args.trace, "workload": w.to_json()}
    head, rows = level.sweep(args, steps, w)
    fields |= head | {"rows": [r.to_json() for r in rows]}
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, fields)
    if args.plot:
        with writing("--plot", args.plot):
            plot_sweep(rows, args.plot)
    return 0


class _Attention:
    """``simulate`` on attention calls: a base config (``--config`` or derived), bucket
    schemes, policy options, an optional graph store, or a recorded layout stream."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, self.provenance = priced(args)

    def prepare(self, args: argparse.Namespace) -> int | None:
        """Check the flags of a trace's sweep, before any work; with --layouts, replay
        the recorded run instead (:func:`simulate_recorded`: its exit status)."""
        if args.layouts:
            return simulate_recorded(args, self.model, self.provenance)
        if args.strict:
            fail("argument --strict: compares a replay with its recording, it needs --layouts")
        if args.whole_requests:
            fail("argument --whole-requests: needs --family model (the attention level replays every step already)")
        self.former = former_from(args)
        model = self.model
        base = AttnPolicyConfig.load(args.config) if args.config else simulation_config(model, self.former)
        self.base = with_row_buckets(args, with_store(args, base, model))
        self.options = policy_options(args, "--policies", args.policies, {self.base.policy: self.base.policy_options})
        check_evictions("--evictions", args.evictions, simulation=True)
        check_model(self.base, model)
        self.buckets = schemes(args, self.base)
        return None

    def sweep(self, args: argparse.Namespace, steps: list[ScheduledBatch], w: Workload
              ) -> tuple[dict[str, Any], list[SimRow]]:
        """The rows (printed) and the --json head."""
        model, base, options = self.model, self.base, self.options
        outside = flag_range(model, steps, CALL_RANGE)
        note_warmup(base, f"--config {args.config}")
        with progress(sweep_size(args), "simulate") as advance:
            rows = simulate_layouts(steps, args.policies, args.capacities, args.evictions, base, model,
                                    progress=advance, policy_options=options, rejected=w.rejected,
                                    buckets=self.buckets, max_bytes=args.max_bytes, workers=args.workers,
                                    store_warm=args.store_warm)
        ran = describe_options(options)
        print_sweep(f"simulated {w.admitted} requests of {args.trace} ({w.rejected} rejected, {w.batches} "
                    f"batches), cost model {model.impl}/{model.backend}" + (f", options: {ran}" if ran else ""), rows)
        return {"requests": w.requests, "former": former_options(args),
                "config": base.model_dump(mode="json"), **provenance_json(self.provenance, outside),
                "policy_options": options}, rows


class _WholeModel:
    """``simulate --family model``: the --trace batches (prefill-only, or with
    --whole-requests every engine step on a step graph), the configs derived from the
    cost model and the flags per policy (with its --option), bucket scheme, capacity and
    byte bound."""

    def __init__(self, args: argparse.Namespace) -> None:
        not_taken(args, "with --family model (--trace batches, the config derived from the cost model and the "
                  "flags)", *(flag for flag in ATTENTION_ONLY if flag != "option"))
        self.model, self.provenance = priced_model(args)

    def prepare(self, args: argparse.Namespace) -> None:
        self.former = former_from(args, prefill_only=not args.whole_requests)
        self.options = policy_options(args, "--policies", whole_model_policies(args, SIMULATE_POLICIES))

    def sweep(self, args: argparse.Namespace, steps: list[ScheduledBatch], w: Workload
              ) -> tuple[dict[str, Any], list[SimRow]]:
        """The rows of the batches (printed) and the --json head."""
        whole, former = args.whole_requests, self.former
        cost, max_len = self.model, former.max_model_len
        tokens = packed_tokens(former) if whole else former.max_num_batched_tokens
        layouts = [s.layout for s in steps] if whole else model_layouts(steps)
        head = {"limit": args.limit, "batches": len(layouts), "model": cost.spec, "whole_requests": whole,
                "policy_options": self.options,
                **provenance_json(self.provenance, flag_range(cost, layouts, STEP_RANGE if whole else GRAPH_RANGE))}
        try:
            configs = sweep_configs(with_row_buckets(args, model_config(cost, max_len, tokens)),
                                    whole_model_policies(args, SIMULATE_POLICIES),
                                    args.capacities, max_bytes=args.max_bytes, policy_options=self.options,
                                    buckets=[bucket_scheme(s, max_len, tokens) for s in args.buckets or ("pow2",)])
            rows = replay_key_streams(layouts, cost, configs, args.evictions, steps=whole)
        except (ConfigError, GraphTooLargeError) as exc:
            fail(str(exc))
        what = "engine steps" if whole else "model-graph batches"
        ran = describe_options(self.options)
        print_table(f"simulated {len(layouts)} {what} of {args.trace}, {cost.spec} ({cost.backend}, "
                    f"{cost.clock} s)" + (f", options: {ran}" if ran else ""),
                    ("policy", "buckets", "graphs", "eviction", "distinct", "misses", "evictions", "compile s",
                     "run s", "total s", "peak MiB"),
                    [(r.policy, r.buckets, "∞" if r.capacity is None else r.capacity, r.eviction, r.distinct_keys,
                      r.misses, r.evictions, r.compile_with_warmup_seconds, r.run_seconds, r.total_seconds,
                      r.peak_bytes / MIB)
                     for r in rows])
        return head, rows


#: What ``simulate`` runs per --family.
SIMULATE_LEVELS: dict[Family, type[_Attention] | type[_WholeModel]] = {"attention": _Attention, "model": _WholeModel}


def simulate_recorded(args: argparse.Namespace, model: CostModel, provenance: Provenance) -> int:
    """``simulate --layouts FILE``: replay one recorded run (see docs/vllm.md) and say
    whether the row under the recorded config reproduces the recorded counters."""
    try:
        run = select_run(read_layout_stream(args.layouts), args.run, args.layouts)
    except ConfigError as exc:
        fail(f"argument --layouts: {exc}")
    base = with_store(args, AttnPolicyConfig.load(args.config) if args.config else run.config, model)
    note_warmup(base, f"--config {args.config}" if args.config else f"the recorded config of run {run.run}")
    options = policy_options(args, "--policies", args.policies, {base.policy: base.policy_options})
    check_evictions("--evictions", args.evictions, simulation=True)
    rec = run.config
    recorded_row = (f"{rec.policy} capacity={rec.max_graphs or '∞'} {rec.eviction}"
                    + (f" max_bytes={rec.max_bytes}" if rec.max_bytes is not None else ""))
    why_not = _why_no_recorded_row(args, run.config, options)
    if args.strict and why_not:
        fail(f"argument --strict: the sweep has no row under the recorded config ({recorded_row}): {why_not}")
    check_recorded_spec(model, provenance, run)
    print(provenance.line())
    outside = flag_range(model, run.layouts, CALL_RANGE)
    with progress(sweep_size(args), "simulate") as advance:
        rows = simulate_run(run, args.policies, args.capacities, args.evictions, model, base, advance, options,
                            buckets=schemes(args, base), max_bytes=args.max_bytes, workers=args.workers,
                            store_warm=args.store_warm)
    print_sweep(f"replayed run {run.run} of {args.layouts}: {len(run.steps)} steps, recorded {recorded_row}: "
                f"{run.misses} misses", rows)
    reproduced: bool | None = None
    recorded = ", ".join(f"{n} {c}" for c, n in run.recorded.items())
    if why_not:
        print(f"not compared with the recording: {why_not}")
    else:
        row = next(r for r in rows if (r.policy, r.capacity, r.max_bytes, r.eviction)
                   == (rec.policy, rec.max_graphs, rec.max_bytes, rec.eviction))
        got = {c: getattr(row, c) for c in run.recorded}
        reproduced = got == run.recorded
        if reproduced:
            print(f"reproduced: the row {recorded_row} has the recorded {recorded}")
        else:
            warn(f"not reproduced: the row {recorded_row} has {', '.join(f'{n} {c}' for c, n in got.items())}, "
                 f"the run recorded {recorded} (another attnpolicy version or plugin, or an edited stream)")
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, {"layouts": args.layouts, "run": run.run, "steps": len(run.steps),
                                   "recorded_misses": run.misses, "recorded": run.recorded, "reproduced": reproduced,
                                   "config": base.model_dump(mode="json"), **provenance_json(provenance, outside),
                                   "policy_options": options, "rows": [r.to_json() for r in rows]})
    return 1 if args.strict and not reproduced else 0


def _why_no_recorded_row(args: argparse.Namespace, rec: AttnPolicyConfig,
                         options: dict[str, dict[str, Any]]) -> str | None:
    """Why the sweep of ``args`` holds no row under the recorded config ``rec``, or ``None``."""
    if args.config or args.buckets:
        return "--config or --buckets replace the recorded config"
    if rec.policy not in args.policies:
        return f"add {rec.policy} to --policies"
    if options[rec.policy] != rec.policy_options:
        return f"--option changes the recorded options of {rec.policy}"
    if rec.max_graphs not in args.capacities:
        return f"add {rec.max_graphs or 'inf'} to --capacities"
    if args.max_bytes is not None and rec.max_bytes not in args.max_bytes:
        return f"add {rec.max_bytes or 'inf'} to --max-bytes"
    if rec.eviction not in args.evictions:
        return f"add {rec.eviction} to --evictions"
    return None


def sweep_size(args: argparse.Namespace) -> int:
    """The rows of the sweep the flags ask for."""
    return (max(len(args.buckets), 1) * len(args.policies) * len(args.capacities)
            * len(args.max_bytes or (None,)) * len(args.evictions))


def bounds_cell(capacity: int | None, max_bytes: int | None) -> str:
    """A row's cache bounds: ``8``, ``∞``, ``8, 512 MiB``, ``∞, 512 MiB``."""
    graphs = "∞" if capacity is None else str(capacity)
    return graphs if max_bytes is None else f"{graphs}, {max_bytes / MIB:.4g} MiB"


def print_sweep(title: str, rows: list[SimRow]) -> None:
    """The rows; then each (buckets, policy)'s lower bound, and with several bucket
    schemes their totals side by side."""
    modes = ("causal", "mask", "varlen") + (("rows",) if any(r.modes.get("rows") for r in rows) else ())
    tag = "/".join(m[0] for m in modes)
    print_table(title, ("buckets", "policy", "bound", "eviction", "misses", "hit rate", "compile s",
                        "attention s", "total s", "over lower bound", "peak MiB", f"batches {tag}"),
                [(r.buckets, r.policy, bounds_cell(r.capacity, r.max_bytes), r.eviction, r.misses, r.hit_rate,
                  r.compile_with_warmup_seconds, r.run_seconds, r.total_seconds, f"{r.bound_gap:+.1%}",
                  r.peak_bytes / MIB, "/".join(str(r.modes.get(m, 0)) for m in modes))
                 for r in rows],
                caption=f"bound: max graphs (∞: unbounded), max bytes; batches {tag}: batches run "
                        f"{' / '.join(modes)}; over lower bound: total over attention + every distinct graph "
                        "compiled once")
    print_store(rows)
    bounds = lower_bounds(rows)
    print_table("lower bounds: attention + every distinct graph compiled once (no eviction or bound does better "
                "for these decisions)",
                ("buckets", "policy", "distinct graphs", "attention s", "lower bound s", "best online s",
                 "best belady s"),
                [(b.buckets, b.policy, b.distinct_keys, b.attention_seconds, b.bound_seconds, b.best_online,
                  b.best_belady) for b in bounds],
                caption="best: the lowest total over the sweep's bounds (online: every eviction but belady); "
                        "cost-aware's decisions change with the cache: its bound is the lowest of its rows'")
    names = list(dict.fromkeys(r.buckets for r in rows))
    if len(names) > 1:
        cells = {(r.policy, r.capacity, r.max_bytes, r.eviction, r.buckets): r.total_seconds for r in rows}
        lines = list(dict.fromkeys((r.policy, r.capacity, r.max_bytes, r.eviction) for r in rows))
        print_table("total seconds per bucket scheme (same policy, bound and eviction)",
                    ("policy", "bound", "eviction", *names),
                    [(p, bounds_cell(c, b), e, *(cells.get((p, c, b, e, n)) for n in names))
                     for p, c, b, e in lines])


def print_store(rows: list[SimRow]) -> None:
    """Per row, the memory misses compiled and those the modelled graph store served
    (nothing without a store)."""
    stored = [r for r in rows if r.store is not None]
    if not stored:
        return
    store = stored[0].store
    assert store is not None
    print_table(f"graph store: {store.max_disk_bytes / MIB:.4g} MiB on disk, "
                + ("warm (a previous run's graphs)" if store.warm else "empty at start"),
                ("buckets", "policy", "bound", "eviction", "misses", "compiles", "compile s", "loads", "load s",
                 "disk evictions", "disk peak MiB"),
                [(r.buckets, r.policy, bounds_cell(r.capacity, r.max_bytes), r.eviction, r.misses, r.compiles,
                  r.compile_with_warmup_seconds, r.store.loads, r.store.load_seconds, r.store.disk_evictions,
                  r.store.disk_peak_bytes / MIB) for r in stored if r.store is not None],
                caption="a memory miss of a graph on the disk loads it (load s), any other compiles it and saves "
                        "it there, least recently used out, as the graph store does")
