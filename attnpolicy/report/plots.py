"""The report's plots, each titled with what it shows (computed from the data):
the memory-vs-time plane of a sweep with its Pareto frontier, per policy at its
best bucket scheme (also drawn by ``attnpolicy simulate --plot``), the graph-cache
hit rate against the capacity, and the bench ratios next to tt-xla's. Each returns
a :class:`Plot` holding, read back from the drawn artists, the data coordinates
and labels of the rows it marks (the recommendation, the fastest and the leanest
good row) and the frontier it draws."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnpolicy.cache.key_stream import BELADY
from attnpolicy.modelling.simulation import SimRow
from attnpolicy.report.units import MIB, capacity_text

if TYPE_CHECKING:
    from attnpolicy.bench.mode_timing import Ratio

#: tt-xla (Tenstorrent's XLA compiler), 1 sequence: masked / mask-free time on their
#: accelerator, as published in their issue tracker (tenstorrent/tt-xla#1784).
TT_XLA = {128: 1.12, 1024: 1.26, 4096: 1.50, 16384: 1.82}
#: The hit rate a capacity must reach to count as enough in the hit-rate plot's title.
ENOUGH_HITS = 0.9


@dataclass(frozen=True)
class Point:
    """A marked point as drawn: its name, its legend label and its data coordinates."""

    name: str
    label: str
    x: float
    y: float


@dataclass(frozen=True)
class Plot:
    """A drawn PNG: its file name, its title, the data coordinates ``(x, y)`` of the
    first mark (the recommendation; ``None``: nothing marked), every mark drawn, and
    the Pareto frontier's points (the frontier plot only)."""

    file: str
    title: str
    marked: tuple[float, float] | None = None
    marks: tuple[Point, ...] = ()
    frontier: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Marked:
    """A row as the plots mark it: its name, a short label, peak graph MiB, total
    seconds, the most graphs it held, and its bound and hit rate (the hit-rate plot
    marks it at its capacity when it has no byte bound)."""

    name: str
    label: str
    peak_mib: float
    total_seconds: float
    graphs: int | None = None
    capacity: int | None = None
    max_bytes: int | None = None
    hit_rate: float | None = None


#: Marker and colour of the 1st, 2nd and 3rd mark (the recommendation, the fastest
#: row, the leanest good row), and of any further one.
STYLES = (("*", "black", 16), ("^", "tab:red", 11), ("D", "tab:green", 9))
OTHER_STYLE = ("X", "tab:purple", 9)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def best_scheme(rows: Sequence[SimRow]) -> str:
    """The bucket scheme of the sweep's lowest online total."""
    online = [r for r in rows if r.eviction != BELADY] or list(rows)
    return min(online, key=lambda r: r.total_seconds).buckets


def best_rows(rows: Sequence[SimRow], scheme: str) -> dict[str, list[SimRow]]:
    """Per policy, at ``scheme``: the lowest-total online row of each bound, by peak memory."""
    best: dict[tuple[str, int | None, int | None], SimRow] = {}
    for r in rows:
        if r.buckets != scheme or r.eviction == BELADY:
            continue
        k = (r.policy, r.capacity, r.max_bytes)
        if k not in best or r.total_seconds < best[k].total_seconds:
            best[k] = r
    out: dict[str, list[SimRow]] = {}
    for (policy, _, _), r in best.items():
        out.setdefault(policy, []).append(r)
    return {p: sorted(rs, key=lambda r: (r.peak_bytes, r.total_seconds)) for p, rs in out.items()}


def _label(row: SimRow) -> str:
    cap = capacity_text(row.capacity)
    return cap if row.max_bytes is None else f"{cap}/{row.max_bytes / MIB:.0f}M"


def _log(axis: Any, set_scale: Any) -> None:
    """A log axis labelled with plain numbers (no minor labels to overlap)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    set_scale("log")
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _spread(values: Sequence[float]) -> bool:
    """Whether the values span more than a factor 10 (a log axis helps)."""
    pos = [v for v in values if v > 0]
    return bool(pos) and max(pos) > 10 * min(pos)


def pareto(rows: Sequence[SimRow]) -> list[SimRow]:
    """The online rows no other online row beats on both peak graph bytes and total
    seconds (of equal peaks the fastest, first of equals), by peak bytes."""
    out: list[SimRow] = []
    for r in sorted((r for r in rows if r.eviction != BELADY), key=lambda r: (r.peak_bytes, r.total_seconds)):
        if not out or r.total_seconds < out[-1].total_seconds:
            if out and out[-1].peak_bytes == r.peak_bytes:
                continue
            out.append(r)
    return out


def _mark(ax: Any, marks: Sequence[Marked], at: Callable[[Marked], tuple[float, float] | None]) -> list[Point]:
    """Draw ``marks`` where ``at`` puts them (``None``: not on this plot), each
    labelled beside it; returns what the artists hold."""
    points = []
    for i, m in enumerate(marks):
        xy = at(m)
        if xy is None:
            continue
        marker, color, size = STYLES[i] if i < len(STYLES) else OTHER_STYLE
        (artist,) = ax.plot(*xy, marker=marker, markersize=size, color=color, linestyle="none",
                            label=f"{m.name}: {m.label}", zorder=5)
        held = "" if m.graphs is None else f", {m.graphs} graphs held"
        ax.annotate(f"{m.name}: {m.total_seconds:.4g} s, {m.peak_mib:.0f} MiB{held}", xy, fontsize=8,
                    color=color, xytext=(0.98, 0.96 - 0.07 * i), textcoords="axes fraction", ha="right", va="top",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": color, "alpha": 0.9},
                    arrowprops={"arrowstyle": "->", "color": color, "linewidth": 0.8}, zorder=6)
        x, y = artist.get_xdata()[0], artist.get_ydata()[0]
        points.append(Point(m.name, str(artist.get_label()), float(x), float(y)))
    return points


def frontier_finding(per_policy: dict[str, list[SimRow]], scheme: str) -> str:
    """Which policy has the lowest total at most of the bounds swept."""
    bounds: dict[tuple[int | None, int | None], SimRow] = {}
    for rs in per_policy.values():
        for r in rs:
            k = (r.capacity, r.max_bytes)
            if k not in bounds or r.total_seconds < bounds[k].total_seconds:
                bounds[k] = r
    wins: dict[str, int] = {}
    for r in bounds.values():
        wins[r.policy] = wins.get(r.policy, 0) + 1
    winner = max(wins, key=lambda p: wins[p])
    return f"{winner} is fastest at {wins[winner]} of {len(bounds)} cache bounds ({scheme} buckets)"


def plot_sweep(rows: Sequence[SimRow], path: str | Path, marks: Sequence[Marked] = ()) -> Plot:
    """Peak graph MiB (x) vs total seconds (y): every online row (grey), the Pareto
    frontier over them (dashed), one line per policy at the best bucket scheme through
    its best online eviction at each bound (points labelled by capacity), and
    ``marks`` (the recommendation first), each named beside its point."""
    plt = _pyplot()
    scheme = best_scheme(rows)
    per_policy = best_rows(rows, scheme)
    title = frontier_finding(per_policy, scheme)
    fig, ax = plt.subplots(figsize=(8.5, 5.8))
    runnable = [r for r in rows if r.eviction != BELADY]
    xs, ys = [r.peak_bytes / MIB for r in runnable], [r.total_seconds for r in runnable]
    ax.plot(xs, ys, marker=".", linestyle="none", color="lightgrey", label="every online row", zorder=1)
    for policy, rs in per_policy.items():
        x, y = [r.peak_bytes / MIB for r in rs], [r.total_seconds for r in rs]
        (line,) = ax.plot(x, y, marker="o", markersize=4, linewidth=1, label=f"{policy} ({scheme})", zorder=2)
        for r, xi, yi in zip(rs, x, y):
            ax.annotate(_label(r), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points",
                        color=line.get_color())
    edge = pareto(rows)
    (front,) = ax.plot([r.peak_bytes / MIB for r in edge], [r.total_seconds for r in edge], drawstyle="steps-post",
                       linestyle="--", color="black", linewidth=1, label="Pareto frontier of the online rows",
                       zorder=3)
    points = _mark(ax, marks, lambda m: (m.peak_mib, m.total_seconds))
    xs += [p.x for p in points]
    ys += [p.y for p in points]
    if points:
        title += "; " + ", ".join(f"{p.name} {p.y:.4g} s at {p.x:.0f} MiB" for p in points)
    if _spread(xs):
        _log(ax.xaxis, ax.set_xscale)
    if _spread(ys):
        _log(ax.yaxis, ax.set_yscale)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    ax.set_xlabel("peak graph MiB held (labels: max graphs)")
    ax.set_ylabel("total seconds (attention + compiles)")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, ncol=2)
    drawn = tuple((float(x), float(y)) for x, y in zip(front.get_xdata(), front.get_ydata()))
    return _save(fig, plt, path, title, points, drawn)


def plot_hit_rate(rows: Sequence[SimRow], path: str | Path, marks: Sequence[Marked] = ()) -> Plot:
    """Graph-cache hit rate (y) against the capacity (x, evenly spaced, ∞ last): one
    line per policy at the best bucket scheme, its best online eviction at each
    capacity (rows without a byte bound); ``marks`` (the recommendation first) at
    their capacity, those without a byte bound."""
    plt = _pyplot()
    scheme = best_scheme(rows)
    caps = sorted({r.capacity for r in rows if r.max_bytes is None}, key=lambda c: (c is None, c or 0))
    pos = {c: i for i, c in enumerate(caps)}
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    reached = []
    for policy, rs in best_rows([r for r in rows if r.max_bytes is None], scheme).items():
        pts = sorted(((pos[r.capacity], r.hit_rate, r.capacity) for r in rs), key=lambda p: p[0])
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=policy)
        enough = [p[2] for p in pts if p[1] >= ENOUGH_HITS]
        reached.append(f"{policy} {capacity_text(enough[0])}" if enough else f"{policy} never")
    title = f"graphs needed for {ENOUGH_HITS:.0%} hits ({scheme} buckets): " + ", ".join(reached)
    points = _mark(ax, marks, lambda m: None if m.max_bytes is not None or m.capacity not in pos
                   or m.hit_rate is None else (float(pos[m.capacity]), 100 * m.hit_rate))
    ax.axhline(100 * ENOUGH_HITS, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(caps)), [capacity_text(c) for c in caps])
    ax.set_xlabel("graph-cache capacity (max graphs)")
    ax.set_ylabel("hit rate %")
    ax.set_ylim(0, 102)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return _save(fig, plt, path, title, points)


def mask_ratios(speedups: Sequence[Ratio], num_seqs: int) -> list[tuple[int, float]]:
    """(L, masked / mask-free time) of the bench rows of ``num_seqs`` equal sequences:
    MASK over CAUSAL for one sequence, over VARLEN for several (each mode's median over
    the shape's first mode's, so any further mode of the row is left out)."""
    free = "causal" if num_seqs == 1 else "varlen"
    return [(sp.seq_len, over["mask"] / over[free]) for sp in speedups
            if sp.num_seqs == num_seqs and sp.split == "equal" and "mask" in (over := sp.over["call"]) and free in over]


def bench_finding(speedups: Sequence[Ratio]) -> str:
    """One sequence's MASK / causal here against tt-xla's, at the longest length both
    measured (else this machine's range)."""
    pts = dict(mask_ratios(speedups, 1))
    shared = [n for n in pts if n in TT_XLA]
    if shared:
        n = max(shared)
        return (f"one sequence at L {n}: MASK costs {pts[n]:.2f}× causal here, {TT_XLA[n]:.2f}× on tt-xla "
                f"(tt-xla {min(TT_XLA.values()):.2f}–{max(TT_XLA.values()):.2f}× over L 128–16384)")
    if not pts:
        return "masked / mask-free time next to tt-xla's"
    return (f"one sequence: MASK costs {min(pts.values()):.2f}–{max(pts.values()):.2f}× causal here at "
            f"L {min(pts)}–{max(pts)} (no length in common with tt-xla's)")


def plot_bench(speedups: Sequence[Ratio], path: str | Path) -> Plot:
    """Masked / mask-free time per total length on this machine, next to tt-xla's."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.0))
    for n, label in ((1, "1 seq: mask / causal"), (4, "4 seqs: mask / varlen")):
        pts = mask_ratios(speedups, n)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"this machine, {label}")
    ax.plot(list(TT_XLA), list(TT_XLA.values()), marker="s", linestyle="--", label="tt-xla, 1 seq: mask / causal")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total tokens L")
    ax.set_ylabel("masked time / mask-free time")
    title = bench_finding(speedups)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    _legend(ax)
    ax.grid(True, alpha=0.3)
    return _save(fig, plt, path, title, [])


def _legend(ax: Any, ncol: int = 3) -> None:
    """The legend below the axes, where it covers no data."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, frameon=False)


def _save(fig: Any, plt: Any, path: str | Path, title: str, points: Sequence[Point],
          frontier: tuple[tuple[float, float], ...] = ()) -> Plot:
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Plot(path.name, title, (points[0].x, points[0].y) if points else None, tuple(points), frontier)
