"""The leader's placement service, in one process: a fake cluster, MockClock."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from node.control.shapes import ShapeCache
from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, StageAssignment
from protocol.control_wire import (
    Deleted,
    DeleteInstance,
    Exists,
    Invalid,
    NotFound,
    Placed,
    Unavailable,
)
from protocol.ids import InstanceId, ModelId
from tests.control_fakes import GIB, MANIFEST, ME, OTHER, SHAPE, Reader, ask, leader_of, run


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
