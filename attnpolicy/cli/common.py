"""Helpers shared by the subcommands: argument types, progress, tables, JSON output."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from attnpolicy.measure.timing import DTYPES

console = Console(stderr=True)


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers, e.g. ``128,256``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The tensor spec of one attention layer: --heads, --kv-heads, --head-dim, --dtype."""
    p.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="(default: %(default)s)")


def capacity_list(text: str) -> tuple[int | None, ...]:
    """argparse type: graph-cache capacities, e.g. ``2,4,8,inf`` (``inf``: unbounded)."""
    return tuple(None if part.strip() == "inf" else int_list(part)[0] for part in str_list(text))


def str_list(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated names."""
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


@contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr; yields ``advance(label)``."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(what, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{what}: {label}")
        yield advance


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    out = Console()
    if not out.is_terminal:  # piped: do not squeeze columns into 80 characters
        out = Console(width=200)
    out.print(table)
