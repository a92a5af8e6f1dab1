"""``attnpolicy run``: replay a workload with real tensors and real compiles."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from attnpolicy.bench.calibration_cache import Provenance
from attnpolicy.bench.replay import (
    AttentionReplay,
    PrefillReplay,
    ReplayLevel,
    ReplayResult,
    RequestReplay,
    replay,
)
from attnpolicy.bench.settings import BENCH_DTYPES
from attnpolicy.cli.common import (
    add_cost_args,
    add_option_arg,
    add_spec_args,
    add_workload_args,
    by_family,
    check_evictions,
    check_positions,
    check_spec_args,
    check_writable,
    command,
    describe_options,
    fail,
    formed,
    former_from,
    model_spec,
    policy_options,
    positive_int,
    print_table,
    progress,
    warn,
    writing,
)
from attnpolicy.cli.plan import check_plannable, seconds
from attnpolicy.cli.simulate import flag_range, priced_model, workload
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.core.jsonfile import write_json
from attnpolicy.errors import AllocationError, ConfigError
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels.accuracy import TOLERANCE, MaxAbsError
from attnpolicy.modelling.cost_file import Family
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.ranges import GRAPH_RANGE, STEP_RANGE
from attnpolicy.modelling.runtime_sets import (
    GRAPH_SETS_FILE,
    SCHEMES,
    SERVED_SCHEMES,
    GraphSetsFile,
    RuntimeGraphSet,
    scheme_set,
)
from attnpolicy.modelling.simulation import model_layouts
from attnpolicy.modelling.warmup_costs import check_fits
from attnpolicy.planning.replan import DRIFT_THRESHOLD, Replanner
from attnpolicy.planning.scheme_comparison import PLAN_GAUDI
from attnpolicy.report.units import MIB
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch, Workload
from attnpolicy.workloads.traces import Request

DEFAULTS = AttnPolicyConfig.model_fields


def register(subparsers: Any) -> None:
    p = command(subparsers, "run", "replay a workload through the Dispatcher with real tensors and compiles",
                "attnpolicy run --limit 10 --policy varlen --backend aot_eager --check", cmd_run)
    add_workload_args(p)
    add_spec_args(p)
    p.add_argument("--config", metavar="PATH",
                   help="a saved attnpolicy config (directory or file); the flags below override it "
                        "(default: the config defaults)")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="registered policy, see 'attnpolicy policies' (default: the config's, varlen)")
    add_option_arg(p)
    p.add_argument("--max-graphs", type=positive_int, default=None, metavar="N",
                   help="graph-cache capacity (default: the config's, unbounded)")
    p.add_argument("--max-bytes", type=positive_int, default=None, metavar="N",
                   help="graph-cache byte budget (default: the config's, unbounded)")
    p.add_argument("--eviction", default=None, metavar="NAME",
                   help="registered eviction strategy, see 'attnpolicy policies' (default: the config's, lru)")
    p.add_argument("--backend", choices=("inductor", "aot_eager", "eager", "none"), default=None,
                   help="compile backend (default: the config's, inductor)")
    p.add_argument("--impl", choices=("sdpa", "eager", "flash"), default=None,
                   help="attention implementation, attn_impl (default: the config's, sdpa)")
    p.add_argument("--compile-mode", choices=("sync", "background"), default=None,
                   help="compile a missing graph in its batch, or in the background while the call runs on a "
                        "resident larger bucket (default: the config's, sync)")
    p.add_argument("--switch-after", type=positive_int, default=None, metavar="N",
                   help="batches until a background graph switches into the cache (default: the config's, 8)")
    p.add_argument("--store", metavar="DIR", default=None,
                   help="a graph store directory, store_dir: compiled graphs are saved there and later "
                        "runs load them instead of compiling (default: the config's, none)")
    p.add_argument("--check", action="store_true",
                   help="compare every output with the float64 reference and print pass or fail against "
                        f"the dtype's tolerance ({', '.join(f'{d} {TOLERANCE[d]:g}' for d in sorted(BENCH_DTYPES))}) "
                        "(default: off)")
    p.add_argument("--model", type=model_spec, metavar="SPEC", default=None,
                   help="serve whole requests (prefill, chunked prefill, decode) through whole-model graphs of "
                        "SPEC (StaticModelRunner, its KV cache a graph input); --check compares every token with "
                        "transformers' greedy generate and every logit with the eager model (default: none, "
                        "attention calls)")
    p.add_argument("--graph-set", metavar="NAME", default=None,
                   help="with --model: serve whole requests from one graph set, compiled at start (the warm-up, "
                        f"timed), then strict mode: a runtime's default set ({', '.join(SERVED_SCHEMES)}; the "
                        f"ragged {', '.join(s for s in SCHEMES if s not in SERVED_SCHEMES)} do not run here) at the "
                        "workload's limits, or with --plan a set of the plan's table by its label; each step runs in "
                        "that runtime's form and the run reports each figure beside the set's modelled one (with "
                        "--cost-model) (default: none, the policy decides)")
    p.add_argument("--plan", metavar="DIR", default=None,
                   help=f"with --model: a plan --whole-requests directory (its {GRAPH_SETS_FILE}); --graph-set names "
                        f"one of its sets by its row's label, else {PLAN_GAUDI!r} (default: none)")
    p.add_argument("--prefill-only", action="store_true",
                   help="with --model: serve prompts only, each in one step (the workload the model-level "
                        "simulator and --cost-model predict) (default: off, whole requests)")
    add_cost_args(p, by_model=True)
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="with --model: time compiles and runs in process CPU or wall seconds (default: cpu)")
    p.add_argument("--replan-every", type=positive_int, default=None, metavar="N",
                   help="every N batches, measure the drift of the running config on the recent batches and, "
                        "above --replan-threshold, switch to the plan refitted on them, its warm set built in the "
                        "background (default: off)")
    p.add_argument("--replan-window", type=positive_int, default=None, metavar="N",
                   help="with --replan-every: the batches the drift is measured and the plan refitted on "
                        "(default: the last --replan-every)")
    p.add_argument("--replan-threshold", type=seconds, default=DRIFT_THRESHOLD, metavar="D",
                   help=f"with --replan-every: drift above which the refit plan replaces the running one "
                        f"(default: {DRIFT_THRESHOLD})")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON (default: none)")


def config_from(args: argparse.Namespace, max_batch_tokens: int | None = None) -> AttnPolicyConfig:
    """The config of --config and the flags; every name and value checked, errors name
    the flag. ``max_batch_tokens``: the default of that field (else the most keys of a
    packed MASK call)."""
    base = AttnPolicyConfig.load(args.config).model_dump() if args.config else {}
    policy = args.policy or base.get("policy", DEFAULTS["policy"].default)
    own = base.get("policy_options", {}) if base.get("policy", policy) == policy else {}
    options = policy_options(args, "--policy", [policy], {policy: own})[policy]
    if args.eviction is not None:
        check_evictions("--eviction", [args.eviction], simulation=False)
    overrides = {"policy": policy, "policy_options": options, "max_graphs": args.max_graphs,
                 "max_bytes": args.max_bytes, "eviction": args.eviction, "backend": args.backend,
                 "attn_impl": args.impl, "compile_mode": args.compile_mode, "switch_after": args.switch_after,
                 "store_dir": args.store}
    base.update({k: v for k, v in overrides.items() if v is not None})
    base.setdefault("max_seq_len", args.max_seq_len)
    # a packed MASK call's keys are every running sequence's context: as in `simulate`
    base.setdefault("max_batch_tokens", max_batch_tokens or max(DEFAULTS["max_batch_tokens"].default,
                                                                args.max_num_seqs * base["max_seq_len"]))
    try:
        config = jsonfile.validate(AttnPolicyConfig, base, "--config and flags", "config", base.get("version", 1))
    except ConfigError as exc:
        fail(str(exc))
    if args.store is None:  # --store is checked with the outputs
        check_writable(f"--config {args.config} (its store_dir)", config.store_dir, directory=True)
    return config


def replanner_from(args: argparse.Namespace, spec: TensorSpec, config: AttnPolicyConfig) -> Replanner | None:
    """The re-planning of --replan-every (``None`` without it); its other flags need it,
    and ``config``'s policy must be one a plan can refit."""
    if args.replan_every is None:
        if args.replan_window is not None or args.replan_threshold != DRIFT_THRESHOLD:
            fail("argument --replan-window/--replan-threshold: needs --replan-every N")
        return None
    check_plannable("--replan-every", [config.policy], config)
    return Replanner(spec, every=args.replan_every, window=args.replan_window, threshold=args.replan_threshold)


def cmd_run(args: argparse.Namespace) -> int:
    check_writable("--json", args.json)
    check_writable("--store", args.store, directory=True)
    level = by_family(args, RUN_LEVELS, by_model=True)(args)
    requests = workload(args, level.former)
    level.prepare(args)
    steps, w = formed(args, level.former, requests)
    result = level.replay(args, requests, steps)
    rows = level.rows(result, w)
    if result.max_abs_err is not None:
        rows += [("max abs err", result.max_abs_err), ("non-finite values", result.non_finite),
                 ("check", f"{'pass' if result.passed else 'FAIL'} (tolerance {result.tolerance:g})")]
    print_table(level.title(args), ("", "value"), rows)
    if args.json:
        with writing("--json", args.json):
            write_json(args.json, level.json(args, result, w))
    if result.passed is False:
        assert result.tolerance is not None  # a check ran
        error = MaxAbsError(result.max_abs_err or 0.0, result.non_finite or 0)
        warn(f"the check failed: {error.describe(result.tolerance)}; see the table")
        return 1
    return 0


class _Attention:
    """``run``: the workload's attention calls through a dispatcher."""

    def __init__(self, args: argparse.Namespace) -> None:
        for flag, value in {"--cost-model": args.cost_model, "--clock": args.clock,
                            "--prefill-only": args.prefill_only or None, "--graph-set": args.graph_set,
                            "--plan": args.plan}.items():
            if value is not None:
                fail(f"argument {flag}: {value}: needs --model SPEC (without it the run replays attention calls)")
        check_spec_args(args)
        self.config = config_from(args)
        self.former = former_from(args)
        self.spec = TensorSpec(args.dtype, args.heads, args.kv_heads, args.head_dim)

    def prepare(self, args: argparse.Namespace) -> None:
        """The re-planning of --replan-every, checked once the workload is read."""
        self.replanner = replanner_from(args, self.spec, self.config)

    def replay(self, args: argparse.Namespace, requests: list[Request], steps: list[ScheduledBatch]) -> ReplayResult:
        replanner = self.replanner
        with progress(len(steps), "run") as advance:
            return replay(AttentionReplay(requests, self.config, self.spec, check=args.check, steps=steps,
                                          observe=None if replanner is None else replanner.observe), advance)

    def title(self, args: argparse.Namespace) -> str:
        return f"attnpolicy run: {args.trace}, {self.config.policy}"

    def rows(self, result: ReplayResult, w: Workload) -> list[tuple[str, Any]]:
        config, f, replanner = self.config, result.figures, self.replanner
        c = f["cache"]
        rows: list[tuple[str, Any]] = [
            ("policy", config.policy), ("policy options", describe_options({config.policy: config.policy_options})
                                        or "none"),
            ("backend", config.backend), ("requests (rejected)", f"{w.requests} ({w.rejected})"),
            ("batches", result.batches), ("graph calls", f["calls"]),
            ("batches per mode", ", ".join(f"{m} {n}" for m, n in result.modes.items())),
            ("hits / misses", f"{c['hits']} / {c['misses']}"), ("compiles", c["compiles"]), ("loads", c["loads"]),
            ("evictions", c["evictions"]), ("peak graph MiB", c["peak_bytes"] / MIB),
            ("attention s", result.run_seconds), ("compile s", result.compile_seconds),
            ("total s", result.total_seconds),
            ("stall s p50 / p99 / max", " / ".join(f"{f['stalls'][p]:.4g}" for p in ("p50", "p99", "max")))]
        if f["background"]["compile_mode"] == "background":
            rows += background_rows(f["background"])
        rows += store_rows(config, f["disk"])
        if config.warmup:
            rows += [("start-up s (warm set ready)", f["startup_seconds"]),
                     ("warm-up graphs (loaded)", f"{f['warmup_graphs']} ({f['warmup_loads']})"),
                     ("warm-up compile s", f["warmup_seconds"]),
                     ("compiles after warm-up", f["compiles_after_warmup"]),
                     ("strict violations", f["strict_violations"])]
        if replanner is not None:
            sw = f["switch"] or {}
            asked = " / ".join(str(sw[n]) for n in ("requested", "replaced", "switches"))
            if f["switch_at_end"]:  # its builds waited for once the replay had run
                asked += " (1 after the last batch)"
            drifts = ", ".join(f"{c.drift:.3g}" for c in replanner.checks) or "none"
            rows += [("re-plan drift checks", f"{len(replanner.checks)} ({drifts})"),
                     ("switches requested / replaced / applied", asked),
                     ("switch graphs compiled / loaded", f"{sw['compiled']} / {sw['loaded']}"),
                     ("batches served during switches", sw["batches"])]
        return rows

    def json(self, args: argparse.Namespace, result: ReplayResult, w: Workload) -> dict[str, Any]:
        replanner = self.replanner
        return {**result.to_json(), "workload": w.to_json(), **({"replan": replanner.to_json()} if replanner else {})}


def background_rows(b: dict[str, Any]) -> list[tuple[str, Any]]:
    """The table's rows of background compiles ``b`` (a ``background`` figure of the JSON)."""
    done = (f"{b['requested']} requested, {b['switched']} switched, {b['pending']} pending "
            f"({b['compile_seconds']:.4g} s)")
    return [("background compiles", done), ("pad-up calls / tokens", f"{b['pad_up_calls']} / {b['pad_up_tokens']}")]


def store_rows(config: AttnPolicyConfig, disk: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The table's rows of the graph store's figures ``disk`` (none without a store)."""
    if disk is None:
        return []
    return [("store", f"{config.store_dir}: {disk['entries']} graphs, {disk['bytes'] / MIB:.3g} MiB"),
            ("store loads / saves / evictions", f"{disk['hits']} / {disk['saves']} / {disk['evictions']}")]


class _WholeModel:
    """``run --model SPEC`` (``--family model``): whole requests (``--prefill-only``: the
    prefill-only batches) through a runner of SPEC's model; --max-seq-len must fit the
    model's positions."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.replan_every is not None:
            fail("argument --replan-every: re-planning runs attention calls, not --model graphs")
        check_spec_args(args, not_with="--model (the model's own heads and head dim, in float32)")
        self.former = former = former_from(args, prefill_only=args.prefill_only)
        # prefill only: a MASK graph's bucket is of the step's token budget, as in simulate --family model;
        # whole requests: of every running sequence's context too, as at the attention level
        self.config = config = config_from(args, former.max_num_batched_tokens if args.prefill_only else None)
        if args.prefill_only and config.compile_mode == "background":
            fail("argument --prefill-only: builds each batch's graph before it runs, its build timed apart: not "
                 "with compile_mode background (--compile-mode or --config); serve whole requests to compile in the "
                 "background")
        check_positions("--model", args.model, former.max_model_len)
        self.cost = cost = priced_model(args, model=args.model)[0] if args.cost_model else None
        if cost is not None and not args.prefill_only and cost.steps is None:
            fail(f"argument --cost-model: {args.cost_model} holds no step-graph fits, which whole requests run on: "
                 "calibrate it again with attnpolicy calibrate --model SPEC, or add --prefill-only")
        self.clock, self.prefill_only = args.clock or "cpu", args.prefill_only
        if cost is not None and cost.backend != config.backend:
            warn(f"--cost-model was calibrated with backend {cost.backend}, the run uses {config.backend}")
        self.graphs = graphs = graph_set_from(args, former, config.backend)
        if graphs is not None:
            if cost is not None:
                try:
                    check_fits(cost)
                except ConfigError as exc:
                    fail(f"argument --cost-model: {exc}")
            self.config = config.model_copy(update={"strict": "warn"})  # after the warm-up: counted and said

    def prepare(self, args: argparse.Namespace) -> None:
        """Say where the cost model comes from, once the workload is read."""
        if args.cost_model:
            print(Provenance("file", args.cost_model).line())

    def replay(self, args: argparse.Namespace, requests: list[Request], steps: list[ScheduledBatch]) -> ReplayResult:
        """Whole requests, or (--prefill-only) prefill batches, each batch's build timed apart."""
        cost, config, prefill = self.cost, self.config, self.prefill_only
        self.outside = None if cost is None else flag_range(cost, steps, GRAPH_RANGE if prefill else STEP_RANGE)
        try:
            with progress(len(steps), "run --model") as advance:
                level: ReplayLevel[Any] = (
                    PrefillReplay(args.model, model_layouts(steps), config, check=args.check, cost=cost,
                                  clock=self.clock) if prefill else
                    RequestReplay(args.model, requests, steps, config, check=args.check, clock=self.clock, cost=cost,
                                  graphs=self.graphs))
                return replay(level, advance)
        except ConfigError as exc:
            fail(f"argument --model: {exc}")
        except AllocationError as exc:  # the KV cache of the requests that run at once, each at its longest
            fail(f"argument --max-num-seqs/--max-seq-len: {exc}: lower them, or run fewer or shorter requests")

    def title(self, args: argparse.Namespace) -> str:
        return f"attnpolicy run --model: {args.trace}"

    def rows(self, result: ReplayResult, w: Workload) -> list[tuple[str, Any]]:
        config, f, clock = self.config, result.figures, self.clock
        if f.get("graph_set") is not None:
            return self.set_rows(result, w)
        rows: list[tuple[str, Any]] = [
            ("model", f["spec"]), ("policy", config.policy), ("backend", config.backend),
            ("buckets", config.buckets.describe()), ("max graphs", config.max_graphs or "∞"),
            ("batches", result.batches),
            ("batches per mode", ", ".join(f"{m} {n}" for m, n in result.modes.items())),
            *([("requests served", f["requests"]), ("steps with cached context", f["context_steps"])]
              if not self.prefill_only else []),
            ("hits / misses", f"{f['hits']} / {result.misses}"), ("compiles", f["compiles"]),
            ("loads", f["loads"]), ("evictions", f["evictions"]),
            (f"compile s ({clock})", result.compile_seconds), (f"load s ({clock})", result.load_seconds),
            (f"run s ({clock})", result.run_seconds), (f"total s ({clock})", result.total_seconds)]
        if (b := f["background"]) is not None:
            rows += [*background_rows(b), ("eager batches", b["eager_batches"]), ("stall s (wall)", b["stall_seconds"])]
        rows += store_rows(config, f["disk"])
        if (p := result.predicted) is not None:
            rows += [("predicted misses", p.misses), ("predicted compile s", p.compile_seconds + p.warmup_seconds),
                     ("predicted total s", p.total_seconds)]
            rows += [(f"predicted/measured {k}", v) for k, v in result.ratios().items()]
        if result.token_mismatches is not None:
            rows += [("requests whose greedy tokens differ", result.token_mismatches)]
        return rows

    def set_rows(self, result: ReplayResult, w: Workload) -> list[tuple[str, Any]]:
        """A graph set's run: its figures, each measured beside its modelled value."""
        f, clock, m = result.figures, self.clock, result.set_measured()
        g = f["graph_set"]
        p = g["modelled"]
        assert m is not None  # a graph set ran
        rows: list[tuple[str, Any]] = [
            ("model", f["spec"]), ("graph set", f"{g['name']} ({g['peer']}'s form)"),
            ("backend", self.config.backend), ("steps", result.batches), ("requests served", f["requests"]),
            ("forwards per mode", ", ".join(f"{k} {n}" for k, n in result.modes.items())),
            ("strict violations", m["strict_violations"])]
        for name, key, modelled_key, scale in SET_FIGURES:
            value = m[key] / scale
            shown = f"{value:.1%}" if name == "padding" else f"{value:.4g}"
            if p is not None:
                other = p[modelled_key] / scale
                ratio = f", modelled/measured {other / value:.3g}" if value and name != "padding" else ""
                shown = f"{shown} (modelled {f'{other:.1%}' if name == 'padding' else f'{other:.4g}'}{ratio})"
            rows.append((f"{name} ({clock})" if name.endswith(" s") else name, shown))
        rows.append(("build RSS MiB (measured)", m["rss_bytes"] / MIB))
        if result.token_mismatches is not None:
            rows += [("requests whose greedy tokens differ", result.token_mismatches)]
        return rows

    def json(self, args: argparse.Namespace, result: ReplayResult, w: Workload) -> dict[str, Any]:
        outside = self.outside
        return {"trace": args.trace, "limit": args.limit, "workload": w.to_json(),
                "config": self.config.model_dump(mode="json"), **result.to_json(),
                "outside_calibrated_range": None if outside is None else outside.to_json()}


#: A graph set run's figures as its table shows them: label, measured key
#: (:meth:`ReplayResult.set_measured`), modelled key (:class:`WarmupCost`'s JSON), scale.
SET_FIGURES = (("graphs", "graphs", "graphs", 1), ("warm-up s", "warmup_seconds", "warmup_seconds", 1),
               ("run-time compiles", "runtime_compiles", "runtime_compiles", 1),
               ("run-time compile s", "runtime_compile_seconds", "runtime_compile_seconds", 1),
               ("run s", "run_seconds", "run_seconds", 1), ("total s", "total_seconds", "total_seconds", 1),
               ("padding", "padding", "padding", 1),
               ("graph MiB (static estimate)", "estimate_bytes", "peak_bytes", MIB))


def graph_set_from(args: argparse.Namespace, former: BatchFormer, backend: str) -> RuntimeGraphSet | None:
    """The graph set of --graph-set and --plan (``None``: neither), at the workload's
    limits (a plan's must be them); every flag a set replaces refused, naming it."""
    if args.graph_set is None and args.plan is None:
        return None
    taken = {"--policy": args.policy, "--option": args.option or None, "--max-graphs": args.max_graphs,
             "--max-bytes": args.max_bytes, "--eviction": args.eviction, "--compile-mode": args.compile_mode,
             "--prefill-only": args.prefill_only or None, "--config": args.config}
    for flag, value in taken.items():
        if value is not None:
            fail(f"argument {flag}: not taken with --graph-set/--plan (the set's graphs serve every step, in its "
                 "runtime's form; no policy decides and nothing is evicted)")
    limits = PeerLimits.of(former)
    label = args.graph_set or PLAN_GAUDI
    try:
        saved = None if args.plan is None else GraphSetsFile.load(args.plan)
    except ConfigError as exc:
        fail(f"argument --plan: {exc}")
    if saved is not None and saved.peer_limits() != limits:
        fail(f"argument --plan: {args.plan} was planned for {asdict(saved.peer_limits())}, the workload flags "
             f"give {asdict(limits)}: give the plan's --max-num-seqs, --max-num-batched-tokens and --max-seq-len")
    planned = saved is not None and label not in SCHEMES  # a set of the plan's, not a runtime's default
    try:
        peer, warm = saved.chosen(label) if planned and saved is not None else scheme_set(label, limits)
        return RuntimeGraphSet(label, peer, warm, limits, backend)
    except ConfigError as exc:
        fail(f"argument {'--plan' if planned else '--graph-set'}: {exc}")


#: What ``run`` replays per --family.
RUN_LEVELS: dict[Family, type[_Attention] | type[_WholeModel]] = {"attention": _Attention, "model": _WholeModel}
