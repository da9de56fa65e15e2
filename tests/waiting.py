"""The one way tests wait for a condition that has no event: a poll, bounded in time and in count.

`wait_until` is for other processes (nodes, runners, stages): it blocks the thread, and a check that
raises counts as "not yet" (a node that is restarting refuses connections). `wait_until_async` is
for trio code in this process: it sleeps on trio's clock, so under `trio.testing.MockClock` a wait
costs no real time, and a check that raises is a bug, so the exception propagates. Both return the
first truthy value the check gave, and both fail with an `AssertionError` that names what was
awaited, how long and how many times it was checked, and what the last check said.

Neither returns how long it took: a correctness test asserts what happened, not how fast
(`bench/` reports speed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class _Polls:
    """The budget of one wait: at most `timeout` s on `clock` and `timeout / interval + 2` checks."""

    def __init__(self, what: str, timeout: float, interval: float, clock: Callable[[], float]) -> None:
        if timeout <= 0 or interval <= 0:
            raise ValueError(f"need a positive timeout and interval, got {timeout} and {interval}")
        self._what, self._timeout, self._interval, self._clock = what, timeout, interval, clock
        self._deadline = clock() + timeout
        self._max_checks = math.ceil(timeout / interval) + 2
        self._checks = 0

    def pause_after(self, answer: object) -> float:
        """Count a check that gave the falsy `answer`: the pause before the next one, or the
        `AssertionError` that ends the wait when the time or the checks are spent."""
        self._checks += 1
        left = self._deadline - self._clock()
        if left <= 0 or self._checks >= self._max_checks:
            raise AssertionError(
                f"not {self._what} within {self._timeout}s ({self._checks} checks; the last gave {answer!r})"
            )
        return min(self._interval, left)


def wait_until(check: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05) -> T:
    """Call `check` every `interval` s until it returns something truthy, and return that.

    At most `timeout` s of real time and `timeout / interval + 2` calls; an exception from `check`
    counts as a falsy answer (and is reported if it was the last one).
    """
    polls = _Polls(what, timeout, interval, time.monotonic)
    while True:
        try:
            if value := check():
                return value
            answer: object = value
        except Exception as exc:  # a node may be restarting: keep polling until the deadline
            answer = exc
        time.sleep(polls.pause_after(answer))


async def wait_until_async(check: Callable[[], T], timeout: float, what: str, *, interval: float = 0.01) -> T:
    """`wait_until` for trio code: `check` every `interval` s of trio's clock (the mock one too),
    at most `timeout` s and `timeout / interval + 2` calls. An exception from `check` propagates."""
    polls = _Polls(what, timeout, interval, trio.current_time)
    while not (value := check()):
        await trio.sleep(polls.pause_after(value))
    return value
