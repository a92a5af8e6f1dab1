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
    BenchShape,
    Run,
    Sample,
    WholeModelBench,
    grid,
    interleaved,
    ratios,
    run_bench,
    split_lengths,
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

    def shapes(self) -> list[BenchShape]:
        return [BenchShape(64, 1), BenchShape(128, 2)]

    def start(self) -> None:
        self.events.append("start")

    def runs(self, shape: BenchShape) -> Mapping[MaskMode, Run]:
        if (shape.seq_len, shape.num_seqs) == self.fail_at:
            raise RuntimeError("out of memory")

        def run(mode: MaskMode) -> Callable[[], Sample]:
            def call() -> Sample:
                self.calls.append((shape.seq_len, mode.value))
                return {"call": float(next(self.ticks)), "other": 1.0}
            return call
        return {mode: run(mode) for mode in self.modes}

    def facts(self, shape: BenchShape, mode: MaskMode) -> dict[str, float | None]:
        return {"graph_mib": float(shape.seq_len)}

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


def test_spread_lengths_keep_the_total_grow_with_the_index_and_give_each_sequence_a_token():
    assert split_lengths(1024, 4, "spread") == [103, 205, 307, 409]  # 1 + 1020 * (1, 2, 3, 4) / 10
    assert split_lengths(1024, 4) == [256] * 4 and split_lengths(10, 4) == [3, 3, 2, 2]
    for total, n in ((128, 16), (4096, 16), (16, 16), (7, 3)):
        lens = split_lengths(total, n, "spread")
        assert sum(lens) == total and min(lens) >= 1 and lens == sorted(lens)
    assert split_lengths(16, 16, "spread") == [1] * 16
    assert split_lengths(4096, 16, "spread")[-1] > 1.8 * 4096 / 16  # the longest near 2n/(n+1) of the mean
    assert split_lengths(100, 1, "spread") == [100]


def test_the_grid_times_one_sequence_once_and_several_under_each_split():
    assert [(s.seq_len, s.num_seqs, s.split) for s in grid((64, 256), (1, 4), ("equal", "spread"))] == [
        (64, 1, "equal"), (64, 4, "equal"), (64, 4, "spread"), (256, 1, "equal"), (256, 4, "equal"),
        (256, 4, "spread")]
    assert [s.split for s in grid((64,), (1, 4), ("spread",))] == ["spread", "spread"]
    assert BenchShape(64, 4, "spread").layout().q_lens == (7, 13, 19, 25)


def test_ratios_keep_the_splits_of_one_length_and_count_apart():
    def row(split: str, mode: str, ms: float) -> BenchRow:
        return BenchRow(1024, 4, mode, {"call": (ms,)}, split=split)

    rows = [row("equal", "mask", 4.0), row("equal", "rows", 1.0), row("spread", "mask", 4.0), row("spread", "rows", 2.0)]
    found = ratios(rows, "call")
    assert [(r.split, r.faster, r.ratio) for r in found] == [("equal", "rows", 4.0), ("spread", "rows", 2.0)]
    assert found[1].over == {"call": {"mask": 1.0, "rows": 0.5}}


def test_the_attention_json_keeps_its_keys_and_times_the_mask_build_of_mask_only():
    level = AttentionBench(BenchSettings(lengths=(16,), seqs=(1, 4), repeats=2, warmup=0, heads=2, kv_heads=1,
                                         head_dim=8, threads=None))
    data = level.to_json(run_bench(level))
    assert [(r["num_seqs"], r["split"], r["mode"]) for r in data["rows"]] == [
        (1, "equal", "causal"), (1, "equal", "mask"), (1, "equal", "rows"),
        (4, "equal", "mask"), (4, "equal", "varlen"), (4, "equal", "rows"),
        (4, "spread", "mask"), (4, "spread", "varlen"), (4, "spread", "rows")]
    for r in data["rows"]:
        assert list(r) == ["seq_len", "num_seqs", "split", "mode", "impl", "median_ms", "min_ms", "max_ms",
                           "mask_build_ms"]
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert (r["mask_build_ms"] is not None) == (r["mode"] == "mask")
    assert [list(sp) for sp in data["speedups"]] == [
        ["seq_len", "num_seqs", "split", "faster", "slower", "ratio", "noisy"]] * 3
    assert [(sp["num_seqs"], sp["split"]) for sp in data["speedups"]] == [(1, "equal"), (4, "equal"), (4, "spread")]
    assert data["env"]["threads"] == torch.get_num_threads()


def test_the_model_level_times_rows_beside_the_others_at_equal_and_spread_lengths():
    level = WholeModelBench("qwen3:layers=1,hidden=32,heads=2,kv_heads=1,intermediate=32,vocab=64", (16,),
                            seqs=(1, 3), splits=("equal", "spread"), backend="none", repeats=1, warmup=0,
                            threads=None)
    rows = run_bench(level)
    data = level.to_json(rows)
    assert [(r["num_seqs"], r["split"], r["mode"]) for r in data["rows"]] == [
        (1, "equal", "causal"), (1, "equal", "mask"), (1, "equal", "rows"),
        (3, "equal", "mask"), (3, "equal", "varlen"), (3, "equal", "rows"),
        (3, "spread", "mask"), (3, "spread", "varlen"), (3, "spread", "rows")]
    assert all(r["compile_s"] > 0 and r["compiled_ms"] > 0 and r["eager_ms"] > 0 for r in data["rows"])
    by = {(r["num_seqs"], r["split"], r["mode"]): r for r in data["rows"]}
    # the rows graphs differ with the split: 3 rows of 6 tokens (6, 5, 5), then of 8 (3, 5, 8)
    assert by[(3, "spread", "rows")]["estimate_mib"] > by[(3, "equal", "rows")]["estimate_mib"]
    assert [(r["num_seqs"], r["split"], sorted(r["compiled"])) for r in data["ratios"]] == [
        (1, "equal", ["causal", "mask", "rows"]), (3, "equal", ["mask", "rows", "varlen"]),
        (3, "spread", ["mask", "rows", "varlen"])]
    spread = data["ratios"][2]
    assert spread["compiled"]["rows"] == pytest.approx(by[(3, "spread", "rows")]["compiled_ms"]
                                                       / by[(3, "spread", "mask")]["compiled_ms"])
    assert spread["eager"]["mask"] == 1.0
