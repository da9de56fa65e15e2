"""How long to wait before trying a failing thing again. Pure: the caller passes `now` in.

Delays double from `min_s` up to `max_s`; each is scaled by a random factor in
[1 - jitter, 1 + jitter] (never above `max_s`), so that nodes that failed together do not retry
together. An attempt that ran `stable_s` or longer before it failed was a success: the sequence
starts again from `min_s`. One object per failing thing (a runner, a stage process, a model that
does not resolve); it never sleeps itself, so trio's `MockClock` drives it in tests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

_MAX_DOUBLINGS = 64
"""Past this many doublings every delay is `max_s` anyway; the cap keeps 2**n a small float."""


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    min_s: float = 0.5
    """The first delay: short, so one crash costs little."""
    max_s: float = 10.0
    """The longest delay: a thing that keeps failing is tried again at least this often."""
    jitter: float = 0.2
    """Each delay is scaled by a factor drawn from [1 - jitter, 1 + jitter]."""
    stable_s: float = 30.0
    """An attempt that lasted this long before it failed starts the sequence again."""

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError("need 0 < min_s <= max_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("need 0 <= jitter < 1")

    def delay(self, failures: int, unit: float) -> float:
        """The wait after `failures` (>= 1) failures in a row; `unit` in [0, 1) picks the jitter."""
        base = min(self.max_s, self.min_s * 2.0 ** min(max(failures, 1) - 1, _MAX_DOUBLINGS))
        return min(self.max_s, base * (1 - self.jitter + 2 * self.jitter * unit))


RESTART = BackoffPolicy()
"""For a child process that exits: 0.5 s, 1 s, 2 s ... 10 s; a run of 30 s starts again at 0.5 s."""


class Backoff:
    """The retry state of one thing: failures in a row, and the earliest time of the next attempt."""

    def __init__(self, policy: BackoffPolicy = RESTART, *, rand: Callable[[], float] = random.random):
        self.policy = policy
        self.failures = 0
        self.not_before = -math.inf
        self._rand = rand
        self._started: float | None = None

    def started(self, now: float) -> None:
        """An attempt begins now: how long it lasts decides whether its failure resets the sequence."""
        self._started = now

    def failed(self, now: float) -> float:
        """The attempt failed now; returns the delay before the next one (also kept in `not_before`)."""
        if self._started is not None and now - self._started >= self.policy.stable_s:
            self.failures = 0
        self._started = None
        self.failures += 1
        delay = self.policy.delay(self.failures, self._rand())
        self.not_before = now + delay
        return delay

    def succeeded(self) -> None:
        """The thing works: the next failure waits `min_s` again."""
        self.failures, self.not_before, self._started = 0, -math.inf, None

    def due(self, now: float) -> bool:
        """Whether another attempt may start now."""
        return now >= self.not_before
