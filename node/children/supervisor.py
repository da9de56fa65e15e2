"""The trio side of a child process: start it, hand it its spec, wait for its ready frame, stop
it, and start it again after a backoff (`protocol.backoff`) whenever it ends.

A child speaks frames (`protocol.framing`) on its stdout; its first one says it is ready. A child
with a spec gets that as the first frame on its stdin, which stays open as its command pipe and
whose closing tells it to finish (a runner); a child without one reads no stdin and is told by
SIGTERM (a stage process). Either way it gets SIGKILL after its grace period, and it never
outlives the node (`node.children.process`).
"""

from __future__ import annotations

import math
import os
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import IO, TypeVar

import trio

from node.children.process import spawn
from protocol.backoff import RESTART, Backoff, BackoffPolicy
from protocol.framing import FrameDecoder

T = TypeVar("T")

SILENT_KILL_S = 15.0
"""A child that sent its ready frame and then no heartbeat (`node.children.process.keep_beating`,
one a second) for this long is frozen: `Child.watch` kills it, and its supervisor starts it again.
Fifteen missed beats: never a busy child, and back within a failed request's link timeout (30 s)."""
EXIT_AFTER_EOF_S = 1.0
"""How long a child that closed its stdout before its ready frame gets to exit, so that its exit
code can be reported."""


class ChildFailed(Exception):
    """The child exited, or stayed silent, before its ready frame."""


@dataclass(frozen=True)
class Launch:
    """How to start one child."""

    command: Sequence[str]
    env: Mapping[str, str]
    max_frame_bytes: int
    """The cap on each frame the child sends (its wire's named limit)."""
    spec_frame: bytes | None = None
    """The first frame on its stdin (already framed); None: the child gets no stdin pipe."""
    stop_grace_s: float = 2.0
    """How long it gets to exit once told to (stdin closed, or SIGTERM) before SIGKILL."""


class Child:
    """A started child: frames from its stdout, bytes to its stdin, its exit."""

    def __init__(self, process: subprocess.Popen[bytes], *, max_frame_bytes: int) -> None:
        self._process = process
        self.pid = process.pid
        self._stdin = _stream(process.stdin)
        stdout = _stream(process.stdout)
        assert stdout is not None
        self._stdout = stdout
        self._decoder = FrameDecoder(max_frame_bytes)
        self._frames: deque[bytearray] = deque()
        self._send_lock = trio.Lock()

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def send(self, data: bytes) -> bool:
        """Write bytes to its stdin; False when it is gone (or has no stdin)."""
        if self._stdin is None:
            return False
        async with self._send_lock:
            try:
                await self._stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return True

    async def receive_frame(self) -> bytearray | None:
        """Its next frame; None once its stdout closed. `FrameError` for bytes that are no frame."""
        while not self._frames:
            data = await self._stdout.receive_some(65536)
            if not data:
                return None
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()

    async def handshake(self, timeout: float | None) -> bytearray:
        """Its ready frame; `ChildFailed` if it exits first or sends nothing for `timeout` s."""
        with trio.move_on_after(math.inf if timeout is None else timeout):
            frame = await self.receive_frame()
            if frame is not None:
                return frame
            with trio.move_on_after(EXIT_AFTER_EOF_S):
                await self.wait()
            raise ChildFailed(f"exited with {self.returncode} before it was ready")
        raise ChildFailed(f"was not ready within {timeout:.0f}s")

    async def watch(self, silent_s: float = SILENT_KILL_S) -> bool:
        """Read its heartbeats until its stdout closes; kill it (True) once it sends nothing for
        `silent_s` seconds. `FrameError` for bytes that are no frame."""
        while True:
            with trio.move_on_after(silent_s):
                if await self.receive_frame() is None:
                    return False
                continue
            if self.returncode is None:
                self._process.kill()
            return True

    async def wait(self) -> int:
        """Wait for it to exit; its exit code (negative: the signal that ended it)."""
        return await trio.to_thread.run_sync(self._process.wait, abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stubs are older

    async def stop(self, grace: float) -> None:
        """Tell it to finish (close its stdin, or SIGTERM), SIGKILL after `grace` seconds."""
        if self._stdin is not None:
            await self._stdin.aclose()
        elif self.returncode is None:
            self._process.terminate()
        with trio.move_on_after(grace):
            await self.wait()
        if self.returncode is None:
            self._process.kill()
            await self.wait()
        await self._stdout.aclose()


def _stream(pipe: IO[bytes] | None) -> trio.lowlevel.FdStream | None:
    """A trio stream on its own copy of a Popen pipe (whose file object is closed)."""
    if pipe is None:
        return None
    stream = trio.lowlevel.FdStream(os.dup(pipe.fileno()))
    pipe.close()
    return stream


@asynccontextmanager
async def running(launch: Launch) -> AsyncIterator[Child]:
    """Start the child (and send its spec frame); stop it on the way out, even when cancelled."""
    process = spawn(launch.command, env=launch.env, stdin=launch.spec_frame is not None)
    child = Child(process, max_frame_bytes=launch.max_frame_bytes)
    try:
        if launch.spec_frame is not None:
            await child.send(launch.spec_frame)  # a child that died at once shows as its EOF
        yield child
    finally:
        with trio.CancelScope(shield=True):
            await child.stop(launch.stop_grace_s)


async def keep_restarting(
    run_once: Callable[[], Awaitable[T]],
    again: Callable[[T, float], bool],
    *,
    policy: BackoffPolicy = RESTART,
    rand: Callable[[], float] | None = None,
) -> T:
    """`run_once` over and over, with the backoff's delay between the end of one run and the next
    start; `again(result, delay)` says whether to go on (it logs, counts). Returns the result
    `again` refused."""
    backoff = Backoff(policy) if rand is None else Backoff(policy, rand=rand)
    while True:
        backoff.started(trio.current_time())
        result = await run_once()
        delay = backoff.failed(trio.current_time())
        if not again(result, delay):
            return result
        await trio.sleep(delay)
