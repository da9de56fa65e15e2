"""The one backoff: delays doubling from min to max with jitter, reset after a stable run."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.backoff import RESTART, Backoff, BackoffPolicy
from protocol.ids import ModelId

MIDDLE = 0.5
"""A `rand` result that makes the jitter factor exactly 1."""


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (6, 10.0), (7, 10.0), (10_000, 10.0)],
)
def test_delays_double_from_min_to_max(failures: int, delay: float) -> None:
    assert RESTART.delay(failures, MIDDLE) == pytest.approx(delay)


@pytest.mark.parametrize(
    ("failures", "unit", "delay"),
    [(1, 0.0, 0.4), (1, 0.999999, 0.6), (3, 0.0, 1.6), (3, 0.75, 2.2), (6, 0.0, 8.0), (6, 0.999999, 10.0)],
)
def test_jitter_spreads_each_delay_but_never_past_max(failures: int, unit: float, delay: float) -> None:
    assert RESTART.delay(failures, unit) == pytest.approx(delay, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs", [{"min_s": 0.0}, {"min_s": 2.0, "max_s": 1.0}, {"jitter": 1.0}, {"jitter": -0.1}]
)
def test_a_policy_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(**kwargs)


def test_failures_in_a_row_double_and_a_stable_run_starts_again() -> None:
    backoff = Backoff(RESTART, rand=lambda: MIDDLE)
    delays = []
    for start in (0.0, 1.0, 3.0, 6.0):
        backoff.started(start)
        delays.append(backoff.failed(start + 0.5))
    assert delays == [0.5, 1.0, 2.0, 4.0]
    backoff.started(10.0)
    assert backoff.failed(10.0 + RESTART.stable_s) == 0.5  # it ran long enough: a fresh sequence
    backoff.started(50.0)
    assert backoff.failed(51.0) == 1.0


def test_due_says_when_the_next_attempt_may_start_and_success_clears_it() -> None:
    backoff = Backoff(BackoffPolicy(min_s=2.0, max_s=60.0), rand=lambda: MIDDLE)
    assert backoff.due(0.0)
    assert backoff.failed(100.0) == 2.0
    assert not backoff.due(101.9) and backoff.due(102.0)
    backoff.failed(102.0)
    assert backoff.not_before == 106.0
    backoff.succeeded()
    assert backoff.due(102.0) and backoff.failures == 0
    assert backoff.failed(103.0) == 2.0


def test_a_retry_loop_on_the_mock_clock_waits_the_sequence() -> None:
    """A loop that sleeps `failed()` tries at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 25.5 s: no real waiting."""
    attempts: list[float] = []

    async def main() -> None:
        backoff = Backoff(RESTART, rand=lambda: MIDDLE)
        with trio.move_on_after(30):
            while True:
                attempts.append(trio.current_time())
                backoff.started(trio.current_time())
                await trio.sleep(backoff.failed(trio.current_time()))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert attempts == pytest.approx([0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 25.5])


class _CrashingRunner(RunnerSupervisor):
    """A runner whose process lives for the given seconds, then exits (the last one never does)."""

    def __init__(self, lifetimes: list[float]) -> None:
        super().__init__(RunnerSpec(ModelId("m"), Path("/nonexistent")))
        self.lifetimes = lifetimes
        self.starts: list[float] = []

    async def _run_once(self) -> int | None:
        self.starts.append(trio.current_time())
        if len(self.starts) > len(self.lifetimes):
            await trio.sleep_forever()
        await trio.sleep(self.lifetimes[len(self.starts) - 1])
        return 1


def test_the_runner_supervisor_restarts_after_the_backoff_and_resets_after_a_long_run() -> None:
    lifetimes = [1.0, 1.0, 1.0, 40.0, 1.0, 1.0]
    runner = _CrashingRunner(lifetimes)

    async def main() -> None:
        with trio.move_on_after(sum(lifetimes) + 60):
            await runner.run()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    waits = [
        later - (start + life)
        for start, life, later in zip(runner.starts[:-1], lifetimes, runner.starts[1:], strict=True)
    ]
    expected = [0.5, 1.0, 2.0, 0.5, 1.0, 2.0]  # the 40 s run was stable: back to the first delay
    assert len(waits) == len(expected)
    for wait, delay in zip(waits, expected, strict=True):
        assert delay * (1 - RESTART.jitter) <= wait <= delay * (1 + RESTART.jitter)
    assert runner.restarts == len(runner.starts) - 1
