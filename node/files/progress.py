"""Progress of the models moving to this node: bytes done / total and rate, as snapshots and log lines.

A `ProgressMeter` counts one model's transfer; `ProgressBoard.snapshots()` is what the cluster view
(and through it `/v1/cluster`, `shoal status`, the dashboard) carries: `protocol.manifest.
TransferProgress` values, taken whenever the reader wants them, so the counting never waits on a
reader. The log gets one line when a transfer starts, one per 10% and one at the end, never one
per chunk. Single-threaded (the trio thread); the clock is passed in so tests can drive it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from protocol.manifest import TransferProgress, TransferSource, TransferState

log = logging.getLogger("shoal.files")

LOG_STEPS = 10
"""A log line each time another 1/LOG_STEPS of the bytes is done."""
LOG_STEPS_MIN_BYTES = 64 * 1024 * 1024
"""Smaller transfers (config and tokenizer files, a tiny model) log only their start and end."""
RATE_WINDOW_S = 5.0
"""The rate is over this much recent time: steady enough to read, recent enough to show a stall."""
SAMPLE_EVERY_S = 0.25
"""At most one rate sample per this interval, so the window holds at most ~20 samples."""
KEEP_FINISHED = 16
"""Finished (done or failed) transfers kept on the board, newest last, so a failure stays visible."""


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


class ProgressMeter:
    """The counters of one model's transfer to this node."""

    def __init__(
        self,
        *,
        manifest_id: str,
        model: str,
        source: TransferSource,
        bytes_total: int,
        files_total: int,
        clock: Callable[[], float] = time.monotonic,
        announce: bool = True,
    ) -> None:
        self.manifest_id, self.model, self.source = manifest_id, model, source
        self.bytes_total, self.files_total = bytes_total, files_total
        self.bytes_done = self.files_done = self.peers = 0
        self.state: TransferState = "fetching"
        self.error: str | None = None
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])
        self._last_change = self._samples[0][0]
        self._logged_step = 0
        if announce:
            log.info("%s: fetching %s in %d file(s) from %s", model, _mb(bytes_total), files_total, source)

    def advance(self, n: int) -> None:
        """`n` more bytes arrived (a retried piece's bytes count again: this is traffic, capped)."""
        self.set_done(self.bytes_done + n)

    def resumed(self, n: int) -> None:
        """`n` bytes were already on disk (an earlier, cut run): done, but not part of the rate."""
        self.bytes_done += n
        self._samples = deque((t, done + n) for t, done in self._samples)

    def set_done(self, done: int) -> None:
        """The bytes done so far (a hub download is measured on disk rather than counted)."""
        self.bytes_done = min(done, self.bytes_total) if self.bytes_total else done
        now = self._last_change = self._clock()
        if now - self._samples[-1][0] >= SAMPLE_EVERY_S:
            self._samples.append((now, self.bytes_done))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()
        if self.bytes_total >= LOG_STEPS_MIN_BYTES and self.state == "fetching":
            step = math.floor(self.bytes_done * LOG_STEPS / self.bytes_total)
            if step > self._logged_step and step < LOG_STEPS:
                self._logged_step = step
                log.info(
                    "%s: %d%% (%s of %s) at %.1f MB/s",
                    self.model,
                    step * 100 // LOG_STEPS,
                    _mb(self.bytes_done),
                    _mb(self.bytes_total),
                    self.rate() / 1e6,
                )

    def file_done(self) -> None:
        self.files_done += 1

    def rate(self) -> float:
        """Bytes per second over the recent window (0 before two samples or after the end)."""
        now = self._clock()
        if self.state != "fetching" or now - self._last_change >= RATE_WINDOW_S:
            return 0.0
        # From the newest sample at least a window old (the oldest if none is): a stall decays to 0.
        start_t, start_done = next(
            (s for s in reversed(self._samples) if now - s[0] >= RATE_WINDOW_S), self._samples[0]
        )
        if now - start_t < 1e-6:
            return 0.0
        return max(0.0, (self.bytes_done - start_done) / (now - start_t))

    def finish(self) -> None:
        self.bytes_done, self.files_done, self.state = self.bytes_total, self.files_total, "done"
        log.info(
            "%s: all %d file(s) here and verified (%s)", self.model, self.files_total, _mb(self.bytes_total)
        )

    def fail(self, reason: str) -> None:
        self.state, self.error = "failed", reason
        log.warning(
            "%s: transfer failed at %s of %s: %s",
            self.model,
            _mb(self.bytes_done),
            _mb(self.bytes_total),
            reason,
        )

    def snapshot(self) -> TransferProgress:
        return TransferProgress(
            manifest_id=self.manifest_id,
            model=self.model,
            source=self.source,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            rate_bps=self.rate(),
            files_done=self.files_done,
            files_total=self.files_total,
            peers=self.peers,
            error=self.error,
        )


class ProgressBoard:
    """Every transfer to this node: running ones and the last `KEEP_FINISHED` finished ones."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._meters: OrderedDict[str, ProgressMeter] = OrderedDict()

    def start(
        self, *, manifest_id: str, model: str, source: TransferSource, bytes_total: int, files_total: int
    ) -> ProgressMeter:
        """A meter for a new transfer, replacing any earlier one of the same model and source."""
        meter = ProgressMeter(
            manifest_id=manifest_id,
            model=model,
            source=source,
            bytes_total=bytes_total,
            files_total=files_total,
            clock=self._clock,
        )
        self._add(meter)
        return meter

    def _add(self, meter: ProgressMeter) -> None:
        key = f"{meter.manifest_id or meter.model}|{meter.source}"
        self._meters.pop(key, None)
        self._meters[key] = meter
        self._prune()

    def failed(self, *, manifest_id: str, model: str, source: TransferSource, reason: str) -> None:
        """Show a transfer that failed before it began (no peer holds the files), like one that
        failed midway; logs nothing (the caller reports it, with its retry)."""
        meter = ProgressMeter(
            manifest_id=manifest_id,
            model=model,
            source=source,
            bytes_total=0,
            files_total=0,
            clock=self._clock,
            announce=False,
        )
        meter.state, meter.error = "failed", reason
        self._add(meter)

    def forget_failed(self, manifest_id: str) -> None:
        """Drop the failed transfers of a model this node has now (from its own copy, say): a
        failure still shown would tell the cluster it cannot get the files."""
        for key in [
            k for k, m in self._meters.items() if m.manifest_id == manifest_id and m.state == "failed"
        ]:
            del self._meters[key]

    def snapshots(self) -> list[TransferProgress]:
        """Oldest first."""
        self._prune()
        return [meter.snapshot() for meter in self._meters.values()]

    def _prune(self) -> None:
        finished = [k for k, m in self._meters.items() if m.state != "fetching"]
        for old in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._meters[old]
