"""What nodes ask the leader (`InstanceRequests`), in one process: a fake cluster and mesh, MockClock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing

from node.control.finder import ModelFinder
from node.control.leader import LeaderControl
from node.control.requests import LONE_ASK_WAIT_S, InstanceRequests
from node.control.shapes import ShapeCache
from node.models import ModelResolveError
from node.net.mesh import RequestError
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.control_wire import (
    Exists,
    ModelDescribed,
    NotFound,
    Placed,
    StageAddressAnswer,
    Unavailable,
    encode_control,
)
from protocol.election import Decision
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.membership import MemberState, Status, View
from protocol.placement import ModelShape
from tests.control_fakes import (
    GIB,
    MANIFEST,
    ME,
    OTHER,
    SHAPE,
    FakeCluster,
    FakeMesh,
    Files,
    Reader,
    requests_of,
    run,
)


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
