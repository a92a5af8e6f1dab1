"""The one benchmark pipeline (``attnpolicy bench``, ``bench --model``): modes
interleaved per shape, one row per (shape, mode) of each measure's rounds, a shape's
modes side by side, whatever the level and however many modes it compares."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from attnpolicy.bench.mode_timing import (
    AttentionBench,
    BenchRow,
    Run,
    Sample,
    interleaved,
    ratios,
    run_bench,
)
from attnpolicy.bench.settings import BenchSettings
from attnpolicy.core.modes import MaskMode


class Scripted:
    """A level whose rounds return scripted ms (no torch work), one per call, in call
    order; ``modes`` is the table of modes it compares, as a level's own is."""

    measure = "call"
    warmup, repeats, threads = 1, 3, None

    def __init__(self, modes: tuple[MaskMode, ...], fail_at: tuple[int, int] | None = None) -> None:
        self.modes, self.fail_at = modes, fail_at
        self.ticks = itertools.count(1)
        self.calls: list[tuple[int, str]] = []
        self.events: list[str] = []

    def shapes(self) -> list[tuple[int, int]]:
        return [(64, 1), (128, 2)]

    def start(self) -> None:
        self.events.append("start")

    def runs(self, length: int, num_seqs: int) -> Mapping[MaskMode, Run]:
        if (length, num_seqs) == self.fail_at:
            raise RuntimeError("out of memory")

        def run(mode: MaskMode) -> Callable[[], Sample]:
            def call() -> Sample:
                self.calls.append((length, mode.value))
                return {"call": float(next(self.ticks)), "other": 1.0}
            return call
        return {mode: run(mode) for mode in self.modes}

    def facts(self, length: int, num_seqs: int, mode: MaskMode) -> dict[str, float | None]:
        return {"graph_mib": float(length)}

    def close(self) -> None:
        self.events.append("close")

    def to_json(self, rows: Sequence[BenchRow]) -> dict[str, Any]:
        return {}


def test_each_shape_times_its_modes_interleaved_one_row_per_mode_with_each_rounds_ms():
    level = Scripted((MaskMode.CAUSAL, MaskMode.MASK))
    rows = run_bench(level)
    # one warm-up round then three timed ones per shape, the modes alternating within each
    assert level.calls == [(64, "causal"), (64, "mask")] * 4 + [(128, "causal"), (128, "mask")] * 4
    assert [(r.seq_len, r.num_seqs, r.mode) for r in rows] == [
        (64, 1, "causal"), (64, 1, "mask"), (128, 2, "causal"), (128, 2, "mask")]
    assert rows[0].samples == {"call": (3.0, 5.0, 7.0), "other": (1.0, 1.0, 1.0)}
    assert rows[1].median("call") == 6.0 and rows[3].facts == {"graph_mib": 128.0}
    assert level.events == ["start", "close"]


def test_a_third_mode_is_one_more_entry_its_row_and_ratio_beside_the_others():
    rows = run_bench(Scripted((MaskMode.CAUSAL, MaskMode.MASK, MaskMode.VARLEN)))
    assert [r.mode for r in rows if r.seq_len == 64] == ["causal", "mask", "varlen"]
    first = ratios(rows, "call")[0]
    # rounds 2..4 timed: causal 4,7,10; mask 5,8,11; varlen 6,9,12
    assert (first.faster, first.slower, first.ratio) == ("causal", "mask", 8 / 7)
    assert first.over == {"call": {"causal": 1.0, "mask": 8 / 7, "varlen": 9 / 7},
                          "other": {"causal": 1.0, "mask": 1.0, "varlen": 1.0}}


def test_a_level_that_fails_is_closed():
    level = Scripted((MaskMode.CAUSAL,), fail_at=(128, 2))
    with pytest.raises(RuntimeError, match="out of memory"):
        run_bench(level)
    assert level.events == ["start", "close"]


def test_ratios_flag_a_median_far_from_its_minimum_and_compare_a_measure_only_where_every_mode_has_it():
    def row(length: int, mode: str, *call: float, build: float | None = None) -> BenchRow:
        return BenchRow(length, 4, mode, {"call": call} | ({} if build is None else {"mask_build": (build,)}))

    rows = [row(128, "mask", 0.36, 12.0, 20.0, build=0.1), row(128, "varlen", 0.35, 0.4, 0.5),
            row(256, "mask", 0.9, 1.0, 1.1, build=0.1), row(256, "varlen", 0.45, 0.5, 0.6)]
    found = {r.seq_len: r for r in ratios(rows, "call")}
    assert {n: r.noisy for n, r in found.items()} == {128: True, 256: False}
    assert (found[256].faster, found[256].slower, found[256].ratio) == ("varlen", "mask", 2.0)
    assert found[256].over == {"call": {"mask": 1.0, "varlen": 0.5}}


def test_interleaved_runs_alternate_within_each_round_and_drop_the_warmup_rounds():
    calls: list[str] = []

    def run(name: str):
        def call() -> tuple[str, int]:
            calls.append(name)
            return name, len(calls)
        return call

    out = interleaved({"causal": run("causal"), "mask": run("mask")}, warmup=1, repeats=2)
    assert calls == ["causal", "mask"] * 3
    assert out == {"causal": [("causal", 3), ("causal", 5)], "mask": [("mask", 4), ("mask", 6)]}


def test_the_attention_json_keeps_its_keys_and_times_the_mask_build_of_mask_only():
    level = AttentionBench(BenchSettings(lengths=(16,), seqs=(1, 2), repeats=2, warmup=0, heads=2, kv_heads=1,
                                         head_dim=8, threads=None))
    data = level.to_json(run_bench(level))
    assert [(r["num_seqs"], r["mode"]) for r in data["rows"]] == [(1, "causal"), (1, "mask"), (1, "rows"),
                                                                   (2, "mask"), (2, "varlen"), (2, "rows")]
    for r in data["rows"]:
        assert list(r) == ["seq_len", "num_seqs", "mode", "impl", "median_ms", "min_ms", "max_ms", "mask_build_ms"]
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert (r["mask_build_ms"] is not None) == (r["mode"] == "mask")
    assert [list(sp) for sp in data["speedups"]] == [["seq_len", "num_seqs", "faster", "slower", "ratio", "noisy"]] * 2
    assert data["env"]["threads"] == torch.get_num_threads()
