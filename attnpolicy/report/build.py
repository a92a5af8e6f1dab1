"""Run the report's measurements and write report.json, report.md and the plots.

1. the mask-vs-mask-free table on this machine (``attnpolicy bench``), and every
   registered implementation per call kind against the per-sequence SDPA loop
   (``attnpolicy bench --kernels``; plugins' kernels included);
2. a cost model: calibrated on this machine (a small grid, mean call seconds: what
   the replays of step 4 pay here; reused from the calibration cache when it holds
   one, else calibrated now and kept there), a given file, or the built-in one;
3. the bucket scheme × policy × capacity × eviction sweep on the workload, with
   Belady's bound and the lower bound on total seconds (``attnpolicy simulate``);
4. the simulator checked against real compute on a prefix of the workload:
   predicted vs measured misses and seconds, side by side (``attnpolicy run``);
5. the recommendation: ``attnpolicy plan`` at the sweep's leanest good bound, its
   config saved under ``DIR/config``, named beside the sweep's fastest row and its
   leanest row within 10 % of it (:mod:`~attnpolicy.report.recommend`);
6. with a whole-model cost model (``model_cost``), the warm-up schemes on whole
   requests (``attnpolicy plan --family model --whole-requests``), and the plan and
   the best runtime default measured on a slice of the workload (:func:`measured_slice`).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as validated

from attnpolicy.bench.calibration import calibrate, warm_up
from attnpolicy.bench.calibration_cache import Provenance, lookup, store
from attnpolicy.bench.kernel_timing import KernelRow, bench_kernels
from attnpolicy.bench.mode_timing import MODEL_LENGTHS, AttentionBench, WholeModelBench, ratios, run_bench
from attnpolicy.bench.replay import AttentionReplay, measured_sets, replay
from attnpolicy.bench.settings import BenchSettings, CalibrationSettings
from attnpolicy.cache.key_stream import BELADY
from attnpolicy.core.jsonfile import write_json, write_text_atomic
from attnpolicy.core.names import BACKENDS
from attnpolicy.engine.model_specs import parse_spec
from attnpolicy.errors import AllocationError, ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.bucket_schemes import bucket_scheme
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.peer_buckets import PeerLimits
from attnpolicy.modelling.ranges import CALL_RANGE, outside_range
from attnpolicy.modelling.runtime_sets import GRAPH_SETS_FILE
from attnpolicy.modelling.simulation import (
    SimRow,
    lower_bounds,
    simulate,
    simulate_layouts,
    simulation_config,
)
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.host_settings import GAUDI_FILE
from attnpolicy.planning.scheme_comparison import (
    COMPARISON_COLUMNS,
    PLAN_GAUDI,
    SchemeComparison,
    SchemeRow,
    comparison_table,
    plan_whole_requests,
)
from attnpolicy.planning.warmup_plan import Budget
from attnpolicy.plugins.kernels import kernel_registry
from attnpolicy.report.markdown import markdown
from attnpolicy.report.plots import Marked, plot_bench, plot_hit_rate, plot_sweep
from attnpolicy.report.recommend import NamedRow, recommend
from attnpolicy.report.units import MIB, bound_text
from attnpolicy.workloads.batching import BatchFormer, ScheduledBatch, Workload
from attnpolicy.workloads.traces import Request, load_trace

#: The fixed policies cost-aware is compared with in the summary.
FIXED = ("always-mask", "dynamic", "varlen")


@validated(frozen=True)
class ReportSettings:
    """What ``attnpolicy report`` measures; validated like the config."""

    out: Path = Path("report")
    trace: str = "default"
    limit: Annotated[int | None, Field(ge=1)] = None
    # always-causal is left out: on packed batches the guard turns it into varlen.
    policies: Annotated[tuple[str, ...], Field(min_length=1)] = ("always-mask", "dynamic", "varlen", "cost-aware")
    capacities: Annotated[tuple[Annotated[int, Field(ge=1)] | None, ...], Field(min_length=1)] = (
        2, 4, 8, 16, 32, None)
    evictions: Annotated[tuple[str, ...], Field(min_length=1)] = ("lru", "lfu", "cost", "belady")
    #: Bucket schemes side by side (see attnpolicy.modelling.bucket_schemes).
    buckets: Annotated[tuple[str, ...], Field(min_length=1)] = ("pow2", "vllm", "exact")
    max_bytes: Annotated[tuple[Annotated[int, Field(ge=1)] | None, ...], Field(min_length=1)] = (None,)
    workers: Annotated[int, Field(ge=1)] = 2
    bench: BenchSettings = BenchSettings(repeats=3)
    #: Total tokens of the kernel table's batches (``kernel_seqs`` sequences each);
    #: ``kernel_skip``: implementations left out (e.g. ``flex``, compiled for seconds).
    kernel_lengths: tuple[Annotated[int, Field(ge=1)], ...] = (1024,)
    kernel_seqs: Annotated[int, Field(ge=1)] = 4
    kernel_skip: tuple[str, ...] = ()
    #: A model spec (``attnpolicy bench --model``): adds the whole-model table (MASK and
    #: ROWS vs CAUSAL per ``model_lengths``, compiled with ``model_backend``); off by default.
    model: str | None = None
    model_lengths: Annotated[tuple[Annotated[int, Field(ge=1)], ...], Field(min_length=1)] = MODEL_LENGTHS
    model_backend: str = "inductor"
    cost_model: str | None = None
    #: a cost-model file with whole-model step fits (``attnpolicy calibrate --model SPEC``):
    #: adds the warm-up schemes on whole requests (``plan --family model --whole-requests``)
    model_cost: str | None = None
    #: with ``model_cost``: the first N requests of the workload on which the plan and the
    #: best runtime default are measured (:func:`measured_slice`); 0: nothing measured
    measure_requests: Annotated[int, Field(ge=0)] = 10
    #: the most modelled seconds (the rows' modelled totals) measured on that slice
    measure_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 120.0
    #: calibrate a cost model now (unless ``cost_model`` is given) with ``calibration``;
    #: off: the built-in model
    calibrate: bool = True
    calibration: CalibrationSettings = CalibrationSettings(sizes=(16, 256, 1024, 2048), repeats=2,
                                                            statistic="mean")
    validate_requests: Annotated[int, Field(ge=1)] = 6
    #: Most bucket sizes per candidate list of the plan step (``attnpolicy plan --max-buckets``).
    plan_max_buckets: Annotated[int, Field(ge=1)] = 8
    validate_capacity: Annotated[int, Field(ge=1)] = 4
    #: Policies of the sweep also replayed with real compute (always-mask is left out:
    #: its dense masks over every sequence's context make real decode batches slow).
    validate_policies: tuple[str, ...] = ("dynamic", "varlen", "cost-aware")
    #: :class:`BatchFormer` keyword arguments (default: none, its own defaults, as
    #: ``simulate``, ``plan``, ``stalls`` and ``run``).
    former: dict[str, Any] = dataclasses.field(default_factory=dict)
    policy_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @field_validator("evictions")
    @classmethod
    def _live(cls, evictions: tuple[str, ...]) -> tuple[str, ...]:
        if all(e == BELADY for e in evictions):
            raise ValueError("must hold a live eviction besides belady (the offline bound): the report "
                             "recommends what a runtime can run")
        return evictions

    @model_validator(mode="after")
    def _former(self) -> ReportSettings:
        BatchFormer(**self.former)
        if any(n < self.kernel_seqs for n in self.kernel_lengths):
            raise ValueError(f"kernel_lengths {list(self.kernel_lengths)} must each be >= kernel_seqs "
                             f"{self.kernel_seqs} (one token per sequence at least)")
        if self.model is not None:
            try:
                parse_spec(self.model)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        if self.model_backend not in BACKENDS:
            raise ValueError(f"model_backend must be one of {', '.join(BACKENDS)}, got {self.model_backend!r}")
        known = {info.name for info in kernel_registry().values()}
        unknown = [name for name in self.kernel_skip if name not in known]
        if unknown:
            raise ValueError(f"kernel_skip names no registered implementation: {', '.join(unknown)} "
                             f"(registered: {', '.join(sorted(known))})")
        return self

    @property
    def validated_policies(self) -> tuple[str, ...]:
        return tuple(p for p in self.policies if p in self.validate_policies)

    @property
    def calibrates(self) -> bool:
        """Whether the report calibrates a cost model (``calibrate`` and no ``cost_model``)."""
        return self.calibrate and self.cost_model is None


@dataclass(frozen=True)
class ValidationRow:
    """Predicted (simulate) vs measured (run) on the same prefix, config and batches.

    The replays run in a warm process (the backend's start-up paid before them), so
    the predictions leave out the model's one-off start-up, ``predicted_warmup_seconds``.
    ``*_ratio`` is predicted over measured seconds (``None`` when nothing was measured).
    ``max_abs_err`` (of the values finite in both), ``non_finite`` (values non-finite in
    an output or its reference), ``tolerance`` and ``passed``: the outputs' check against
    the float64 reference."""

    policy: str
    capacity: int
    batches: int
    predicted_misses: int
    measured_misses: int
    predicted_compile_seconds: float
    measured_compile_seconds: float
    predicted_attention_seconds: float
    measured_attention_seconds: float
    predicted_total_seconds: float
    measured_total_seconds: float
    max_abs_err: float | None
    predicted_warmup_seconds: float = 0.0
    compile_ratio: float | None = None
    attention_ratio: float | None = None
    total_ratio: float | None = None
    non_finite: int | None = None
    tolerance: float | None = None
    passed: bool | None = None


@dataclass(frozen=True)
class SummaryRow:
    """The best policy at one capacity (best online eviction); ``vs_best_fixed`` is
    cost-aware's total over the best fixed policy's (``None`` without both)."""

    capacity: int | None
    best_policy: str
    total_seconds: float
    vs_best_fixed: float | None


def known_model(s: ReportSettings, warn: Callable[[str], None]) -> tuple[CostModel, Provenance] | None:
    """The report's cost model when nothing need be measured: the file of ``cost_model``
    (a problem raises :class:`ConfigError`), this machine's cached calibration with
    ``calibration``'s grid, or (``calibrate`` off) the built-in model; ``None``: the
    report calibrates now. ``warn`` says a cache file that cannot be read."""
    if s.calibrates:
        hit = lookup(s.calibration, warn)
        return None if hit is None else (hit.model, Provenance("calibrated", str(hit.path), hit.created))
    return _uncalibrated(s)


def _uncalibrated(s: ReportSettings) -> tuple[CostModel, Provenance]:
    """The model of a report that does not calibrate: ``cost_model``'s file or the built-in one."""
    if s.cost_model:
        return CostFile.load(s.cost_model).attention_fits(s.cost_model), Provenance("file", s.cost_model)
    return CostModel.default(), Provenance("built-in")


def _model(s: ReportSettings, progress: Callable[[str], None], known: tuple[CostModel, Provenance] | None
           ) -> tuple[CostModel, Provenance, str]:
    """The report's model, its provenance and its description: ``known``, else
    calibrated now (and kept in the calibration cache)."""
    c = s.calibration
    sizes = ",".join(map(str, c.sizes)) if c.sizes else f"up to {c.max_len}"
    grid = f"sizes {sizes}, {c.repeats} rounds, {c.statistic} call seconds, backend {c.backend}"
    if known is None and not s.calibrates:
        known = _uncalibrated(s)
    if known is None:
        model = calibrate(c)
        progress("calibrated")
        try:
            cached = store(c, model)
        except OSError as exc:
            return model, Provenance("calibrated"), (f"calibrated now on this machine ({grid}); not kept in the "
                                                     f"calibration cache: {exc}")
        return model, Provenance("calibrated", str(cached.path), cached.created), (
            f"calibrated now on this machine ({grid}), kept in {cached.path}")
    model, provenance = known
    if provenance.kind == "calibrated":
        progress("calibration reused")
        return model, provenance, f"calibrated here {provenance.created} ({grid}), {provenance.file}"
    if provenance.kind == "file":
        return model, provenance, f"loaded from {provenance.file}"
    return model, provenance, "built-in (attnpolicy/data/default_costmodel.json)"


def kernel_table(s: ReportSettings, progress: Callable[[str], None]) -> list[KernelRow]:
    """Every registered implementation per call kind (plugins' included) against the
    per-sequence SDPA loop, on each of ``s.kernel_lengths`` (``bench --kernels``)."""
    rows = []
    for total in s.kernel_lengths:
        rows += bench_kernels(total, s.kernel_seqs, heads=s.bench.heads, kv_heads=s.bench.kv_heads,
                              head_dim=s.bench.head_dim, repeats=s.bench.repeats, skip=s.kernel_skip)
        progress(f"kernels {s.kernel_seqs}x{total // s.kernel_seqs}")
    return rows


def validate_predictions(model: CostModel, requests: Sequence[Request], s: ReportSettings,
                         progress: Callable[[str], None]) -> list[ValidationRow]:
    """Predicted (simulate) vs measured (run) on the same prefix, config and batches,
    in a warm process (:func:`~attnpolicy.bench.calibration.warm_up` first)."""
    former = BatchFormer(**s.former)
    steps = list(former.steps(requests))
    rows = []
    torch.set_num_threads(model.threads)
    warm_up(model.backend)
    for policy in s.validated_policies:
        config = simulation_config(model, former, policy=policy, max_graphs=s.validate_capacity,
                                   policy_options=s.policy_options.get(policy, {}))
        (predicted,) = simulate(requests, [policy], [s.validate_capacity], ["lru"], config, model, s.former)
        measured = replay(AttentionReplay(requests, config, model.spec, steps=steps, check=True, cost_model=model))
        warm = predicted.warmup_seconds
        compile_s, total_s = predicted.compile_seconds, predicted.total_seconds - warm
        rows.append(ValidationRow(
            policy=policy, capacity=s.validate_capacity, batches=len(steps),
            predicted_misses=predicted.misses, measured_misses=measured.misses,
            predicted_compile_seconds=compile_s,
            measured_compile_seconds=measured.compile_seconds,
            predicted_attention_seconds=predicted.run_seconds,
            measured_attention_seconds=measured.run_seconds,
            predicted_total_seconds=total_s,
            measured_total_seconds=measured.total_seconds,
            max_abs_err=measured.max_abs_err,
            predicted_warmup_seconds=warm,
            compile_ratio=_ratio(compile_s, measured.compile_seconds),
            attention_ratio=_ratio(predicted.run_seconds, measured.run_seconds),
            total_ratio=_ratio(total_s, measured.total_seconds),
            non_finite=measured.non_finite, tolerance=measured.tolerance, passed=measured.passed))
        progress(f"validated {policy}")
    return rows


def _ratio(predicted: float, measured: float) -> float | None:
    return predicted / measured if measured > 0 else None


def best_by_policy(rows: Sequence[SimRow]) -> dict[tuple[str, int | None], SimRow]:
    """Per (policy, capacity): the row of the best online eviction (not belady), over
    the first bucket scheme's rows without a byte bound."""
    best: dict[tuple[str, int | None], SimRow] = {}
    first = rows[0].buckets if rows else None
    for row in rows:
        if row.eviction == "belady" or row.buckets != first or row.max_bytes is not None:
            continue
        k = (row.policy, row.capacity)
        if k not in best or row.total_seconds < best[k].total_seconds:
            best[k] = row
    return best


def summarize(rows: Sequence[SimRow]) -> list[SummaryRow]:
    best = best_by_policy(rows)
    out = []
    for cap in dict.fromkeys(r.capacity for r in rows):
        at = {p: r for (p, c), r in best.items() if c == cap}
        if not at:
            continue
        winner = min(at.values(), key=lambda r: r.total_seconds)
        fixed = [at[p].total_seconds for p in FIXED if p in at]
        out.append(SummaryRow(cap, winner.policy, winner.total_seconds,
                              at["cost-aware"].total_seconds / min(fixed)
                              if fixed and "cost-aware" in at else None))
    return out


def marked(row: NamedRow) -> Marked:
    """A first-screen row as the plots mark it."""
    return Marked(row.name, f"{row.policy}, {row.buckets}, {bound_text(row.capacity, row.max_bytes)}, {row.eviction}",
                  row.peak_bytes / MIB, row.total_seconds, row.peak_graphs, row.capacity, row.max_bytes, row.hit_rate)


def whole_requests(s: ReportSettings, requests: Sequence[Request], steps: Sequence[ScheduledBatch],
                   former: BatchFormer, progress: Callable[[str], None]) -> dict[str, Any]:
    """The warm-up schemes on the workload's whole requests (its ``steps`` of
    ``requests``), priced by the step fits of the cost-model file ``s.model_cost``
    (``attnpolicy plan --family model --whole-requests``, its graph sets, host settings
    and bucketing file written under ``s.out / "whole_requests"``), with
    :func:`measured_slice`, as report.json holds them."""
    path, out = s.model_cost, s.out / "whole_requests"
    assert path is not None
    model = CostFile.load(path).model_fits(path, steps=True)
    limits = PeerLimits.of(former)
    gaudi_file = out / GAUDI_FILE
    comparison, settings = plan_whole_requests([st.layout for st in steps], limits, model, Budget(),
                                               s.plan_max_buckets, str(gaudi_file.resolve()))
    progress("planned whole requests")
    sliced = measured_slice(s, model, requests, former, progress)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(gaudi_file, settings.gaudi_file)
    write_json(out / "host_settings.json", settings.sections)
    write_json(out / GRAPH_SETS_FILE, comparison.graph_sets())
    return {"cost_model": path, "model": model.spec, "limits": asdict(limits), "dir": str(out),
            "columns": list(COMPARISON_COLUMNS), "table": comparison_table(comparison), **comparison.to_json(),
            "measured_slice": sliced}


def measured_slice(s: ReportSettings, model: ModelCostModel, requests: Sequence[Request], former: BatchFormer,
                   progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Section 5 measured on a slice (``None``: ``s.measure_requests`` is 0): the first
    ``s.measure_requests`` of ``requests`` in ``former``'s steps, planned as the section
    plans the workload; its :data:`PLAN_GAUDI` and then the runtime default of the lowest
    modelled total that this runner serves (:meth:`SchemeComparison.measurable`), each
    run on the slice (:func:`~attnpolicy.bench.replay.measured_sets`, the cost model's
    own model) while the modelled totals of the rows measured stay within
    ``s.measure_seconds``. Each row says what it measured or why it stays modelled."""
    if not s.measure_requests:
        return None
    sliced = list(requests[:s.measure_requests])
    steps = list(former.steps(sliced))
    limits = PeerLimits.of(former)
    comparison, _ = plan_whole_requests([st.layout for st in steps], limits, model, Budget(), s.plan_max_buckets)
    rows = _slice_rows(comparison)
    chosen, why, spent = [], {}, 0.0
    for row in rows:
        assert row.cost is not None  # the plan, and a measurable default
        total = row.cost.total_seconds
        if row.refused is not None:
            why[row.scheme] = f"vllm-gaudi refuses its bucketing file: {row.refused}"
        elif spent + total > s.measure_seconds:
            why[row.scheme] = (f"measured, the rows would reach {spent + total:.4g} modelled s, over the budget "
                               f"of {s.measure_seconds:g} (--measure-seconds)")
        else:
            chosen.append(row)
            spent += total
    try:
        measured = measured_sets(model.spec, chosen, limits, sliced, steps, model, former)
    except (ConfigError, AllocationError) as exc:  # the report keeps its work: the rows stay modelled, saying why
        measured = {}
        why.update({row.scheme: f"the run failed: {exc}" for row in chosen})
    progress(f"measured {len(measured)} warm-up schemes on {len(sliced)} requests")

    def row_json(row: SchemeRow) -> dict[str, Any]:
        assert row.cost is not None
        m, c = measured.get(row.scheme), row.cost
        return {"scheme": row.scheme, "modelled": c.to_json(), "measured": m, "left_modelled": why.get(row.scheme),
                "modelled_over_measured": (c.total_seconds / m["total_seconds"]
                                           if m is not None and m["total_seconds"] > 0 else None)}
    return {"requests": len(sliced), "steps": len(steps), "limits": asdict(limits), "model": model.spec,
            "backend": model.backend, "budget_seconds": s.measure_seconds,
            "rows": [row_json(r) for r in rows]}


def _slice_rows(comparison: SchemeComparison) -> list[SchemeRow]:
    """The rows :func:`measured_slice` measures, in order: :data:`PLAN_GAUDI`, then the
    :meth:`~SchemeComparison.measurable` default of the lowest modelled total (if any)."""
    plan = next(r for r in comparison.rows if r.scheme == PLAN_GAUDI)
    defaults = [r for r in comparison.measurable() if r.default and r.cost is not None]
    best = min(defaults, key=lambda r: r.cost.total_seconds if r.cost else 0.0, default=None)
    return [plan, *([best] if best is not None else [])]


def make_report(s: ReportSettings, command: str, progress: Callable[[str], None],
                requests: Sequence[Request] | None = None,
                known: tuple[CostModel, Provenance] | None = None) -> dict[str, Any]:
    """Measure, then write ``report.json``, ``report.md`` and the PNGs under ``s.out``;
    returns the JSON data. ``requests``: the workload if already loaded; ``known``:
    the cost model if already found (:func:`known_model`; ``None``: calibrate now
    when ``s.calibrates``, else as :func:`known_model`)."""
    start = time.perf_counter()
    if requests is None:
        requests = load_trace(s.trace, s.limit)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    attention = AttentionBench(s.bench)
    bench_rows = run_bench(attention, progress)
    kernel_rows = kernel_table(s, progress)
    whole_model = None if s.model is None else WholeModelBench(s.model, s.model_lengths, backend=s.model_backend,
                                                               repeats=s.bench.repeats, threads=None)
    model_bench = None if whole_model is None else whole_model.to_json(run_bench(whole_model, progress))
    model, provenance, source = _model(s, progress, known)
    former = BatchFormer(**s.former)
    base = simulation_config(model, former)
    schemes = [bucket_scheme(b, base.max_seq_len, base.max_batch_tokens) for b in s.buckets]
    steps = list(former.steps(requests))
    outside = outside_range(model, steps, CALL_RANGE)
    workload = Workload.of(len(requests), former, len(steps))
    if workload.rejected and not workload.admitted:
        raise ConfigError(f"{workload.why_rejected}: nothing to report (raise max_model_len or check the trace)")
    sweep = simulate_layouts(steps, s.policies, s.capacities, s.evictions, base, model, progress=progress,
                             policy_options=s.policy_options, rejected=workload.rejected, buckets=schemes,
                             max_bytes=s.max_bytes, workers=s.workers)
    validation = validate_predictions(model, requests[:s.validate_requests], s, progress)
    workload_name = s.trace + ("" if s.limit is None else f" (first {s.limit} requests)")
    rec, plan, frontier = recommend(steps, sweep, base, model, s.policies, s.evictions, validation, s.out,
                                    s.plan_max_buckets, workload_name, schemes, workload)
    progress(f"planned {rec.policy}")
    whole = None if s.model_cost is None else whole_requests(s, requests, steps, former, progress)
    bench_speedups = ratios(bench_rows, attention.measure)
    s.out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "command": command,
        "settings": {**asdict(s), "out": str(s.out), "bench": asdict(s.bench)},
        "env": env,
        "bench": {**attention.to_json(bench_rows),
                  "env": {"dtype": s.bench.dtype, "heads": s.bench.heads, "kv_heads": s.bench.kv_heads,
                          "head_dim": s.bench.head_dim, "impl": s.bench.impl, "repeats": s.bench.repeats,
                          "threads": s.bench.threads}},
        "kernels": {"rows": [asdict(r) for r in kernel_rows], "seqs": s.kernel_seqs, "skip": list(s.kernel_skip)},
        "model_bench": model_bench,
        "cost_model_source": source,
        "cost_model_provenance": provenance.to_json(),
        "outside_calibrated_range": None if outside is None else outside.to_json(),
        "cost_model": model.model_dump(mode="json", exclude={"samples"}),
        "workload": workload.to_json(),
        "sweep": [r.to_json() for r in sweep],
        "summary": [asdict(r) for r in summarize(sweep)],
        "bounds": [asdict(b) for b in lower_bounds(sweep)],
        "validation": [asdict(v) for v in validation],
        "recommendation": rec.to_json(),
        "frontier": frontier.to_json(),
        "whole_requests": whole,
        "plan": [{"policy": p.policy, "buckets": list(p.buckets), "eviction": p.eviction,
                  "total_seconds": p.row.total_seconds, "peak_bytes": p.row.peak_bytes,
                  "base_lru_seconds": p.baseline("lru").total_seconds,
                  "base_belady_seconds": p.baseline("belady").total_seconds} for p in plan.policies],
    }
    marks = [marked(row) for row in frontier.rows]
    plots = [plot_sweep(sweep, s.out / "frontier.png", marks), plot_hit_rate(sweep, s.out / "hit_rate.png", marks),
             plot_bench(bench_speedups, s.out / "bench.png")]
    data["plots"] = [asdict(p) for p in plots]
    data["seconds"] = time.perf_counter() - start
    write_json(s.out / "report.json", data)
    write_text_atomic(s.out / "report.md", markdown(data) + "\n")
    return data
