"""``attnpolicy plan``: choose buckets, policy, eviction and warm set from a workload."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attnpolicy.cache.key_stream import BELADY
from attnpolicy.cli.common import (
    add_cost_args,
    add_workload_args,
    by_family,
    check_evictions,
    check_policies,
    check_positions,
    check_writable,
    command,
    fail,
    formed,
    former_from,
    former_options,
    model_spec,
    not_taken,
    positive_int,
    print_table,
    progress,
    shown,
    source_name,
    str_list,
    warn,
    writing,
)
from attnpolicy.cli.simulate import (
    ATTENTION_ONLY,
    add_store_args,
    check_recorded_spec,
    flag_range,
    priced,
    priced_model,
    provenance_json,
    whole_model_policies,
    with_store,
    workload,
)
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import AllocationError, ConfigError, PolicyError
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.cost_file import Family
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.peer_coverage import (
    PEER_COLUMNS,
    PEER_LEGEND,
    PEER_TITLE,
    PeerCoverage,
    peer_coverage,
    table_rows,
)
from attnpolicy.modelling.ranges import CALL_RANGE, GRAPH_RANGE, STEP_RANGE
from attnpolicy.modelling.runtime_sets import GRAPH_SETS_FILE
from attnpolicy.modelling.simulation import (
    check_model,
    model_config,
    model_layouts,
    simulation_config,
)
from attnpolicy.modelling.warmup_costs import check_fits
from attnpolicy.planning.bucket_search import ALIGN
from attnpolicy.planning.graph_set import (
    PLAN_EVICTIONS,
    PLAN_POLICIES,
    AttentionPlanLevel,
    GraphPlan,
    WholeModelPlanLevel,
    evaluated,
    graph_uses,
    layouts_of,
    plan_graphs,
    plan_markdown,
    plannable,
)
from attnpolicy.planning.host_settings import GAUDI_FILE, host_settings
from attnpolicy.planning.sample import SAMPLE, WINDOWS, sample_steps
from attnpolicy.planning.scheme_comparison import (
    COMPARISON_COLUMNS,
    COMPARISON_LEGEND,
    COMPARISON_TITLE,
    SchemeComparison,
    plan_whole_requests,
)
from attnpolicy.planning.scheme_comparison import comparison_table as comparison_rows
from attnpolicy.planning.warmup_plan import Budget, Grid
from attnpolicy.report.markdown import table
from attnpolicy.workloads.batching import Workload
from attnpolicy.workloads.layout_stream import read_layout_stream, select_run


def seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def batches(text: str) -> int:
    """argparse type: a number of batches >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of batches >= 0, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    p = command(subparsers, "plan", "plan buckets, policy, eviction and warm-up set from a workload",
                "attnpolicy plan --limit 100 --max-graphs 8 --out plan", cmd_plan)
    add_workload_args(p)
    p.add_argument("--layouts", metavar="FILE",
                   help="plan a recorded layout stream (ATTNPOLICY_LAYOUT_LOG) instead of --trace (default: none)")
    p.add_argument("--run", metavar="RUN",
                   help="with --layouts: the run to plan when FILE holds several (default: the only one)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where to write attnpolicy_config.json, plan.md and plan.json (required)")
    p.add_argument("--max-graphs", type=positive_int, default=None, metavar="N",
                   help="graph-cache capacity the plan must live in (default: unbounded)")
    p.add_argument("--max-bytes", type=positive_int, default=None, metavar="B",
                   help="graph-cache byte budget (the cost model's graph bytes) (default: unbounded)")
    p.add_argument("--warmup-seconds", type=seconds, default=None, metavar="S",
                   help="warm-up budget in modelled compile seconds (default: as many graphs as the capacity holds)")
    p.add_argument("--policies", type=str_list, default=PLAN_POLICIES, metavar="P[,P...]",
                   help=f"stateless policies to plan, the best is chosen (default: {shown(PLAN_POLICIES)})")
    p.add_argument("--evictions", type=str_list, default=PLAN_EVICTIONS, metavar="E[,E...]",
                   help=f"live eviction strategies to try (default: {shown(PLAN_EVICTIONS)})")
    add_store_args(p)
    p.add_argument("--max-buckets", type=positive_int, default=16, metavar="K",
                   help="most bucket sizes per candidate list, and most vLLM capture sizes in host_settings.json "
                        "(default: 16)")
    p.add_argument("--align", type=positive_int, default=ALIGN, metavar="N",
                   help="planned buckets are multiples of N, or max_seq_len (max_batch_tokens for a MASK call's "
                        f"packed rows) where that is smaller (default: {ALIGN})")
    p.add_argument("--sample", type=batches, default=SAMPLE, metavar="N",
                   help=f"plan on N batches in {WINDOWS} evenly spaced windows when the workload has more, then "
                        f"evaluate the plan on every batch (default: {SAMPLE}; 0: plan on every batch)")
    add_cost_args(p)
    p.add_argument("--whole-requests", action="store_true",
                   help="with --family model: plan prompt and decode graphs together on whole requests (chunked "
                        "prefill and decode steps) as vllm-gaudi buckets under one budget (--max-graphs, "
                        "--max-bytes, --warmup-seconds), every step within the limits served after warm-up, and "
                        "price them beside the runtimes' own warm-up sets (default: off, prefill graphs only)")
    p.add_argument("--measure", type=model_spec, metavar="SPEC", default=None,
                   help="with --whole-requests: run each scheme's set that runs here (not a ragged one, not one its "
                        "host refuses, not pow2 nor plan @ NAME) on the planned steps through whole-model graphs of "
                        "SPEC, the model --cost-model was calibrated on, warm-up first, and add its measured CPU "
                        "seconds beside the modelled ones (default: off, every row modelled)")
    p.add_argument("--config", metavar="PATH",
                   help="base attnpolicy config (backend, impl, limits); the plan replaces its policy, buckets, "
                        "capacity, eviction, strict and warmup (default: derived from the cost model and the "
                        "batch former, or the recorded config with --layouts)")


def _base(args: argparse.Namespace, default: AttnPolicyConfig) -> AttnPolicyConfig:
    """The base config at the flags' capacity, without a warm set (the plan chooses
    its own: a previous plan's need not fit the new capacity or buckets)."""
    try:
        base = AttnPolicyConfig.load(args.config) if args.config else default
    except ConfigError as exc:
        fail(f"argument --config: {exc}")
    data = {**base.model_dump(mode="json"), "max_graphs": args.max_graphs, "max_bytes": args.max_bytes,
            "warmup": []}
    try:
        return jsonfile.validate(AttnPolicyConfig, data, "--config and flags", "config", 1)
    except ConfigError as exc:
        fail(str(exc))


def cmd_plan(args: argparse.Namespace) -> int:
    check_policies("--policies", args.policies)
    check_writable("--out", args.out, directory=True)
    level = by_family(args, PLAN_LEVELS)
    if args.whole_requests:
        return level.whole_requests(args)
    if args.measure is not None:
        fail("argument --measure: needs --family model --whole-requests (it runs the whole-request schemes' sets)")
    planning = level(args)
    steps, w = planning.workload(args)
    plan = planning.plan(args, steps, w)
    out = Path(args.out)
    with writing("--out", out):
        plan.config.save(out)
        peers = write_host_settings(out, planning.layouts, plan.chosen.buckets, plan.config, *planning.limits,
                                    args.max_buckets)
        write_json(out / "plan.json", {**planning.head, **plan.to_json(), **planning.tail,
                                       "peers": [p.to_json() for p in peers]})
        if planning.markdown is not None:
            write_text_atomic(out / "plan.md", planning.markdown + peers_markdown(peers))
    print_plan(plan, planning.title, planning.baseline, planning.caption)
    if planning.note:
        print(planning.note)
    print_table(PEER_TITLE, PEER_COLUMNS, table_rows(peers))
    print(f"wrote {out / 'attnpolicy_config.json'}, " + "".join(f"{out / name}, " for name in planning.files)
          + f"{out / 'host_settings.json'}")
    return 0


class _Attention:
    """``plan`` on attention calls: the base config of --config (or the recorded run's
    with --layouts, or derived), a plan on a sample evaluated on every batch, a warm-up
    set and plan.md."""

    files = ("plan.md", "plan.json")
    limits: tuple[int, int]  # host settings' max_num_batched_tokens, max_num_seqs

    @staticmethod
    def whole_requests(args: argparse.Namespace) -> int:
        fail("argument --whole-requests: needs --family model (whole-model graphs priced by a cost-model file)")

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, self.provenance = priced(args)
        check_evictions("--evictions", args.evictions, simulation=False)
        self.note, self.tail = "", dict[str, Any]()
        self.spec: TensorSpec | None = None

    def workload(self, args: argparse.Namespace) -> tuple[list[Any], Workload | None]:
        """The steps to plan (of --layouts or the workload flags) and their workload (none: recorded)."""
        if args.layouts:
            try:
                run = select_run(read_layout_stream(args.layouts), args.run, args.layouts)
            except ConfigError as exc:
                fail(f"argument --layouts: {exc}")
            base, self.spec, self.source = _base(args, run.config), run.spec, f"{args.layouts} run {run.run}"
            check_plannable("--policies", args.policies, base)
            check_recorded_spec(self.model, self.provenance, run)
            self.base = with_store(args, base, self.model)
            check_step_budget(run.layouts, former_options(args)["max_num_batched_tokens"])
            print(self.provenance.line())
            return run.layouts, None
        former = former_from(args)
        base = _base(args, simulation_config(self.model, former))
        try:
            check_model(base, self.model)
        except ConfigError as exc:
            fail(f"argument --config: {exc}")
        check_plannable("--policies", args.policies, base)
        self.base = with_store(args, base, self.model)
        self.source = source_name(args)
        requests = workload(args, former)
        print(self.provenance.line())
        return formed(args, former, requests)

    def plan(self, args: argparse.Namespace, steps: list[Any], w: Workload | None) -> GraphPlan:
        """The plan of a sample of ``steps`` (:func:`sample_steps`), evaluated on all of them."""
        outside = flag_range(self.model, steps, CALL_RANGE)
        planned, sample = sample_steps(steps, args.sample)
        rejected = w.rejected if w else 0
        try:
            with progress(None, "plan") as advance:
                plan = plan_graphs(planned, self.base, AttentionPlanLevel(self.model, self.spec, rejected),
                                   args.policies, args.evictions, args.warmup_seconds, args.max_buckets, advance,
                                   args.store_warm, args.align)
                full = evaluated(steps, plan.config, self.model, self.spec, rejected) if sample else None
        except ConfigError as exc:
            fail(str(exc))
        if sample and full:
            self.note = (f"{sample.describe()}; the plan on all {sample.of}: {full.total_seconds:.4g} modelled s "
                         f"(--sample 0 plans on every batch)")
            self.tail = {"sample": {**sample.to_json(), "row": full.to_json()}}
        if plan.max_bytes is not None and plan.chosen.row.peak_graphs == 0:
            smallest = min(g.bytes for g in graph_uses(planned, plan.config, self.model, self.spec))
            warn(f"--max-bytes {plan.max_bytes}: no graph of this plan fits (the smallest needs {smallest} bytes); "
                 "the config caches nothing and every call compiles")
        self.head = {"source": self.source, "rejected": rejected, **({"workload": w.to_json()} if w else {}),
                     **provenance_json(self.provenance, outside)}
        limits = former_options(args)
        self.layouts, self.limits = layouts_of(steps), (limits["max_num_batched_tokens"], limits["max_num_seqs"])
        note = self.note
        self.markdown = plan_markdown(plan, self.source, w) + (f"\n{note[0].upper()}{note[1:]}.\n" if note else "")
        self.title, self.baseline = f"attnpolicy plan: {self.source}", plan.base_buckets
        self.caption = plan_caption(plan)
        return plan


class _WholeModel:
    """``plan --family model``: prefill batches of the workload flags, the config derived
    from the cost model and the flags, no warm-up set and no plan.md."""

    files = ("plan.json",)
    limits: tuple[int, int]
    note, markdown, baseline, caption = "", None, "pow2", "* chosen"

    @staticmethod
    def whole_requests(args: argparse.Namespace) -> int:
        return cmd_plan_whole_requests(args)

    def __init__(self, args: argparse.Namespace) -> None:
        not_taken(args, "with --family model (prefill-only --trace batches, the config derived from the cost "
                  "model and the flags)", *ATTENTION_ONLY)
        self.model, self.provenance = priced_model(args)
        self.tail: dict[str, Any] = {}

    def workload(self, args: argparse.Namespace) -> tuple[list[Any], Workload]:
        self.former = former_from(args, prefill_only=True)
        requests = workload(args, self.former)
        print(self.provenance.line())
        return formed(args, self.former, requests)

    def plan(self, args: argparse.Namespace, steps: list[Any], w: Workload | None) -> GraphPlan:
        """The plan of each policy (:func:`whole_model_policies`) on the prefill batches of ``steps``."""
        layouts, former = model_layouts(steps), self.former
        fields = provenance_json(self.provenance, flag_range(self.model, layouts, GRAPH_RANGE))
        try:
            base = model_config(self.model, former.max_model_len, former.max_num_batched_tokens,
                                max_graphs=args.max_graphs, max_bytes=args.max_bytes)
            with progress(None, "plan --family model") as advance:
                plan = plan_graphs(layouts, base, WholeModelPlanLevel(self.model),
                                   whole_model_policies(args, PLAN_POLICIES),
                                   [e for e in args.evictions if e != BELADY], None, args.max_buckets, advance,
                                   align=args.align)
        except ConfigError as exc:
            fail(str(exc))
        self.title = f"attnpolicy plan on model graphs: {source_name(args)}, {self.model.spec}"
        assert w is not None
        self.head = {"source": source_name(args), "model": self.model.spec, "batches": len(layouts),
                     "rejected": w.rejected, "workload": w.to_json(), **fields}
        self.layouts, self.limits = layouts, (former.max_num_batched_tokens, former.max_num_seqs)
        return plan


def cmd_plan_whole_requests(args: argparse.Namespace) -> int:
    """``plan --family model --whole-requests``: the joint prompt and decode plan and the
    model-level comparison of warm-up schemes, each row's set run with ``--measure``
    (plan.md, plan.json, graph_sets.json, host_settings.json, vllm-gaudi's bucketing file)."""
    why = "with --whole-requests (steps of the batch former, priced by the cost model's step fits)"
    not_taken(args, why, *(name for name in ATTENTION_ONLY if name != "warmup_seconds"))
    for name, default in (("policies", PLAN_POLICIES), ("evictions", PLAN_EVICTIONS), ("align", ALIGN),
                          ("sample", SAMPLE)):
        value = getattr(args, name)
        if (tuple(value) if isinstance(value, list) else value) != default:
            fail(f"argument --{name}: not taken {why}")
    cost, provenance = priced_model(args, steps=True, model=args.measure, flag="--measure")
    try:
        check_fits(cost)
    except ConfigError as exc:
        fail(f"argument --cost-model: {exc}")
    former = former_from(args)
    if args.measure is not None:
        check_positions("--measure", args.measure, former.max_model_len)
    requests = workload(args, former)
    print(provenance.line())
    steps, w = formed(args, former, requests)
    layouts = layouts_of(steps)
    fields = provenance_json(provenance, flag_range(cost, layouts, STEP_RANGE))
    limits = PeerLimits.of(former)
    out = Path(args.out)
    gaudi_file = out / GAUDI_FILE
    try:
        with progress(None, "plan --whole-requests"):
            comparison, settings = plan_whole_requests(
                layouts, limits, cost, Budget(args.max_graphs, args.max_bytes, args.warmup_seconds),
                args.max_buckets, str(gaudi_file.resolve()))
    except ConfigError as exc:
        fail(str(exc))
    if args.measure is not None:
        from attnpolicy.bench.replay import measured_sets  # torch: only when measuring (plan itself needs none)
        rows = comparison.measurable()
        try:
            with progress(len(rows) * len(steps), "plan --measure") as advance:
                measured = measured_sets(args.measure, rows, limits, requests, steps, cost, former, advance)
        except ConfigError as exc:
            fail(f"argument --measure: {exc}")
        except AllocationError as exc:  # the KV cache of the requests that run at once, each at its longest
            fail(f"argument --max-num-seqs/--max-seq-len: {exc}: lower them, or plan fewer or shorter requests")
        comparison = comparison.with_measured(measured)
    source = source_name(args)
    with writing("--out", out):
        write_text_atomic(gaudi_file, settings.gaudi_file)
        write_json(out / "host_settings.json", settings.sections)
        write_json(out / GRAPH_SETS_FILE, comparison.graph_sets())
        write_json(out / "plan.json", {"source": source, "model": cost.spec, "steps": len(layouts),
                                       "rejected": w.rejected, "workload": w.to_json(), **fields,
                                       "limits": asdict(limits), "measure": args.measure, **comparison.to_json()})
        write_text_atomic(out / "plan.md", requests_markdown(comparison, source, cost.spec, w, args.measure))
    print_table(f"attnpolicy plan on whole requests: {source}, {cost.spec}", COMPARISON_COLUMNS,
                comparison_rows(comparison), caption=comparison.summary())
    for plan in comparison.plans:
        for line in plan.outside:
            warn(f"outside the budget: {line}")
    print(f"wrote {out / 'plan.md'}, {out / 'plan.json'}, {out / GRAPH_SETS_FILE}, {out / 'host_settings.json'}, "
          f"{gaudi_file}")
    return 0


def requests_markdown(comparison: SchemeComparison, source: str, spec: str, w: Workload,
                      measure: str | None = None) -> str:
    """plan.md of ``plan --whole-requests``: the recommendation, the comparison (``measure``:
    the SPEC its measured column ran), the plans' sizes."""
    gaudi, ragged = comparison.plans
    g = gaudi.grid
    assert isinstance(g, Grid)
    outside = [*gaudi.outside, *ragged.outside]
    prompt = (f"prompt query tokens {list(g.queries)} × context blocks {list(g.contexts)}" if g.queries
              else "no prompt graph")
    decode = f"decode batches {list(g.batches)} × blocks {list(g.blocks)}" if g.batches else "no decode graph"
    return "\n".join([
        f"# attnpolicy plan on whole requests: {source}", "",
        f"Model {spec}; {w.describe()}.", "", comparison.summary() + ".", "",
        f"## {COMPARISON_TITLE}", "", COMPARISON_LEGEND, "",
        *([f"Measured with `--measure {measure}` on this machine.", ""] if measure else []),
        table(COMPARISON_COLUMNS, comparison_rows(comparison)),
        "", "## The plan's sizes", "",
        (f"- gaudi form (`{GAUDI_FILE}`, host_settings.json \"gaudi\"; \"rbln\" its decode batches): {prompt}; "
         f"{decode} ({len(gaudi.warm.graphs)} graphs)."),
        (f"- ragged form (host_settings.json \"tpu\" and \"vllm\"): token paddings "
         f"{list(ragged.warm.prefill_lengths())} ({len(ragged.warm.graphs)} graphs)."), "",
        *([("Outside the budget (also in each host's `missing` in host_settings.json, the gaudi form's in "
                f"`{GAUDI_FILE}`):"), "",
           *(f"- {line}" for line in outside), ""] if outside else
          ["Every step within the limits is served after warm-up in both forms: nothing compiles at run time.",
           ""])])


def write_host_settings(out: Path, steps: Sequence[BatchLayout], buckets: Sequence[int], config: AttnPolicyConfig,
                        max_num_batched_tokens: int, max_num_seqs: int, max_buckets: int
                        ) -> tuple[PeerCoverage, ...]:
    """``host_settings.json`` next to ``plan.json``, and vllm-gaudi's bucketing file next to
    it: each host's settings from the planned ``steps`` and ``buckets`` (at most
    ``--max-buckets`` sizes per dimension) for a server of ``--max-num-seqs``,
    ``--max-num-batched-tokens`` and ``config``'s ``max_seq_len``. Returns how the
    peers' default warm sets and those of these settings serve ``steps``."""
    gaudi, limits = out / GAUDI_FILE, PeerLimits(max_num_seqs, max_num_batched_tokens, config.max_seq_len)
    settings = host_settings(steps, buckets, limits, max_buckets, str(gaudi.resolve()))
    write_text_atomic(gaudi, settings.gaudi_file)
    write_json(out / "host_settings.json", settings.sections)
    return peer_coverage(settings.forwards, settings.warmup_sets())


def peers_markdown(peers: Sequence[PeerCoverage]) -> str:
    """The coverage table as the last section of ``plan.md``."""
    return f"\n## {PEER_TITLE}\n\n{PEER_LEGEND}\n\n{table(PEER_COLUMNS, table_rows(peers))}\n"


def check_step_budget(layouts: Sequence[BatchLayout], budget: int) -> None:
    """Refuse (exit 2) a recorded step with more tokens than ``--max-num-batched-tokens``:
    vLLM's sizes in host_settings.json are chosen under that budget."""
    for i, layout in enumerate(layouts):
        if layout.q_tokens > budget:
            fail(f"argument --max-num-batched-tokens: step {i} of the recorded run holds {layout.q_tokens} tokens, "
                 f"more than {budget}; give the recorded run's step budget")


def check_plannable(flag: str, policies: Sequence[str], base: AttnPolicyConfig) -> None:
    """Refuse (exit 2, naming ``flag``) a policy whose graph set cannot be planned."""
    for name in policies:
        try:
            plannable(name, base)
        except (ConfigError, PolicyError) as exc:
            fail(f"argument {flag}: {exc}")


def print_plan(plan: GraphPlan, title: str, base: str, caption: str) -> None:
    """Each policy's plan against the ``base`` buckets with LRU and with Belady, under
    ``title`` (the capacity added)."""
    cap = "∞" if plan.max_graphs is None else plan.max_graphs
    rows = []
    for p in plan.policies:
        planned = ",".join(str(b) for b in p.buckets if b not in p.cover)
        rows.append((p.policy + (" *" if p.policy == plan.policy else ""),
                     planned + (f" +{','.join(map(str, p.cover))}" if p.cover else ""), p.eviction,
                     p.row.total_seconds, p.base_lru.total_seconds, p.base_belady.total_seconds, p.vs_lru,
                     p.vs_belady))
    print_table(f"{title}, max_graphs {cap}",
                ("policy", "buckets", "eviction", "plan s", f"{base} lru s", f"{base} belady s", "× lru", "× belady"),
                rows, caption=caption)


def plan_caption(plan: GraphPlan) -> str:
    """The caption of an attention plan's table: the cover and the warm-up set."""
    return ("* chosen; +N: a cover bucket (max_seq_len, max_batch_tokens) no planned call uses; "
            f"warm-up set: {len(plan.warm)} graphs, {plan.warm_compile_seconds:.3g} modelled compile s"
            + (f", {plan.warm_load_seconds:.3g} load s" if plan.config.store_dir is not None else ""))


#: What ``plan`` runs per --family.
PLAN_LEVELS: dict[Family, type[_Attention] | type[_WholeModel]] = {"attention": _Attention, "model": _WholeModel}
