"""The report's plots: the memory-vs-speed frontier of a sweep (also drawn by
``attnpolicy simulate --plot``) and the bench ratios next to tt-xla's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnpolicy.bench.mode_timing import Speedup
from attnpolicy.modelling.simulation import SimRow

#: tt-xla (Tenstorrent's XLA compiler), 1 sequence: masked / mask-free time on their
#: accelerator, as published in their issue tracker (tenstorrent/tt-xla#1784).
TT_XLA = {128: 1.12, 1024: 1.26, 4096: 1.50, 16384: 1.82}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(rows: Sequence[SimRow], path: str | Path) -> Path:
    """Peak graph MiB (x) vs total seconds (y) of every row: one panel per eviction,
    one line per policy (and bucket scheme, when there are several), each point
    labelled with its capacity (∞: unbounded) and byte bound."""
    plt = _pyplot()
    evictions = list(dict.fromkeys(r.eviction for r in rows))
    several = len({r.buckets for r in rows}) > 1
    lines = list(dict.fromkeys((r.policy, r.buckets) for r in rows))
    fig, axes = plt.subplots(1, len(evictions), figsize=(5.5 * len(evictions), 4.5), squeeze=False)
    for ax, eviction in zip(axes[0], evictions):
        for policy, buckets in lines:
            pts = sorted(((r.peak_bytes / 2**20, r.total_seconds, _bound(r))
                          for r in rows if (r.policy, r.buckets, r.eviction) == (policy, buckets, eviction)),
                         key=lambda p: (p[0], p[1]))  # capacities tie when the bound is never reached
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{policy} / {buckets}" if several else policy)
            for x, y, label in pts:
                ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"eviction: {eviction} (labels: max graphs/max MiB)", fontsize=10)
        ax.set_xlabel("peak graph MiB (computed from static shapes)")
        ax.set_ylabel("total seconds (attention + compiles)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, plt, path)


def _bound(row: SimRow) -> str:
    graphs = "∞" if row.capacity is None else str(row.capacity)
    return graphs if row.max_bytes is None else f"{graphs}/{row.max_bytes / 2**20:.0f}M"


def plot_bench(speedups: Sequence[Speedup], path: str | Path) -> Path:
    """Masked / mask-free time per total length on this machine, next to tt-xla's."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, label in ((1, "1 seq: mask / causal"), (4, "4 seqs: mask / varlen")):
        pts = [(sp.seq_len, sp.ratio if sp.slower == "mask" else 1 / sp.ratio)
               for sp in speedups if sp.num_seqs == n]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"this machine, {label}")
    ax.plot(list(TT_XLA), list(TT_XLA.values()), marker="s", linestyle="--", label="tt-xla, 1 seq")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total tokens L")
    ax.set_ylabel("masked time / mask-free time")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
