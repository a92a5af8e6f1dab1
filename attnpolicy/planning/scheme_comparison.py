"""The model-level comparison of warm-up schemes on one workload of whole requests:
the runtimes' own sets, pow2, the host settings of the plan, and the joint plan at
the budget asked and at each runtime's own graph count and warm-up seconds, every
row priced by one rule (:mod:`~attnpolicy.modelling.warmup_costs`).

Rows:

- ``gaudi-linear``, ``gaudi-exponential``, ``rbln``, ``tpu``: each runtime's default
  warm-up set for the server's limits, its steps run as that runtime runs them;
- ``vllm``: vLLM's piecewise graphs at its capture sizes (steps run ragged, as tpu);
- ``pow2``: the plan's form (vllm-gaudi buckets) with powers of two on every
  dimension: prompt query tokens from 16, context blocks from 1 (and 0), decode
  batches from 1 and blocks from 1, each up to the maxima (coverage as the plan's);
- ``plan (gaudi form)``, ``plan (ragged form)``: the plan under the budget asked, as
  vllm-gaudi buckets and as a ragged runtime's token paddings
  (:func:`~attnpolicy.planning.warmup_plan.plan_forms`);
- ``plan @ NAME (FORM)``: the plan re-planned under NAME's graph count and warm-up
  seconds, in the form NAME's host runs (vllm-gaudi: the gaudi form; tpu-inference,
  vLLM: the ragged form; vllm-rbln, which takes neither: the better of the two);
- the host settings' sets, such as ``rbln-plan``: what a runtime warms up under the
  plan's ``host_settings.json``;
- ``floor``: no scheme's bound, every step one ragged forward at its own tokens with no
  padding and no warm-up: no warm-up set runs the workload for less under this rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.peer_buckets import (
    WARMUPS,
    PeerLimits,
    Runtime,
    WarmupGraph,
    WarmupSet,
    WorkloadForwards,
    runtime_of,
)
from attnpolicy.modelling.warmup_costs import Pricing, WarmupCost, run_shape, vllm_warmup, warmup_cost
from attnpolicy.modelling.whole_model_costs import ModelCostModel
from attnpolicy.planning.host_settings import GAUDI_FILE, GaudiBuckets, HostSettings, host_settings
from attnpolicy.planning.warmup_plan import Budget, Grid, WarmupPlan, plan_forms, plan_warmup, top_grid

#: The hosts that run each form of the plan.
FORM_HOSTS = {"gaudi": ("gaudi",), "ragged": ("tpu", "vllm")}
#: The runtime whose forwards each form plans (:func:`~attnpolicy.planning.warmup_plan.plan_forms`).
FORM_RUNTIME: dict[str, Runtime] = {"gaudi": "gaudi", "ragged": "tpu"}


@dataclass(frozen=True)
class SchemeRow:
    """One row: the ``hosts`` that can run its warm-up set, whether it is one host's
    ``default``, and its cost, or why the runtime refuses to start under the limits."""

    scheme: str
    hosts: tuple[str, ...]
    cost: WarmupCost | None
    refused: str | None = None
    default: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**(self.cost.to_json() if self.cost else {}), "scheme": self.scheme, "hosts": list(self.hosts),
                "default": self.default, "refused": self.refused}


@dataclass(frozen=True)
class HostChoice:
    """One host's best row (no run-time compile where any has none) and its default of
    the lowest total (run-time compiles included)."""

    host: str
    best: SchemeRow
    default: SchemeRow

    @property
    def speedup(self) -> float:
        """The default's total over the best's."""
        assert self.best.cost is not None and self.default.cost is not None
        return self.default.cost.total_seconds / self.best.cost.total_seconds


def _lowest(rows: Sequence[SchemeRow]) -> SchemeRow:
    """The lowest total among ``rows`` that compile nothing at run time, or among all."""
    priced = [r for r in rows if r.cost is not None]
    covered = [r for r in priced if r.cost is not None and r.cost.runtime_compiles == 0] or priced
    return min(covered, key=lambda r: r.cost.total_seconds if r.cost else float("inf"))


@dataclass(frozen=True)
class SchemeComparison:
    """Every row of the module docstring, the plans asked for (each form), and the floor."""

    plans: tuple[WarmupPlan, WarmupPlan]
    rows: tuple[SchemeRow, ...]
    floor: WarmupCost

    @property
    def recommended(self) -> SchemeRow:
        """The lowest total of any row (see :func:`_lowest`)."""
        return _lowest(self.rows)

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
        """One line: the lowest total against the floor, then each host's best row against its default."""
        best = self.recommended
        assert best.cost is not None
        ratio = best.cost.total_seconds / self.floor.total_seconds
        parts = [f"* lowest modelled total: {best.scheme} ({best.cost.total_seconds:.4g} s, {ratio:.3f}× the floor)"]
        parts += [f"{c.host}: {c.best.scheme}, {c.speedup:.3f}× below {c.default.scheme}" for c in self.per_host()]
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"plans": {"gaudi": self.plans[0].to_json(), "ragged": self.plans[1].to_json()},
                "schemes": [r.to_json() for r in self.rows], "floor": self.floor.to_json(),
                "recommended": self.recommended.scheme, "summary": self.summary(),
                "per_host": [{"host": c.host, "best": c.best.scheme, "default": c.default.scheme,
                              "speedup": c.speedup} for c in self.per_host()]}


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
    run = sum(n * pricing.run_seconds(run_shape(WarmupGraph("mixed", f.batch, f.tokens), f, pricing.limits))
              for f, n in ragged.items())
    tokens = sum(n * f.tokens for f, n in ragged.items())
    return WarmupCost("floor", 0, 0.0, run, 0, 0, 0.0, tokens, 0, 0)


def compare_schemes(forwards: WorkloadForwards, pricing: Pricing, plans: tuple[WarmupPlan, WarmupPlan],
                    max_sizes: int, extra: Sequence[tuple[str, Callable[[], WarmupSet]]] = ()) -> SchemeComparison:
    """The rows of the module docstring for the workload's ``forwards``: the ``plans``
    (:func:`~attnpolicy.planning.warmup_plan.plan_forms` of them under a budget), and
    the plan under each runtime's own budget (at most ``max_sizes`` sizes per
    dimension); ``extra``: more warm-up sets to price (``(label, make)``, such as the
    host settings' sets)."""
    limits, budget = forwards.limits, plans[0].budget

    def row(label: str, make: Callable[[], WarmupSet], default: bool = False, host: str | None = None) -> SchemeRow:
        try:
            warm = make()
        except ConfigError as exc:
            return SchemeRow(label, (host or runtime_of(label),), None, str(exc), default)
        host = host or runtime_of(warm.scheme)
        ran = forwards.of("tpu" if host == "vllm" else runtime_of(host))
        return SchemeRow(label, (host,), warmup_cost(label, warm, ran, pricing), None, default)

    peers = [row(name, lambda make=make: make(limits), True)  # type: ignore[misc]
             for name, make in WARMUPS.items()]
    peers.append(row("vllm", lambda: vllm_warmup(limits), True, "vllm"))
    pow2 = WarmupSet.of("gaudi-pow2", pow2_grid(limits).graphs(limits))
    rows = [*peers, SchemeRow("pow2", FORM_HOSTS["gaudi"], warmup_cost("pow2", pow2, forwards.of("gaudi"), pricing)),
            SchemeRow("plan (gaudi form)", FORM_HOSTS["gaudi"], plans[0].cost),
            SchemeRow("plan (ragged form)", FORM_HOSTS["ragged"], plans[1].cost)]
    for peer in peers:
        if peer.cost is not None:
            at = Budget(peer.cost.graphs, budget.max_bytes, peer.cost.warmup_seconds)
            names = [form for form in FORM_HOSTS if peer.hosts[0] in FORM_HOSTS[form]] or list(FORM_HOSTS)
            forms = [(plan_warmup(forwards.of(FORM_RUNTIME[form]), limits, pricing, at, max_sizes), form)
                     for form in names]
            chosen, form = min(forms, key=lambda p: p[0].cost.total_seconds)
            rows.append(SchemeRow(f"plan @ {peer.scheme} ({form} form)", FORM_HOSTS[form], chosen.cost))
    rows += [row(label, make) for label, make in extra]
    return SchemeComparison(plans, tuple(rows), floor_cost(forwards, pricing))


def plan_whole_requests(steps: Sequence[BatchLayout], limits: PeerLimits, model: ModelCostModel, budget: Budget,
                        max_sizes: int, bucketing_file: str = GAUDI_FILE) -> tuple[SchemeComparison, HostSettings]:
    """The plan of a workload's engine ``steps`` in both forms under ``budget``, the host
    settings that apply it (vllm-gaudi's bucketing file to be read at ``bucketing_file``,
    tpu-inference's paddings; vllm-rbln's decode batches by counts) and the comparison
    of every scheme with them (the host settings' ``rbln-plan`` among the rows)."""
    pricing, forwards = Pricing(model, limits), WorkloadForwards(steps, limits)
    plans = plan_forms(forwards, pricing, budget, max_sizes)
    gaudi, ragged = plans
    settings = host_settings(steps, gaudi.warm.prefill_lengths(), limits, max_sizes, bucketing_file,
                             forwards=forwards, gaudi=GaudiBuckets.of(gaudi.warm),
                             tpu_tokens=ragged.warm.prefill_lengths())
    extra = [s for s in settings.warmup_sets() if s[0] == "rbln-plan"]
    return compare_schemes(forwards, pricing, plans, max_sizes, extra), settings


#: The table's title and legend (under the title in plan.md).
TITLE = "Warm-up schemes on whole requests, modelled"
LEGEND = ("Each scheme's warm-up set and each step as its runtime runs it, priced by the cost model's step fits "
          "(MASK) at each graph's rows, context and attention cells: a static graph at its padded shape, a ragged "
          "one (tpu, vllm) at its padded tokens over the real context. *warm-up s*: every warm graph compiled once "
          "and the first compile's start-up; *padding*: rows computed beyond the tokens, per token; *run-time "
          "compiles*: distinct shapes no warm graph serves (at most that many compiles), with the forwards they "
          "serve; *peak graph MiB*: every graph held (static-shape estimates); *plan (gaudi form)*: vllm-gaudi buckets "
          "(prompts alone, decodes batched); *plan (ragged form)*: token paddings (tpu, vllm); *plan @ NAME*: the "
          "plan under NAME's graph count and warm-up seconds, in the form NAME's host runs; *floor*: every step "
          "one ragged forward at its own tokens, no warm-up "
          "(no scheme runs the workload for less); * marks the lowest total.")

#: The table's columns (:func:`comparison_table` gives its cells).
COLUMNS = ("scheme", "graphs", "warm-up s", "padding", "run-time compiles", "peak graph MiB", "run s", "total s")


def comparison_table(comparison: SchemeComparison) -> list[tuple[str, ...]]:
    """The rows as the cells of :data:`COLUMNS`, the floor last."""
    out: list[tuple[str, ...]] = []
    for r in (*comparison.rows, SchemeRow("floor", (), comparison.floor)):
        c = r.cost
        if c is None:
            out.append((r.scheme, f"refused: {r.refused}", "", "", "", "", "", ""))
            continue
        mark = " *" if r is comparison.recommended else ""
        out.append((r.scheme + mark, str(c.graphs), f"{c.warmup_seconds:.1f}", f"{c.padding:.1%}",
                    f"{c.runtime_compiles} ({c.unserved} forwards)", f"{c.peak_bytes / 2**20:.0f}",
                    f"{c.run_seconds:.1f}", f"{c.total_seconds:.1f}"))
    return out
