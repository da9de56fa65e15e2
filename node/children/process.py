"""Start a child tied to this process's life, stop it, read its ready frame; all synchronous.

The tie has two halves. Here, on Linux, `spawn` asks the kernel for SIGKILL when we die
(PR_SET_PDEATHSIG), however we die. In the child, a portable second line (what macOS gets):
a runner exits when its stdin closes; a stage process, which reads no stdin, runs
`exit_when_orphaned` (its `--parent-pid`).

PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process. So `spawn`
forks on the calling thread, which for the node is trio's (the main thread): trio's own
`open_process` forks on a worker thread that ends after 10 s idle, and its children then got
SIGKILL (measured: dead 12 s after the start, trio 0.35).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from protocol.framing import FrameDecoder, encode

log = logging.getLogger("shoal.children")

PARENT_POLL = 0.5
"""Seconds between a child's checks that its parent still lives (where the kernel cannot tell it)."""
HEARTBEAT_S = 1.0
"""How often a stage or rank process tells its node it is not frozen (`keep_beating`): an empty
frame on its stdout after the ready one. MLX releases the GIL while it computes, so a busy
process still beats; one stopped or stuck in a lock does not (`Child.watch` kills it)."""


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the forking thread, and so the parent, dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    command: Sequence[str], *, env: Mapping[str, str] | None, stdin: bool, die_with_parent: bool = True
) -> subprocess.Popen[bytes]:
    """Start `command` with its stdout a pipe to us (the child's frames) and, if `stdin`, its stdin
    a pipe from us (else /dev/null); stderr is ours (the child's log lines join the node's)."""
    return subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env=None if env is None else dict(env),
        preexec_fn=_die_with_parent if die_with_parent else None,
    )


def terminate(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_first_frame(stream: IO[bytes], *, max_bytes: int, timeout: float) -> bytearray | None:
    """The child's first frame from its stdout; None if the pipe closed first (the child died),
    TimeoutError if it stayed silent for `timeout` seconds. Reads no byte past that frame."""
    decoder = FrameDecoder(max_bytes)
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(timeout=left):
                continue
            count = os.readv(fd, [decoder.writable()])
            if count == 0:
                return None
            if (frame := decoder.advance(count)) is not None:
                return frame
    raise TimeoutError(f"no ready frame within {timeout:.0f}s")


def exit_when_orphaned(parent: int) -> None:
    """In the child: a watcher thread that exits this process once `parent` is gone (we were
    re-parented). Portable, unlike PR_SET_PDEATHSIG, and a second line where that one works."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        log.warning("the node that started this process is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def keep_beating(out: IO[bytes]) -> None:
    """In a child, after its ready frame on `out`: an empty frame every `HEARTBEAT_S` from a thread
    of its own, until whoever reads `out` stops (a closed pipe ends the thread, never the child)."""
    beat = encode(b"", 0)

    def run() -> None:
        while True:
            try:
                out.write(beat)
                out.flush()
            except (OSError, ValueError):
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=run, name="heartbeat", daemon=True).start()
