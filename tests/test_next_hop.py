"""A stage's next hop comes from its node, never from a frame (`node.pipeline.next_hop`, and
`node.hosting.stages.feed_next_hop` on the node's side).

The stage is a real process (`python -m node.pipeline.stage --next-from-stdin`) on 127.0.0.1 with
real handshakes; its "node" is this test writing `NextHop` frames to its stdin, and its upstream
is this test as a member that says HELLO with a route naming a stranger. The node's side asks a
fake mesh on trio's mock clock, as tests/test_stage_route.py does. Real nodes doing all of it:
tests/test_stage_link_nodes.py and tests/test_pipeline_instances.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from node.hosting.stages import ADDRESS_POLL, ROUTE_CHECK_INTERVAL, StageRoute, feed_next_hop, next_stage
from node.pipeline.frames import Frame, Kind
from node.pipeline.gate import Gate
from node.pipeline.hop import InLink, OutLink, dial_member, listen
from node.pipeline.link_auth import OPEN
from node.pipeline.next_hop import NextHopFeed
from node.pipeline.stage_wire import NextHop, decode_next_hop, encode_next_hop
from protocol.framing import FrameDecoder
from tests.stage_process import StageProcess, spawn_stage, wait_ready
from tests.test_stage_route import RECORD, StageNodes, run
from tests.waiting import wait_until

LAYERS = 2
"""The random model's layers: the stage runs [1, 2), the last one, and links back to a driver."""


def _hop(address: str | None) -> bytes:
    return encode_next_hop(NextHop(address=address))


def test_the_feed_keeps_the_latest_hop_and_its_end_stops_the_stage() -> None:
    read, write = os.pipe()
    closed = threading.Event()
    with os.fdopen(read, "rb") as stream, os.fdopen(write, "wb", buffering=0) as pipe:
        feed = NextHopFeed(stream, on_closed=closed.set)
        assert feed.current() is None
        whole = _hop(None) + _hop("10.0.0.3:7002") + _hop("10.0.0.3:7009")
        pipe.write(whole[:5])  # a frame split across writes is read whole
        pipe.write(whole[5:])
        wait_until(lambda: feed.current() == ("10.0.0.3", 7009), 5, "the latest hop read")
        assert not closed.is_set()
    assert closed.wait(5)


def test_a_malformed_frame_from_the_node_stops_the_stage() -> None:
    read, write = os.pipe()
    closed = threading.Event()
    with os.fdopen(read, "rb") as stream, os.fdopen(write, "wb", buffering=0) as pipe:
        NextHopFeed(stream, on_closed=closed.set)
        pipe.write(encode_next_hop(NextHop(address="no port")))
        assert closed.wait(5)


class Listener:
    """A driver's door (a `Gate` for the last stage's link back), or a stranger's plain one."""

    def __init__(self, *, member: bool) -> None:
        self.socket = listen("127.0.0.1", 0)
        self.address = "{}:{}".format(*self.socket.getsockname()[:2])
        self.gate = Gate(self.socket, OPEN, boundary=LAYERS, name="driver") if member else None
        self.dialed = 0
        if not member:
            self.socket.settimeout(0.2)
            threading.Thread(target=self._count, daemon=True).start()

    def _count(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                with contextlib.suppress(TimeoutError):
                    conn, _ = self.socket.accept()
                    self.dialed += 1
                    conn.close()

    def hello(self, timeout: float = 30) -> Frame:
        """The HELLO of the stage that dialed us (failing the test if none comes)."""
        assert self.gate is not None
        admitted = self.gate.admitted(timeout)
        assert admitted is not None, f"the stage never dialed {self.address}"
        link = InLink(admitted[0], name="last stage", cipher=admitted[1], timeout=5)
        try:
            frame = link.recv(timeout=5)
            assert frame is not None
            return frame
        finally:
            link.close()

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
        self.socket.close()


@pytest.fixture
def fed_stage(random_model_dir: Path) -> Iterator[StageProcess]:
    stage = wait_ready(spawn_stage(random_model_dir, start=1, next_from_stdin=True, die_with_parent=True))
    try:
        yield stage
    finally:
        stage.stop()


def _upstream(stage: StageProcess, stranger: Listener) -> OutLink:
    """A member connecting as the previous stage, its HELLO naming the stranger as the next hop."""
    sock, cipher = dial_member(stage.address, OPEN, 1, timeout=10)
    out = OutLink(sock, name="stage 1", cipher=cipher)
    out.send(Frame(Kind.HELLO, meta={"route": [stranger.address]}))
    return out


def test_a_fed_stage_dials_only_where_its_node_says(fed_stage: StageProcess) -> None:
    stdin = fed_stage.process.stdin
    assert stdin is not None
    first, moved, stranger = Listener(member=True), Listener(member=True), Listener(member=False)
    try:
        stdin.write(_hop(first.address))
        stdin.flush()
        upstream = _upstream(fed_stage, stranger)
        assert first.hello().kind == Kind.HELLO
        upstream.close()  # the ring breaks; the node meanwhile says the driver moved
        stdin.write(_hop(moved.address))
        stdin.flush()
        upstream = _upstream(fed_stage, stranger)
        assert moved.hello().kind == Kind.HELLO
        upstream.close()
        assert stranger.dialed == 0
        stdin.close()  # the node stops its stage by closing its stdin
        assert fed_stage.process.wait(10) == 0
    finally:
        for door in (first, moved, stranger):
            door.close()


def test_the_node_writes_each_new_answer_for_the_next_hop() -> None:
    last = RECORD.stages[-1]
    assert next_stage(RECORD, last) == RECORD.stages[0]  # the last stage's next hop: the driver
    assert next_stage(RECORD, RECORD.stages[1]) == last
    nodes = StageNodes(
        {
            # The entry's driver: loading, up, its runner restarting, up on another port.
            "entry": [(0.0, None), (1.2, "10.0.0.1:6000"), (5.0, None), (6.2, "10.0.0.1:6001")],
        }
    )
    sent: list[tuple[float, str | None]] = []

    async def send(frame: bytes) -> bool:
        (body,) = FrameDecoder(1024).feed(frame)
        sent.append((trio.current_time(), decode_next_hop(bytes(body)).address))
        return len(sent) < 2  # the process is gone after the second

    async def main() -> None:
        route = StageRoute(nodes, RECORD)
        with trio.fail_after(60):
            await feed_next_hop(send, lambda: route.ask(RECORD.stages[0]))

    run(main)
    poll, check = ADDRESS_POLL, ROUTE_CHECK_INTERVAL
    # Asked every poll until 1.2 s, then every check while known, every poll again while down.
    known_at = 3 * poll
    down_at = known_at + 2 * check  # 5.5: the first check after 5.0 finds it down
    assert sent == [(known_at, "10.0.0.1:6000"), (down_at + 2 * poll, "10.0.0.1:6001")]
    assert set(nodes.times("entry")) >= {known_at, known_at + check, down_at, down_at + poll}
