"""The model-level comparison of warm-up schemes on one workload of whole requests:
the peers' own sets, pow2, the host settings of the plan, and the joint plan at
the budget asked and at each peer's own graph count and warm-up seconds, every
row priced by one rule (:mod:`~attnpolicy.modelling.warmup_costs`).

Rows:

- ``gaudi-linear``, ``gaudi-exponential``, ``rbln``, ``tpu``: each peer's default
  warm set for the server's limits, its steps run as that peer runs them;
- ``vllm``: vLLM's piecewise graphs at its capture sizes (steps run ragged, as tpu);
- ``pow2``: the plan's form (vllm-gaudi buckets) with powers of two on every
  dimension: prompt query tokens from 16, context blocks from 1 (and 0), decode
  batches from 1 and blocks from 1, each up to the maxima (coverage as the plan's);
- ``plan (gaudi form)``, ``plan (ragged form)``: the plan under the budget asked, as
  vllm-gaudi buckets and as a ragged peer's token paddings
  (:func:`~attnpolicy.planning.warmup_plan.plan_forms`);
- ``plan @ NAME (FORM)``: the plan re-planned under NAME's graph count and warm-up
  seconds, in the form NAME's host runs (vllm-gaudi: the gaudi form; tpu-inference,
  vLLM: the ragged form; vllm-rbln, which takes neither: the better of the two);
- the host settings' sets, such as ``rbln-plan``: what a peer warms up under the
  plan's ``host_settings.json``;
- ``floor``: no scheme's bound, every step one ragged forward at its own tokens with no
  padding and no warm-up: no warm set runs the workload for less under this rule.

Each row says which bound of the budget asked its warm set breaks, if any. The
recommendation (and each host's best row) is the lowest total among the rows a host
runs, from the files the plan writes or by default, within that budget: ``pow2`` and
``plan @ NAME`` are comparisons that no file sets up, and a plan its host refuses (a
vllm-gaudi bucketing file without a prompt or decode bucket) is not one a host runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    Peer,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    WorkloadForwards,
    gaudi_file_warmup,
    peer_of,
)
from attnpolicy.modelling.runtime_sets import GraphSetsFile, why_not_runnable
from attnpolicy.modelling.warmup_costs import Pricing, WarmupCost, vllm_warmup, warmup_cost
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.host_settings import GAUDI_FILE, GaudiBuckets, HostSettings, PlannedForms, host_settings
from attnpolicy.planning.warmup_plan import Budget, Grid, PeerPlan, plan_forms, plan_warmup, top_grid

#: The label of the plan's row in the gaudi form: the plan's set this runner serves.
PLAN_GAUDI = "plan (gaudi form)"
#: The hosts that run each form of the plan.
FORM_HOSTS = {"gaudi": ("gaudi",), "ragged": ("tpu", "vllm")}
#: The peer whose forwards each form plans (:func:`~attnpolicy.planning.warmup_plan.plan_forms`).
FORM_PEER: dict[str, Peer] = {"gaudi": "gaudi", "ragged": "tpu"}


@dataclass(frozen=True)
class SchemeRow:
    """One row: the ``hosts`` that can run its warm set, whether it is one host's
    ``default``, and its cost, or why the peer refuses to start under the limits
    (``refused``, with or without a cost); ``over``: the bound of the budget asked its
    warm set breaks (``None``: within); ``reference``: a comparison no file sets up.
    ``warm``: its warm set (``None``: refused before one was made) and ``peer``: the
    runtime whose form runs it; ``measured``: what a run of it measured (``None``: not
    run, see :meth:`SchemeComparison.measurable`)."""

    scheme: str
    hosts: tuple[str, ...]
    cost: WarmupCost | None
    refused: str | None = None
    default: bool = False
    over: str | None = None
    reference: bool = False
    warm: PeerWarmSet | None = field(default=None, compare=False, repr=False)
    peer: Peer | None = field(default=None, compare=False)
    measured: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def runnable(self) -> bool:
        """Priced, run by a host from the plan's files or by default, within the budget."""
        return self.cost is not None and self.refused is None and self.over is None and not self.reference

    def to_json(self) -> dict[str, Any]:
        return {**(self.cost.to_json() if self.cost else {}), "scheme": self.scheme, "hosts": list(self.hosts),
                "default": self.default, "refused": self.refused, "over_budget": self.over,
                "reference": self.reference, "measured": None if self.measured is None else dict(self.measured)}


@dataclass(frozen=True)
class HostChoice:
    """One host's best row (:func:`_lowest`; ``None``: none within the budget) and its
    default of the lowest total (run-time compiles included, within the budget or not)."""

    host: str
    best: SchemeRow | None
    default: SchemeRow

    @property
    def speedup(self) -> float | None:
        """The default's total over the best's."""
        if self.best is None:
            return None
        assert self.best.cost is not None and self.default.cost is not None
        return self.default.cost.total_seconds / self.best.cost.total_seconds

    def describe(self) -> str:
        """The summary's part of this host: its best row's total against its default's."""
        if self.best is None:
            return f"{self.host}: no set it runs within the budget"
        if self.best is self.default:
            return f"{self.host}: its default {self.default.scheme}"
        speedup, over = self.speedup or 1.0, " (over the budget)" if self.default.over else ""
        ratio = f"{speedup:.3f}× below" if speedup >= 1 else f"{1 / speedup:.3f}× above"
        return f"{self.host}: {self.best.scheme}, {ratio} {self.default.scheme}{over}"


def _lowest(rows: Sequence[SchemeRow]) -> SchemeRow | None:
    """The lowest total among the :attr:`~SchemeRow.runnable` ``rows`` that compile
    nothing at run time, or among all runnable ones; ``None`` when none is."""
    runnable = [r for r in rows if r.runnable and r.cost is not None]
    covered = [r for r in runnable if r.cost is not None and r.cost.runtime_compiles == 0] or runnable
    return min(covered, key=lambda r: r.cost.total_seconds if r.cost else float("inf"), default=None)


@dataclass(frozen=True)
class SchemeComparison:
    """Every row of the module docstring, the plans asked for (each form), and the floor,
    under the server's ``limits``."""

    plans: tuple[PeerPlan, PeerPlan]
    rows: tuple[SchemeRow, ...]
    floor: WarmupCost
    limits: PeerLimits

    def graph_sets(self) -> GraphSetsFile:
        """``graph_sets.json``: the warm set of every row that has one, by its label,
        with the runtime whose form runs it."""
        return GraphSetsFile.of(self.limits, {r.scheme: (r.peer, r.warm) for r in self.rows
                                              if r.warm is not None and r.peer is not None})

    def measurable(self) -> tuple[SchemeRow, ...]:
        """The rows a run measures: a warm set this runner serves (not ragged,
        :func:`~attnpolicy.modelling.runtime_sets.why_not_runnable`) that its host does
        not refuse, comparisons no file sets up (``reference``) left out."""
        return tuple(r for r in self.rows if r.warm is not None and r.peer is not None and r.refused is None
                     and not r.reference and why_not_runnable(r.peer, r.warm) is None)

    def with_measured(self, measured: Mapping[str, Mapping[str, Any]]) -> SchemeComparison:
        """This comparison with each row of a label in ``measured`` holding its figures."""
        return replace(self, rows=tuple(replace(r, measured=measured.get(r.scheme, r.measured)) for r in self.rows))

    @property
    def recommended(self) -> SchemeRow:
        """The lowest total of any row (see :func:`_lowest`): never none, since the plan
        in the ragged form is within its budget and run by vLLM even when empty."""
        best = _lowest(self.rows)
        assert best is not None
        return best

    def per_host(self) -> tuple[HostChoice, ...]:
        """Each host with a priced default: its best row against its default."""
        out = []
        for host in dict.fromkeys(h for r in self.rows for h in r.hosts):
            defaults = [r for r in self.rows if r.default and host in r.hosts and r.cost is not None]
            if defaults:
                default = min(defaults, key=lambda r: r.cost.total_seconds if r.cost else float("inf"))
                out.append(HostChoice(host, _lowest([r for r in self.rows if host in r.hosts]), default))
        return tuple(out)

    def summary(self) -> str:
        """One line: the lowest total within the budget against the floor, then each
        host's best row against its default."""
        best = self.recommended
        assert best.cost is not None
        ratio = best.cost.total_seconds / self.floor.total_seconds
        bounds = self.plans[0].budget.describe()
        late = (f", {best.cost.runtime_compiles} graphs compiled at run time" if best.cost.runtime_compiles
                else "")
        parts = [(f"* lowest modelled total{f' within {bounds}' if bounds else ''}: {best.scheme} "
                 f"({best.cost.total_seconds:.4g} s, {ratio:.3f}× the floor{late})")]
        return "; ".join([*parts, *(c.describe() for c in self.per_host())])

    def to_json(self) -> dict[str, Any]:
        return {"plans": {"gaudi": self.plans[0].to_json(), "ragged": self.plans[1].to_json()},
                "schemes": [r.to_json() for r in self.rows], "floor": self.floor.to_json(),
                "recommended": self.recommended.scheme, "summary": self.summary(),
                "per_host": [{"host": c.host, "best": c.best.scheme if c.best else None,
                              "default": c.default.scheme, "speedup": c.speedup} for c in self.per_host()]}


def pow2_grid(limits: PeerLimits) -> Grid:
    """The plan's form with powers of two on every dimension, up to the maxima."""
    top = top_grid(limits)

    def doubling(start: int, last: int) -> tuple[int, ...]:
        return tuple(sorted({*(start << k for k in range(last.bit_length()) if start << k < last), last}))

    return Grid(doubling(16, top.queries[-1]), (0, *doubling(1, top.contexts[-1])),
                doubling(1, top.batches[-1]), doubling(1, top.blocks[-1]))


def floor_cost(forwards: WorkloadForwards, pricing: Pricing) -> WarmupCost:
    """Every step as one ragged forward on a graph of its own tokens, nothing compiled."""
    ragged = forwards.of("tpu")
    run = sum(n * pricing.run_seconds(PeerGraph("mixed", f.batch, f.tokens), f) for f, n in ragged.items())
    tokens = sum(n * f.tokens for f, n in ragged.items())
    return WarmupCost("floor", 0, 0.0, run, 0, 0, 0.0, tokens, 0, 0, 0)


def compare_schemes(forwards: WorkloadForwards, pricing: Pricing, plans: tuple[PeerPlan, PeerPlan],
                    max_sizes: int, extra: Sequence[tuple[str, Callable[[], PeerWarmSet]]] = ()) -> SchemeComparison:
    """The rows of the module docstring for the workload's ``forwards``: the ``plans``
    (:func:`~attnpolicy.planning.warmup_plan.plan_forms` of them under a budget), and
    the plan under each peer's own budget (at most ``max_sizes`` sizes per
    dimension); ``extra``: more warm sets to price (``(label, make)``, such as the
    host settings' sets)."""
    limits, budget = forwards.limits, plans[0].budget

    def priced(label: str, hosts: tuple[str, ...], warm: PeerWarmSet, peer: Peer, cost: WarmupCost | None = None,
               **kw: Any) -> SchemeRow:
        """The row of ``warm`` run in ``peer``'s form (``cost``: already priced)."""
        cost = warmup_cost(label, warm, forwards.of(peer), pricing) if cost is None else cost
        return SchemeRow(label, hosts, cost, over=budget.over(cost), warm=warm, peer=peer, **kw)

    def row(label: str, make: Callable[[], PeerWarmSet], default: bool = False, host: str | None = None) -> SchemeRow:
        try:
            warm = make()
        except ConfigError as exc:
            return SchemeRow(label, (host or peer_of(label),), None, str(exc), default)
        host = host or peer_of(warm.scheme)
        return priced(label, (host,), warm, "tpu" if host == "vllm" else peer_of(host), default=default)

    peers = [row(name, lambda make=make: make(limits), True)  # type: ignore[misc]
             for name, make in WARMUPS.items()]
    peers.append(row("vllm", lambda: vllm_warmup(limits), True, "vllm"))
    pow2 = PeerWarmSet.of("gaudi-pow2", pow2_grid(limits).graphs(limits))
    gaudi, ragged = plans
    try:  # the plan's bucketing file read back as vllm-gaudi reads it
        gaudi_file_warmup(GaudiBuckets.of(gaudi.warm).file_text(limits), limits)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    rows = [*peers, priced("pow2", FORM_HOSTS["gaudi"], pow2, "gaudi", reference=True),
            priced(PLAN_GAUDI, FORM_HOSTS["gaudi"], gaudi.warm, FORM_PEER["gaudi"], gaudi.cost,
                   refused=refused),
            # tpu-inference always compiles its cover padding: a plan without one runs on vLLM alone
            priced("plan (ragged form)", FORM_HOSTS["ragged"] if ragged.warm.graphs else ("vllm",), ragged.warm,
                   FORM_PEER["ragged"], ragged.cost)]
    for peer in peers:
        if peer.cost is not None:
            at = Budget(peer.cost.graphs, budget.max_bytes, peer.cost.warmup_seconds)
            names = [form for form in FORM_HOSTS if peer.hosts[0] in FORM_HOSTS[form]] or list(FORM_HOSTS)
            forms = [(plan_warmup(forwards.of(FORM_PEER[form]), limits, pricing, at, max_sizes), form)
                     for form in names]
            chosen, form = min(forms, key=lambda p: p[0].cost.total_seconds)
            rows.append(priced(f"plan @ {peer.scheme} ({form} form)", FORM_HOSTS[form], chosen.warm,
                               FORM_PEER[form], chosen.cost, reference=True))
    rows += [row(label, make) for label, make in extra]
    return SchemeComparison(plans, tuple(rows), floor_cost(forwards, pricing), limits)


def plan_whole_requests(steps: Sequence[BatchLayout], limits: PeerLimits, model: ModelCostModel, budget: Budget,
                        max_sizes: int, bucketing_file: str = GAUDI_FILE) -> tuple[SchemeComparison, HostSettings]:
    """The plan of a workload's engine ``steps`` in both forms under ``budget``, the host
    settings that apply it (vllm-gaudi's bucketing file to be read at ``bucketing_file``,
    tpu-inference's and vLLM's token paddings, vllm-rbln's decode batches: the gaudi
    form's; each naming what the budget leaves out) and the comparison of every scheme
    with them (the host settings' ``rbln-plan`` among the rows)."""
    pricing, forwards = Pricing(model, limits), WorkloadForwards(steps, limits)
    plans = plan_forms(forwards, pricing, budget, max_sizes)
    gaudi, ragged = plans
    planned = PlannedForms(GaudiBuckets.of(gaudi.warm, gaudi.outside), gaudi.outside,
                           ragged.warm.prefill_lengths(), ragged.outside,
                           lambda warm: budget.over_graphs(warm.graphs, pricing))
    settings = host_settings(steps, gaudi.warm.prefill_lengths(), limits, max_sizes, bucketing_file,
                             forwards=forwards, planned=planned)
    extra = [s for s in settings.warmup_sets() if s[0] == "rbln-plan"]
    return compare_schemes(forwards, pricing, plans, max_sizes, extra), settings


#: The table's title and legend (under the title in plan.md).
COMPARISON_TITLE = "Warm-up schemes on whole requests, modelled (measured with --measure)"
COMPARISON_LEGEND = ("Each scheme's warm-up set and each step as its runtime runs it, each graph priced as the step "
                     "graph `run --model --graph-set` compiles for it, by the cost model's step fits of its mode "
                     "(prompts and vllm-rbln's decodes ROWS, vllm-gaudi's flat decodes MASK), at its padded shape; a "
                     "ragged one (tpu, vllm), which does not run here, by the MASK fits at its padded tokens over the "
                     "real context. *warm-up s*: every "
                     "warm graph compiled once and the first compile's start-up; *padding*: rows computed beyond the "
                     "tokens, per token; *run-time compiles*: distinct shapes no warm graph serves (at most that many "
                     "compiles), with the forwards they serve; *peak graph MiB*: every graph held (static-shape "
                     "estimates); *plan (gaudi form)*: vllm-gaudi buckets (prompts alone, decodes batched); *plan "
                     "(ragged form)*: token paddings (tpu, vllm); *plan @ NAME*: the plan under NAME's graph count "
                     "and warm-up seconds, in the form NAME's host runs; *floor*: every step one ragged forward at "
                     "its own tokens, no warm-up (no scheme runs the workload for less); *measured total s*: with "
                     "`--measure SPEC`, the row's set run here on the same steps (warm-up, run-time compiles and "
                     "run, CPU seconds) for every set this runner serves that its host does not refuse (not the "
                     "ragged ones, not pow2 nor plan @ NAME), *modelled* where none ran; *budget*: the bound of the "
                     "budget asked a warm-up set breaks, or why its host refuses it; * marks the lowest total within "
                     "the budget of the sets a host runs, from the plan's files or by default (pow2 and plan @ NAME "
                     "are comparisons no file sets up).")

#: The table's columns (:func:`comparison_table` gives its cells).
COMPARISON_COLUMNS = ("scheme", "graphs", "warm-up s", "padding", "run-time compiles", "peak graph MiB", "run s",
                      "total s", "measured total s", "budget")


def comparison_table(comparison: SchemeComparison) -> list[tuple[str, ...]]:
    """The rows as the cells of :data:`COMPARISON_COLUMNS`, the floor last."""
    out: list[tuple[str, ...]] = []
    for r in (*comparison.rows, None):
        c = comparison.floor if r is None else r.cost
        if r is not None and c is None:
            out.append((r.scheme, f"refused: {r.refused}", "", "", "", "", "", "", "", ""))
            continue
        assert c is not None
        mark = " *" if r is comparison.recommended else ""
        budget = "" if r is None else "; ".join(
            [f"over: {r.over}" if r.over else "within", *([f"refused: {r.refused}"] if r.refused else [])])
        measured = ("" if r is None else "modelled" if r.measured is None
                    else f"{r.measured['total_seconds']:.1f}")
        out.append(("floor" if r is None else r.scheme + mark, str(c.graphs), f"{c.warmup_seconds:.1f}",
                    f"{c.padding:.1%}", f"{c.runtime_compiles} ({c.unserved} forwards)",
                    f"{c.peak_bytes / 2**20:.0f}", f"{c.run_seconds:.1f}", f"{c.total_seconds:.1f}", measured,
                    budget))
    return out
