"""The leader's placement service and what nodes ask it, in one process: a fake cluster, MockClock."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing

from node.control.finder import ModelFinder
from node.control.leader import LeaderControl
from node.control.requests import LONE_ASK_WAIT_S, InstanceRequests
from node.control.shapes import ShapeCache
from node.files.cluster import Described
from node.models import ModelResolveError
from node.net.mesh import RequestError
from protocol.cluster import ClusterState, NotLeaderError
from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, StageAssignment
from protocol.control_wire import (
    Deleted,
    DeleteInstance,
    Exists,
    Invalid,
    ModelDescribed,
    NotFound,
    Placed,
    PlaceInstance,
    StageAddressAnswer,
    Unavailable,
    encode_control,
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
        await trio.sleep_forever()

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


def test_place_preview_exists_does_not_fit_and_not_leader_are_outcomes() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, OTHER: GIB // 2})
        preview = await leader.place(ask(preview=True))
        assert isinstance(preview, Placed) and preview.preview and cluster.state.instances() == {}
        assert preview.stage_bytes == (GIB,)
        placed = await leader.place(ask())
        assert isinstance(placed, Placed) and not placed.preview
        assert [r.model for r in cluster.state.instances().values()] == ["tiny"]
        assert await leader.place(ask()) == Exists(instance=placed.instance)
        too_many = await leader.place(ask("other", nodes=3))
        assert isinstance(too_many, Invalid) and too_many.kind == "does_not_fit"
        cluster.leading = False
        not_leader = await leader.place(ask("other"))
        assert isinstance(not_leader, Unavailable) and not_leader.kind == "not_leader"

    run(main)


def test_delete_answers_deleted_then_not_found() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB})
        placed = await leader.place(ask())
        assert isinstance(placed, Placed)
        request = DeleteInstance(instance_id=placed.instance.id)
        assert await leader.delete(request) == Deleted(instance=placed.instance)
        gone = await leader.delete(request)
        assert isinstance(gone, NotFound) and gone.kind == "instance" and cluster.state.instances() == {}

    run(main)


def test_the_shape_cache_is_read_before_anything_is_resolved() -> None:
    async def main() -> None:
        reader = Reader()
        shapes = ShapeCache(reader)
        shapes.remember("tiny", SHAPE)
        assert await shapes.get("tiny") == SHAPE and reader.read == []
        with pytest.raises(ValueError):
            await shapes.get("missing")
        with pytest.raises(ValueError):
            await shapes.get("missing")
        assert reader.read == ["missing", "missing"]  # a failure is not cached

    run(main)


def test_the_record_keeps_what_the_request_carried_and_repair_uses_it() -> None:
    """The leader has nothing to resolve a model with: it places and re-places with the shape and
    manifest of the request, kept in the record (a new leader finds them there too)."""

    async def main() -> None:
        cluster, leader = leader_of({ME: GIB // 2, OTHER: 8 * GIB})
        placed = await leader.place(ask(hub_repo="org/tiny"))
        assert isinstance(placed, Placed) and placed.instance.stages[0].node_id == OTHER
        assert placed.instance.manifest_id == MANIFEST.id
        (first,) = cluster.state.instances().values()
        assert (first.manifest, first.shape, first.hub_repo) == (MANIFEST, SHAPE, "org/tiny")
        cluster.dies(OTHER)
        cluster.memory[ME] = 8 * GIB
        async with trio.open_nursery() as nursery:
            leader.repair_nowait(nursery)
        (record,) = cluster.state.instances().values()
        assert [s.node for s in record.stages] == [ME] and record.instance_id == placed.instance.id
        assert (record.manifest, record.shape, record.hub_repo) == (MANIFEST, SHAPE, "org/tiny")

    run(main)


def test_placement_prefers_the_nodes_that_hold_the_files() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, OTHER: 4 * GIB})
        cluster.state = cluster.state.with_holdings(OTHER, NodeHoldings((Holding(MANIFEST.id),)))
        placed = await leader.place(ask())
        assert isinstance(placed, Placed) and placed.instance.stages[0].node_id == OTHER
        elsewhere = await leader.place(ask("other", manifest=None, preview=True))
        assert isinstance(elsewhere, Placed) and elsewhere.instance.stages[0].node_id == ME

    run(main)


def test_repair_that_does_not_fit_is_retried_after_a_backoff(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: GIB // 2, OTHER: 8 * GIB})
        assert isinstance(await leader.place(ask()), Placed)
        cluster.dies(OTHER)
        cluster.asked_memory_at.clear()
        async with trio.open_nursery() as nursery:
            for second in range(130):  # the manager's loop: a pass at least once a second
                if second == 70:
                    cluster.memory[ME] = 8 * GIB  # memory freed up: the next try succeeds
                leader.repair_nowait(nursery)
                await trio.sleep(1.0)
        assert cluster.asked_memory_at == pytest.approx([0, 2, 6, 14, 30, 62, 122])  # 2 s doubling to 60
        (record,) = cluster.state.instances().values()
        assert record.stages[0].node == ME

    with caplog.at_level(logging.WARNING, logger="shoal.instances"):
        run(main)
    assert len([r for r in caplog.records if "cannot be re-placed" in r.getMessage()]) == 6


def test_a_record_without_a_shape_is_left_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, OTHER: 8 * GIB})
        record = InstanceRecord(InstanceId("i1"), ModelId("tiny"), (StageAssignment(OTHER, 0, 4),), "tiny")
        await cluster.put_instance(record)
        cluster.dies(OTHER)
        async with trio.open_nursery() as nursery:
            leader.repair_nowait(nursery)
        assert list(cluster.state.instances().values()) == [record]

    with caplog.at_level(logging.WARNING, logger="shoal.instances"):
        run(main)
    assert any("carries no model shape" in r.getMessage() for r in caplog.records)


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


def test_what_a_node_asks_the_leader_comes_back_as_outcomes() -> None:
    def unreachable(payload: bytes) -> bytes:
        raise RequestError("connection refused")

    async def main() -> None:
        reader = Reader()
        cluster = FakeCluster({ME: 8 * GIB})
        requests, mesh = requests_of(cluster, unreachable, reader)
        missing = await requests.place("nowhere", None, preview=False)
        assert isinstance(missing, NotFound) and missing.kind == "model"
        assert isinstance(await requests.place("tiny", None, preview=False), Placed)  # this node leads
        assert mesh.asked == []
        cluster.decision = Decision(None, 1, ME, claim=False)
        assert isinstance(await requests.delete("x"), Unavailable)
        cluster.decision = Decision(OTHER, 2, OTHER, claim=False)
        no_answer = await requests.place("tiny", None, preview=True)
        assert isinstance(no_answer, Unavailable) and no_answer.kind == "no_answer" and mesh.asked == [OTHER]
        assert reader.read == ["nowhere", "tiny"]  # the second request found the shape in the cache
        mesh.answer = lambda payload: encode_control(StageAddressAnswer(address=None))
        wrong = await requests.delete("x")
        assert isinstance(wrong, Unavailable) and "stage_address_answer" in wrong.reason
        not_found = NotFound(kind="instance", reason="no instance 'x'")
        mesh.answer = lambda payload: encode_control(not_found)
        assert await requests.delete("x") == not_found

    run(main)


def test_a_place_request_carries_the_manifest_and_a_preview_hashes_nothing() -> None:
    async def main() -> None:
        cluster = FakeCluster({ME: 8 * GIB})
        files = Files()
        requests, _ = requests_of(cluster, lambda payload: b"", Reader(), files)
        preview = await requests.place("tiny", None, preview=True)
        assert isinstance(preview, Placed) and preview.instance.manifest_id is None and files.described == []
        placed = await requests.place("tiny", None, preview=False)
        assert isinstance(placed, Placed) and placed.instance.manifest_id == MANIFEST.id
        assert files.described == ["tiny"]
        (record,) = cluster.state.instances().values()
        assert record.manifest == MANIFEST and record.hub_repo == "org/tiny"
        again = await requests.place("tiny", None, preview=True)  # the manifest is known now
        assert isinstance(again, Placed) and again.instance.manifest_id == MANIFEST.id
        assert files.described == ["tiny"]
        # A model served already, named by its id on a node that lacks its files: it exists.
        stages = (StageAssignment(OTHER, 0, 4),)
        await cluster.put_instance(InstanceRecord(InstanceId("i9"), ModelId("held-elsewhere"), stages))
        by_id = await requests.place("held-elsewhere", None, preview=False)
        assert isinstance(by_id, Exists) and by_id.instance.id == "i9"

    run(main)


def test_ensure_places_the_model_once_there_is_a_leader() -> None:
    async def main() -> None:
        cluster = FakeCluster({ME: 8 * GIB})
        requests, _ = requests_of(cluster, lambda payload: b"", Reader())
        with trio.fail_after(5):
            await requests.ensure("tiny")
            await requests.ensure("tiny")  # already served: nothing more
        assert [r.model for r in cluster.state.instances().values()] == ["tiny"]

    run(main)


class HeldNowhere(Files):
    """A node that serves no model whole (`ClusterFiles.named`)."""

    def named(self, name: str) -> None:
        return None


class DisklessFinder(ModelFinder):
    """Resolves nothing here without a worker thread (MockClock's autojump would pass its wait)."""

    async def resolves_here(self, source: str) -> bool:
        return False


async def _never(*args: object) -> ModelShape:
    raise AssertionError("this node resolves no shape of its own here")


@pytest.mark.parametrize("peer_after", [4.0, None], ids=["a-peer-joins", "alone"])
def test_a_name_only_the_cluster_holds_is_asked_once_a_peer_is_alive(
    tmp_path: Path, peer_after: float | None
) -> None:
    """`shoal run --model held-elsewhere` on a node that elected itself before its first gossip came
    (a slow start): it asks once a peer is alive, not its empty cluster; alone, after the wait."""
    shape = replace(SHAPE, model=ModelId("held-elsewhere"))
    answer = ModelDescribed(model="held-elsewhere", shape=shape, manifest=MANIFEST)

    async def main() -> None:
        cluster = FakeCluster({ME: 8 * GIB})
        files = HeldNowhere()
        mesh = FakeMesh(lambda payload: encode_control(answer))
        finder = DisklessFinder(cluster, mesh, files, _never, _never, tmp_path)
        shapes = ShapeCache(Reader())
        requests = InstanceRequests(cluster, mesh, LeaderControl(cluster), shapes, files, finder)

        async def joins(after: float) -> None:
            await trio.sleep(after)
            cluster.view = View({OTHER: MemberState(OTHER, Status.ALIVE, 0, 0, trio.current_time())})

        with trio.fail_after(LONE_ASK_WAIT_S + 5):
            async with trio.open_nursery() as nursery:
                if peer_after is not None:
                    nursery.start_soon(joins, peer_after)
                    await requests.ensure("held-elsewhere")
                    assert set(mesh.asked) == {OTHER} and trio.current_time() < peer_after + 2
                    assert [r.model for r in cluster.state.instances().values()] == ["held-elsewhere"]
                    return
                with pytest.raises(ModelResolveError, match="nor does any node of the cluster hold"):
                    await requests.ensure("held-elsewhere")
                assert mesh.asked == [] and trio.current_time() >= LONE_ASK_WAIT_S

    run(main)


class HolderMesh(FakeMesh):
    """Peers answering DescribeModel: `holder` with `found`, any other with `nowhere`."""

    def __init__(self, holder: NodeId, found: bytes, nowhere: bytes) -> None:
        super().__init__(lambda payload: nowhere)
        self.holder, self.found = holder, found

    async def request(self, peer_id: str, payload: bytes, protocol: str = "") -> bytes:
        answer = await super().request(peer_id, payload, protocol)
        return self.found if peer_id == self.holder else answer


def test_a_name_only_the_cluster_holds_is_asked_again_when_its_holder_comes_alive(tmp_path: Path) -> None:
    """The leader's gossip came first and it holds no such model; the holder's comes a moment
    later: `shoal run --model held-elsewhere` asks again then, rather than stopping."""
    shape = replace(SHAPE, model=ModelId("held-elsewhere"))
    holder = NodeId("c-holder")
    found = encode_control(ModelDescribed(model="held-elsewhere", shape=shape, manifest=MANIFEST))
    nowhere = encode_control(NotFound(kind="model", reason="not here"))

    async def main() -> None:
        cluster = FakeCluster({ME: 8 * GIB})
        cluster.view = View({OTHER: MemberState(OTHER, Status.ALIVE, 0, 0, 0.0)})
        files = HeldNowhere()
        mesh = HolderMesh(holder, found, nowhere)
        finder = DisklessFinder(cluster, mesh, files, _never, _never, tmp_path)
        shapes = ShapeCache(Reader())
        requests = InstanceRequests(cluster, mesh, LeaderControl(cluster), shapes, files, finder)

        async def holder_joins() -> None:
            await trio.sleep(3.0)
            states = {n: MemberState(n, Status.ALIVE, 0, 0, trio.current_time()) for n in (OTHER, holder)}
            cluster.view = View(states)

        with trio.fail_after(LONE_ASK_WAIT_S + 5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(holder_joins)
                await requests.ensure("held-elsewhere")
        assert mesh.asked[:3] == [OTHER, OTHER, holder]  # then placing it asks again
        assert [r.model for r in cluster.state.instances().values()] == ["held-elsewhere"]

    run(main)
