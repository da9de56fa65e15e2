"""The tests' polling helper: the first truthy answer, bounded in time and in count, a clear failure."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from tests.waiting import wait_until, wait_until_async


def test_returns_the_first_truthy_answer() -> None:
    answers: Iterator[object] = iter([None, 0, [], {"stages": 2}, {"stages": 3}])
    assert wait_until(lambda: next(answers), 5, "stages", interval=0.001) == {"stages": 2}


def test_an_exception_is_a_no_and_is_reported_when_it_was_the_last() -> None:
    calls = itertools.count()

    def refused() -> bool:
        if next(calls) < 3:
            raise ConnectionRefusedError("restarting")
        return True

    assert wait_until(refused, 5, "a node back", interval=0.001) is True

    def down() -> bool:
        raise ConnectionRefusedError("still down")

    with pytest.raises(AssertionError, match=r"not a node up within 0.05s \(\d+ checks; the last gave Conn"):
        wait_until(down, 0.05, "a node up")


def test_bounded_in_count_as_well_as_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []

    def never() -> bool:
        calls.append(None)
        return False

    with pytest.raises(AssertionError, match=r"not ready within 0.1s \(\d+ checks; the last gave False\)"):
        wait_until(never, 0.1, "ready", interval=0.02)
    assert 2 <= len(calls) <= 7
    # Pauses that take no time (a clock that stands still) still end the wait: after 0.1 / 0.02 + 2.
    calls.clear()
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    with pytest.raises(AssertionError, match=r"\(7 checks"):
        wait_until(never, 0.1, "ready", interval=0.02)
    assert len(calls) == 7


def test_rejects_a_wait_that_could_never_check() -> None:
    with pytest.raises(ValueError):
        wait_until(lambda: True, 0, "anything")
    with pytest.raises(ValueError):
        wait_until(lambda: True, 1, "anything", interval=0)


def test_the_async_wait_runs_on_trios_clock() -> None:
    """Under the mock clock a 60 s wait costs nothing real; it checks every `interval` of that clock."""
    seen: list[float] = []

    async def main() -> None:
        start = trio.current_time()

        def after_30s() -> float | None:
            seen.append(trio.current_time() - start)
            return seen[-1] if seen[-1] >= 30 else None

        assert await wait_until_async(after_30s, 60, "30 s passed", interval=10) == 30
        with pytest.raises(AssertionError, match=r"not never within 5s \(6 checks; the last gave False\)"):
            await wait_until_async(lambda: False, 5, "never", interval=1)
        with pytest.raises(ZeroDivisionError):  # in-process: an exception is a bug, not a "no"
            await wait_until_async(lambda: 1 / 0, 5, "a bug")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert seen == [0, 10, 20, 30]
