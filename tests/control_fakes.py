"""Fakes shared by the leader-control, instance-request and replica tests: a cluster, a shape reader, file
hashing and a mesh, all in one process under trio's MockClock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from node.control.leader import LeaderControl
from node.control.requests import InstanceRequests
from node.control.shapes import ShapeCache
from node.files.cluster import Described
from protocol.cluster import ClusterState, NotLeaderError
from protocol.cluster_records import InstanceRecord
from protocol.control_wire import (
    PlaceInstance,
)
from protocol.election import Decision
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import FileEntry, manifest_of
from protocol.membership import MemberState, Status, View
from protocol.placement import ModelShape

ME, OTHER = NodeId("a-leader"), NodeId("b-other")
GIB = 2**30
SHAPE = ModelShape.uniform(
    ModelId("tiny"), num_layers=4, bytes_per_layer=GIB // 4, embedding_bytes=0, head_bytes=0
)
"""1 GiB in all: fits an 8 GiB node, not a 512 MiB one."""


class FakeCluster:
    """The parts of `ClusterService` the leader uses, over a real `ClusterState`."""

    def __init__(self, memory: dict[NodeId, int]) -> None:
        self.me = ME
        self.state = ClusterState.empty().with_leader_claim(ME, 1)
        self.view = View.empty()
        self.decision = Decision(ME, 1, ME, claim=False)
        self.memory = memory
        self.leading = True
        self.asked_memory_at: list[float] = []
        self._changed = trio.Event()

    @property
    def is_leader(self) -> bool:
        return self.leading

    def alive_memory(self) -> dict[NodeId, int]:
        self.asked_memory_at.append(trio.current_time())
        return dict(self.memory)

    async def put_instance(self, record: InstanceRecord) -> None:
        if not self.leading:
            raise NotLeaderError("not the leader")
        self.state = self.state.with_instance(ME, 1, record)

    async def remove_instance(self, instance_id: InstanceId) -> None:
        self.state = self.state.without_instance(ME, 1, instance_id)

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def changed(self) -> None:
        """Wake what waits for a change of the state (a test wrote one)."""
        self._changed.set()
        self._changed = trio.Event()

    def dies(self, node: NodeId) -> None:
        self.view = View({node: MemberState(node, Status.DEAD, 0, 0, 0.0)})
        self.memory.pop(node)


class Reader:
    """Reads model shapes like `ModelFiles.shape`, counting what it had to resolve."""

    def __init__(self, delay: float = 0.0) -> None:
        self.read: list[str] = []
        self.delay = delay

    async def __call__(self, source: str) -> ModelShape:
        self.read.append(source)
        await trio.sleep(self.delay)
        if source != "tiny":
            raise ValueError(f"model {source!r} not found")
        return SHAPE


def leader_of(memory: dict[NodeId, int]) -> tuple[FakeCluster, LeaderControl]:
    cluster = FakeCluster(memory)
    return cluster, LeaderControl(cluster, rand=lambda: 0.5)


def run(main: Callable[[], Awaitable[None]]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


MANIFEST = manifest_of([FileEntry(path="model.safetensors", size=GIB, sha256="a" * 64)])


def ask(model: str = "tiny", **kwargs: object) -> PlaceInstance:
    fields = {"model": model, "source": model, "shape": SHAPE, "manifest": MANIFEST, **kwargs}
    return PlaceInstance.model_validate(fields)


class Files:
    """Hashes models like `ClusterFiles.describe`, counting what it hashed."""

    def __init__(self) -> None:
        self.described: list[str] = []
        self.known_ones: dict[str, Described] = {}

    async def describe(self, source: str) -> Described:
        self.described.append(source)
        self.known_ones[source] = Described(MANIFEST, "org/tiny")
        return self.known_ones[source]

    def known(self, source: str) -> Described | None:
        return self.known_ones.get(source)


class FakeMesh:
    def __init__(self, answer: Callable[[bytes], bytes]) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def request(self, peer_id: str, payload: bytes, protocol: str = "") -> bytes:
        self.asked.append(peer_id)
        return self.answer(payload)


def requests_of(
    cluster: FakeCluster, answer: Callable[[bytes], bytes], reader: Reader, files: Files | None = None
) -> tuple[InstanceRequests, FakeMesh]:
    mesh = FakeMesh(answer)
    shapes = ShapeCache(reader)
    return InstanceRequests(cluster, mesh, LeaderControl(cluster), shapes, files), mesh
