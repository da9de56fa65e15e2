"""The entry node's questions to its later stages (`node.hosting.stages.StageRoute`), on trio's mock
clock: how often it asks while a stage is not ready, and when it notices that a stage moved.

The stage nodes are a fake mesh whose answers come from `answer_stage_address`, as a real node's do;
each node's stage address is a schedule over (mock) time. Real processes moving a stage:
tests/test_pipeline_instances.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from node.hosting.stages import ADDRESS_POLL, ROUTE_CHECK_INTERVAL, StageRoute, answer_stage_address
from node.net.mesh import RequestError
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.control_wire import StageAddress, decode_control, encode_control
from protocol.ids import InstanceId, ModelId, NodeId

RECORD = InstanceRecord(
    InstanceId("i1"),
    ModelId("m"),
    tuple(StageAssignment(NodeId(node), i, i + 1) for i, node in enumerate(["entry", "b", "c"])),
)

Schedule = list[tuple[float, str | None]]
"""(from this time on, the stage's address; None: not ready). "silent" as an address: no answer."""


class StageNodes:
    """The later stages' nodes, answering from their schedules; every question is logged."""

    def __init__(self, schedules: dict[str, Schedule]) -> None:
        self.schedules = schedules
        self.asked: list[tuple[float, str]] = []

    def addrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1/p2p/entry"]

    async def request(self, peer_id: str, payload: bytes, protocol: str = "") -> bytes:
        now = trio.current_time()
        self.asked.append((now, peer_id))
        address = next((a for since, a in reversed(self.schedules[peer_id]) if since <= now), None)
        if address == "silent":
            raise RequestError(f"{peer_id} did not answer")
        question = decode_control(payload)
        assert isinstance(question, StageAddress)
        return encode_control(answer_stage_address(question, RECORD, peer_id, address))

    def times(self, node: str) -> list[float]:
        return [at for at, peer in self.asked if peer == node]


def run(main: Callable[[], Awaitable[None]]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_collect_asks_every_poll_until_each_stage_answers_in_layer_order() -> None:
    nodes = StageNodes(
        {
            "b": [(0.0, None), (1.2, "10.0.0.2:7001")],  # loading its layers until 1.2 s
            "c": [(0.0, "silent"), (2.1, "10.0.0.3:7002")],  # its node unreachable until 2.1 s
        }
    )
    got: list[tuple[float, tuple[str, ...]]] = []

    async def main() -> None:
        route = await StageRoute(nodes, RECORD).collect()
        got.append((trio.current_time(), route))

    run(main)
    poll = ADDRESS_POLL
    assert nodes.times("b") == [0.0, poll, 2 * poll, 3 * poll]  # 1.5: the first ask after 1.2
    assert nodes.times("c") == [3 * poll, 4 * poll, 5 * poll]  # then c: 1.5 and 2.0 unanswered
    assert got == [(5 * poll, ("10.0.0.2:7001", "10.0.0.3:7002"))]


def test_wait_moved_returns_at_the_first_check_after_a_stage_moved() -> None:
    known = ("10.0.0.2:7001", "10.0.0.3:7002")
    nodes = StageNodes(
        {
            # b restarts in place: down, unreachable, back on its port; none of that is a move.
            "b": [(0.0, known[0]), (1.0, None), (3.0, "silent"), (4.5, known[0])],
            # c has to move (its port was taken) at 5.0 s.
            "c": [(0.0, known[1]), (5.0, "10.0.0.3:7009")],
        }
    )
    returned: list[float] = []

    async def main() -> None:
        await StageRoute(nodes, RECORD).wait_moved(known)
        returned.append(trio.current_time())

    run(main)
    checks = [ROUTE_CHECK_INTERVAL * k for k in (1, 2, 3)]  # 2, 4, 6 s: one question per stage each
    assert nodes.times("b") == checks and nodes.times("c") == checks
    assert returned == [checks[-1]]
