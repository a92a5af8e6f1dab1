"""The report's plots, each titled with what it shows (computed from the data):
the memory-vs-time frontier of a sweep per policy at its best bucket scheme (also
drawn by ``attnpolicy simulate --plot``), the graph-cache hit rate against the
capacity, and the bench ratios next to tt-xla's. Each returns a :class:`Plot`
holding the data coordinates of the point it marks (the recommendation)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnpolicy.bench.mode_timing import Speedup
from attnpolicy.cache.key_stream import BELADY
from attnpolicy.modelling.simulation import SimRow

#: tt-xla (Tenstorrent's XLA compiler), 1 sequence: masked / mask-free time on their
#: accelerator, as published in their issue tracker (tenstorrent/tt-xla#1784).
TT_XLA = {128: 1.12, 1024: 1.26, 4096: 1.50, 16384: 1.82}
#: The hit rate a capacity must reach to count as enough in the hit-rate plot's title.
ENOUGH_HITS = 0.9
MIB = 2**20


@dataclass(frozen=True)
class Plot:
    """A drawn PNG: its file name, its title, and the data coordinates ``(x, y)`` of
    the recommendation it marks (``None``: nothing marked)."""

    file: str
    title: str
    marked: tuple[float, float] | None = None


@dataclass(frozen=True)
class Marked:
    """The recommendation as the plots mark it: its bound, peak MiB, total seconds and
    hit rate, and a short label."""

    capacity: int | None
    max_bytes: int | None
    peak_mib: float
    total_seconds: float
    hit_rate: float
    label: str


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


def _cap(capacity: int | None) -> str:
    return "∞" if capacity is None else str(capacity)


def _label(row: SimRow) -> str:
    return _cap(row.capacity) if row.max_bytes is None else f"{_cap(row.capacity)}/{row.max_bytes / MIB:.0f}M"


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


def plot_sweep(rows: Sequence[SimRow], path: str | Path, marked: Marked | None = None) -> Plot:
    """Peak graph MiB (x) vs total seconds (y): one line per policy at the best bucket
    scheme, through its best online eviction at each bound (points labelled by
    capacity); ``marked``: the recommendation, a star."""
    plt = _pyplot()
    scheme = best_scheme(rows)
    per_policy = best_rows(rows, scheme)
    title = frontier_finding(per_policy, scheme)
    fig, ax = plt.subplots(figsize=(8.5, 5.4))
    xs, ys = [], []
    for policy, rs in per_policy.items():
        x, y = [r.peak_bytes / MIB for r in rs], [r.total_seconds for r in rs]
        xs += x
        ys += y
        (line,) = ax.plot(x, y, marker="o", label=policy)
        for r, xi, yi in zip(rs, x, y):
            ax.annotate(_label(r), (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points",
                        color=line.get_color())
    point = None
    if marked is not None:
        point = (marked.peak_mib, marked.total_seconds)
        xs.append(point[0])
        ys.append(point[1])
        ax.plot(*point, marker="*", markersize=16, color="black", linestyle="none",
                label=f"recommended: {marked.label}")
        title += f"; recommended: {marked.label}, {marked.total_seconds:.3g} s at {marked.peak_mib:.0f} MiB"
    if _spread(xs):
        _log(ax.xaxis, ax.set_xscale)
    if _spread(ys):
        _log(ax.yaxis, ax.set_yscale)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    ax.set_xlabel("peak graph MiB held (labels: max graphs)")
    ax.set_ylabel("total seconds (attention + compiles)")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    return _save(fig, plt, path, title, point)


def plot_hit_rate(rows: Sequence[SimRow], path: str | Path, marked: Marked | None = None) -> Plot:
    """Graph-cache hit rate (y) against the capacity (x, evenly spaced, ∞ last): one
    line per policy at the best bucket scheme, its best online eviction at each
    capacity (rows without a byte bound); ``marked``: the recommendation."""
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
        reached.append(f"{policy} {_cap(enough[0])}" if enough else f"{policy} never")
    title = f"graphs needed for {ENOUGH_HITS:.0%} hits ({scheme} buckets): " + ", ".join(reached)
    point = None
    if marked is not None and marked.max_bytes is None and marked.capacity in pos:
        point = (float(pos[marked.capacity]), 100 * marked.hit_rate)
        ax.plot(*point, marker="*", markersize=16, color="black", linestyle="none",
                label=f"recommended: {marked.label}")
    ax.axhline(100 * ENOUGH_HITS, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(caps)), [_cap(c) for c in caps])
    ax.set_xlabel("graph-cache capacity (max graphs)")
    ax.set_ylabel("hit rate %")
    ax.set_ylim(0, 102)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return _save(fig, plt, path, title, point)


def mask_ratios(speedups: Sequence[Speedup], num_seqs: int) -> list[tuple[int, float]]:
    """(L, masked / mask-free time) of the bench rows of ``num_seqs`` sequences."""
    return [(sp.seq_len, sp.ratio if sp.slower == "mask" else 1 / sp.ratio)
            for sp in speedups if sp.num_seqs == num_seqs]


def bench_finding(speedups: Sequence[Speedup]) -> str:
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


def plot_bench(speedups: Sequence[Speedup], path: str | Path) -> Plot:
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
    return _save(fig, plt, path, title, None)


def _legend(ax: Any) -> None:
    """The legend below the axes, where it covers no data."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)


def _save(fig: Any, plt: Any, path: str | Path, title: str, marked: tuple[float, float] | None) -> Plot:
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Plot(path.name, title, marked)
