"""The replay driver: one loop over any level (``attnpolicy.bench.replay.replay``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from attnpolicy.bench.replay import Ran, Summary, replay
from attnpolicy.kernels.accuracy import MaxAbsError
from attnpolicy.modelling.simulation import own_keys


class _Level:
    """Three steps; step ``n`` outputs ``n`` and its reference is ``n + off * n``; each step
    takes 1 s compile, 0.5 s load, 0.25 s run; ``fail_at``: the step that raises."""

    tolerance = 0.5
    json_keys = (*own_keys("batches", "modes"), ("measured_seconds", "total_seconds"),
                 *own_keys("max_abs_err", "passed", "token_mismatches", "own"))

    def __init__(self, checks: bool, *, off: float = 0.25, mismatches: int = 0, fail_at: int | None = None) -> None:
        self.checks, self.off, self.mismatches, self.fail_at = checks, off, mismatches, fail_at
        self.checked_steps: list[int] = []
        self.closed = self.summarised = False

    def steps(self) -> Iterator[int]:
        yield from range(3)

    def run(self, step: int) -> Ran:
        if step == self.fail_at:
            raise RuntimeError(f"step {step} failed")
        return Ran(torch.full((2,), float(step)), 1.0, 0.5, 0.25, f"s{step}")

    def check(self, step: int, out: torch.Tensor, err: MaxAbsError) -> None:
        self.checked_steps.append(step)
        err.add(out, torch.full((2,), step * (1 + self.off)))

    def summary(self) -> Summary:
        self.summarised = True
        return Summary({"varlen": 3}, 1, {"own": "figure"})

    def close(self) -> None:
        self.closed = True

    def checked(self, err: MaxAbsError) -> int:
        assert self.closed  # after the runtime is closed
        return self.mismatches


def test_the_driver_sums_each_steps_seconds_and_checks_every_output():
    level, labels = _Level(True), []
    result = replay(level, labels.append)
    assert (result.batches, result.compile_seconds, result.load_seconds, result.run_seconds) == (3, 3.0, 1.5, 0.75)
    assert result.total_seconds == 5.25 and labels == ["s0", "s1", "s2"]
    assert level.checked_steps == [0, 1, 2] and level.closed
    assert (result.max_abs_err, result.non_finite, result.tolerance, result.passed) == (0.5, 0, 0.5, True)
    assert result.to_json() == {"batches": 3, "modes": {"varlen": 3}, "measured_seconds": 5.25,
                                "max_abs_err": 0.5, "passed": True, "token_mismatches": 0, "own": "figure"}


def test_an_unchecked_replay_checks_nothing_and_reports_no_check():
    level = _Level(False, mismatches=1)
    result = replay(level)
    assert level.checked_steps == [] and level.closed
    assert (result.max_abs_err, result.non_finite, result.tolerance, result.token_mismatches, result.passed) == \
        (None, None, None, None, None)


@pytest.mark.parametrize(("off", "mismatches"), [(0.3, 0), (0.25, 1)])
def test_a_check_fails_past_the_tolerance_or_on_a_differing_token(off, mismatches):
    result = replay(_Level(True, off=off, mismatches=mismatches))
    assert result.passed is False


def test_a_step_that_raises_still_closes_the_level():
    level = _Level(True, fail_at=1)
    with pytest.raises(RuntimeError, match="step 1 failed"):
        replay(level)
    assert level.closed and not level.summarised and level.checked_steps == [0]

