"""The one child-process supervisor (`node.children`): real child processes for the pipes, the
handshake, the stop and the tie to the parent; trio's MockClock for the waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import trio
import trio.testing

from node.children.supervisor import ChildFailed, Launch, keep_restarting, running
from protocol.framing import encode

ENV = dict(os.environ)

ECHO = """
import os, struct, sys
def exactly(n):
    data = b""
    while len(data) < n:
        data += os.read(0, n - len(data)) or sys.exit(5)
    return data
body = exactly(struct.unpack(">I", exactly(4))[0])
os.write(1, struct.pack(">I", len(body)) + body)  # the ready frame: the spec, back
while data := os.read(0, 65536):
    os.write(1, data)
"""
"""Says ready with the spec it got as its first frame, then echoes bytes until its stdin closes.
Written with `struct`, not `protocol.framing`: the test checks the format, not the code twice."""

SILENT = "import time; time.sleep(600)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_spec_goes_in_first_and_the_ready_frame_comes_back_then_frames_flow() -> None:
    async def main() -> int | None:
        launch = Launch(python(ECHO), ENV, 1024, spec_frame=encode(b"the spec", 1024))
        async with running(launch) as child:
            assert await child.handshake(timeout=60) == b"the spec"
            assert await child.send(encode(b"one", 1024) + encode(b"", 1024) + encode(b"three", 1024))
            assert [await child.receive_frame() for _ in range(3)] == [b"one", b"", b"three"]
        return child.returncode

    assert trio.run(main) == 0  # closing its stdin told it to finish: it exited by itself


def test_a_child_that_dies_before_its_ready_frame_is_reported_with_its_exit_code() -> None:
    async def main() -> None:
        async with running(Launch(python("import sys; sys.exit(3)"), ENV, 64)) as child:
            with pytest.raises(ChildFailed, match="exited with 3 before it was ready"):
                await child.handshake(timeout=60)

    trio.run(main)


def test_a_silent_child_fails_the_handshake_at_its_timeout_and_is_stopped() -> None:
    """On the mock clock: 300 s of silence cost no real time."""

    async def main() -> tuple[float, int | None]:
        async with running(Launch(python(SILENT), ENV, 64)) as child:
            with pytest.raises(ChildFailed, match="not ready within 300s"):
                await child.handshake(timeout=300)
            waited = trio.current_time()
        return waited, child.returncode

    waited, code = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited == pytest.approx(300)
    assert code is not None and code < 0  # SIGTERM, or SIGKILL once the (mock) grace ran out


BEATING = """
import os, sys, time
from node.children.process import keep_beating
from protocol.framing import encode
out = os.fdopen(os.dup(1), "wb")
out.write(encode(b"ready", 64)); out.flush()
keep_beating(out)
time.sleep(float(sys.argv[1]))
"""
"""Ready, then beats (`keep_beating`) for argv[1] seconds and exits."""


def test_a_beating_child_is_watched_until_it_exits_and_a_frozen_one_is_killed() -> None:
    async def main() -> None:
        async with running(Launch([*python(BEATING), "3"], ENV, 64)) as child:
            assert await child.handshake(timeout=60) == b"ready"
            assert not await child.watch(silent_s=2.5)  # beats for 3 s (past 2.5), then exits
            assert await child.wait() == 0
        async with running(Launch([*python(BEATING), "600"], ENV, 64)) as child:
            assert await child.handshake(timeout=60) == b"ready"
            os.kill(child.pid, signal.SIGSTOP)  # frozen: its beats stop
            started = trio.current_time()
            assert await child.watch(silent_s=2.5)
            assert trio.current_time() - started < 10
            assert await child.wait() == -signal.SIGKILL

    trio.run(main)


@pytest.mark.parametrize(("ignores_sigterm", "ended_by"), [(False, signal.SIGTERM), (True, signal.SIGKILL)])
def test_a_child_without_stdin_gets_sigterm_then_sigkill_after_its_grace(
    ignores_sigterm: bool, ended_by: signal.Signals
) -> None:
    ready_then_wait = "import os, signal, time\n"
    if ignores_sigterm:
        ready_then_wait += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    ready_then_wait += "os.write(1, bytes(4)); time.sleep(600)"

    async def main() -> int | None:
        async with running(Launch(python(ready_then_wait), ENV, 64, stop_grace_s=0.5)) as child:
            assert await child.handshake(timeout=60) == b""
        return child.returncode

    assert trio.run(main) == -ended_by


def test_keep_restarting_waits_the_backoff_after_each_run_and_stops_when_told() -> None:
    starts: list[float] = []
    delays: list[float] = []

    async def run_once() -> int:
        starts.append(trio.current_time())
        await trio.sleep(1.0)
        return len(starts)

    def again(result: int, delay: float) -> bool:
        delays.append(delay)
        return result < 4

    async def main() -> int:
        return await keep_restarting(run_once, again, rand=lambda: 0.5)

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 4
    assert delays == pytest.approx([0.5, 1.0, 2.0, 4.0])
    assert starts == pytest.approx([0.0, 1.5, 3.5, 6.5])  # each run lasted 1 s, then its delay


PARENT = f"""
import sys, trio
import trio._core._thread_cache as thread_cache
from node.children.supervisor import Launch, running
thread_cache.IDLE_TIMEOUT = 0.1  # trio's idle worker threads end at once: a child forked on one dies
async def main():
    async with running(Launch([sys.executable, "-c", {SILENT!r}], {{}}, 64)) as child:
        await trio.to_thread.run_sync(print, child.pid)  # a worker thread, which then idles out
        sys.stdout.flush()
        await trio.sleep(600)
trio.run(main)
"""


def test_a_child_outlives_trio_worker_threads_but_not_its_parent() -> None:
    """PR_SET_PDEATHSIG follows the thread that forked: the child must be forked on trio's own
    thread, not a worker (as `trio.lowlevel.open_process` does), yet die with the process."""
    parent = subprocess.Popen(python(PARENT), stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(1.0)  # ten times the worker threads' idle timeout
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, "killed with a thread"
        parent.kill()
        parent.wait(10)
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, "the child outlived its parent"
    finally:
        parent.kill()
