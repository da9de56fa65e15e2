"""Replicas, in one process: the pure choice of an entry, placement on disjoint nodes, the load
record on the wire, and the leader placing and re-placing replicas (a fake cluster, MockClock)."""

from __future__ import annotations

import cbor2
import pytest
import trio

from protocol.cluster import ClusterState
from protocol.cluster_codec import Delta, WireDecodeError, decode_message, encode_message
from protocol.cluster_records import EntryLoad, InstanceRecord, NodeLoad, StageAssignment
from protocol.control_wire import ControlWireError, Exists, Invalid, Placed, decode_control, encode_control
from protocol.health import RunnerState
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.placement import MAX_REPLICAS, PlacementError, place_replicas
from protocol.record_limits import RecordError
from protocol.replicas import Replica, load_view, order_replicas, replicas_of
from tests.control_fakes import GIB, ME, SHAPE, ask, leader_of, run

A, B, C = NodeId("a-node"), NodeId("b-node"), NodeId("c-node")


def replica(
    iid: str, entry: NodeId, *, ready: bool = True, load: int = 0, alive: bool = True, sent: int = 0
) -> Replica:
    return Replica(InstanceId(iid), entry, ready, load, alive, sent)


@pytest.mark.parametrize(
    ("replicas", "me", "expected"),
    [
        ([replica("i1", A, load=3), replica("i2", B, load=1)], C, [B, A]),  # least loaded first
        ([replica("i1", A, load=1), replica("i2", B, load=1)], B, [B, A]),  # a tie: this node's own
        ([replica("i1", A, load=1), replica("i2", B, load=1)], C, [A, B]),  # a tie elsewhere: by id
        ([replica("i1", A, load=1, sent=5), replica("i2", B, load=1)], C, [B, A]),  # then: take turns
        ([replica("i1", A, load=0, ready=False), replica("i2", B, load=9)], A, [B, A]),  # ready first
        ([replica("i1", A, alive=False), replica("i2", B, ready=False)], C, [B, A]),  # dead last
        ([replica("i2", B, ready=False), replica("i1", A, ready=False)], B, [B, A]),  # loading: own first
        ([], A, []),
    ],
)
def test_order_replicas(replicas: list[Replica], me: NodeId, expected: list[NodeId]) -> None:
    assert [r.entry for r in order_replicas(replicas, me)] == expected
    assert order_replicas(reversed(replicas), me) == order_replicas(replicas, me)  # input order is moot


def record(iid: str, *nodes: NodeId, model: str = "m") -> InstanceRecord:
    stages = tuple(StageAssignment(node, i, i + 1) for i, node in enumerate(nodes))
    return InstanceRecord(InstanceId(iid), ModelId(model), stages)


def load(*entries: tuple[str, bool, int]) -> NodeLoad:
    def runner(ready: bool) -> RunnerState:
        return "ready" if ready else "starting"

    return NodeLoad(
        tuple(EntryLoad(InstanceId(i), runner(ok), active, 0, active) for i, ok, active in entries)
    )


def test_replicas_of_takes_the_larger_of_the_report_and_what_this_node_sent() -> None:
    records = [record("i1", A), record("i2", B, C), record("i3", C, model="other"), record("i4", C)]
    loads = {A: load(("i1", True, 2)), B: load(("i2", True, 0))}
    found = replicas_of("m", records, loads, alive={B}, me=A, dispatched={B: 3, A: 1}, sent={B: 7})
    assert found == [
        replica("i1", A, load=2),  # this node: alive whatever the view says
        replica("i2", B, load=3, sent=7),  # its report lags behind the three requests sent to it
        replica("i4", C, ready=False, alive=False),  # never reported, not alive
    ]
    assert load_view(records[0], loads) is not None and load_view(records[3], loads) is None


def test_place_replicas_uses_disjoint_nodes_as_many_as_fit() -> None:
    nodes = [(A, 8 * GIB), (B, 4 * GIB), (C, 2 * GIB), (NodeId("d-small"), GIB // 2)]
    plans = place_replicas(SHAPE, nodes, 5)
    assert [[s.node for s in p.stages] for p in plans] == [[A], [B], [C]]  # the small one fits no replica
    assert [[s.node for s in p.stages] for p in place_replicas(SHAPE, nodes, 2, exclude={A})] == [[B], [C]]
    two_each = place_replicas(SHAPE, nodes, 2, nodes_wanted=2)
    assert [{s.node for s in p.stages} for p in two_each] == [{A, B}, {C, NodeId("d-small")}]
    with pytest.raises(PlacementError, match="already runs a replica"):
        place_replicas(SHAPE, nodes, 1, exclude={n for n, _ in nodes})
    with pytest.raises(PlacementError):
        place_replicas(SHAPE, [(C, GIB // 2)], 1)
    for count in (0, MAX_REPLICAS + 1):
        with pytest.raises(ValueError):
            place_replicas(SHAPE, nodes, count)


def test_the_load_record_round_trips_and_hostile_ones_are_refused() -> None:
    failed = EntryLoad(InstanceId("i3"), "failed", 0, 0, 1, error="out of memory")
    none_yet = EntryLoad(InstanceId("i4"), None, 0, 0, 0)
    loads = NodeLoad((*load(("i1", True, 2), ("i2", False, 0)).entries, failed, none_yet))
    state = ClusterState.empty().with_load(A, loads)
    decoded = decode_message(encode_message(Delta(state)))
    assert isinstance(decoded, Delta) and decoded.state.loads() == state.loads()
    with pytest.raises(RecordError):
        load(("i2", True, 0), ("i1", True, 0))  # unsorted
    with pytest.raises(RecordError):
        EntryLoad(InstanceId("i1"), "ready", -1, 0, 0)
    with pytest.raises(RecordError):
        EntryLoad(InstanceId("i1"), "sleeping", 0, 0, 0)  # type: ignore[arg-type]
    wire = encode_message(Delta(state)).replace(b"ready", b"reaxy")  # no runner state
    with pytest.raises(WireDecodeError):
        decode_message(wire)


def test_a_place_request_with_bad_replicas_is_malformed() -> None:
    for bad in (0, -1, MAX_REPLICAS + 1):
        with pytest.raises(ValueError):
            ask(replicas=bad)
    good = encode_control(ask(replicas=2))
    assert decode_control(good) == ask(replicas=2)
    for wrong in (0, 2.5, "2", True):
        sent = {**cbor2.loads(good), "replicas": wrong}
        with pytest.raises(ControlWireError):
            decode_control(cbor2.dumps(sent))


def nodes_of(outcome: Placed | Exists) -> list[set[str]]:
    return [{s.node_id for s in view.stages} for view in outcome.replicas]


def test_the_leader_places_missing_replicas_on_disjoint_nodes() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, A: 8 * GIB, B: 8 * GIB})
        preview = await leader.place(ask(replicas=2, preview=True))
        assert isinstance(preview, Placed) and len(preview.replicas) == 2 and cluster.state.instances() == {}
        two = await leader.place(ask(replicas=2))
        assert isinstance(two, Placed) and two.requested == 2 and len(cluster.state.instances()) == 2
        assert len(set.union(*nodes_of(two))) == 2  # disjoint
        again = await leader.place(ask(replicas=2))
        assert isinstance(again, Exists) and {v.id for v in again.replicas} == {v.id for v in two.replicas}
        more = await leader.place(ask(replicas=5))  # three nodes: one more fits, not three
        assert isinstance(more, Placed) and more.requested == 5 and len(more.replicas) == 3
        assert set.union(*nodes_of(more)) == {ME, A, B}
        full = await leader.place(ask(replicas=4))
        assert isinstance(full, Exists) and len(full.replicas) == 3
        plain = await leader.place(ask())  # without replicas: one instance per model, as before
        assert isinstance(plain, Exists) and plain.requested is None and plain.replicas == ()

    run(main)


def test_replicas_that_do_not_fit_at_all_are_invalid() -> None:
    async def main() -> None:
        _, leader = leader_of({ME: GIB // 2})
        outcome = await leader.place(ask(replicas=2))
        assert isinstance(outcome, Invalid) and outcome.kind == "does_not_fit"

    run(main)


def test_a_lost_replica_is_re_placed_away_from_the_other_one() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, A: 8 * GIB, B: 4 * GIB})
        placed = await leader.place(ask(replicas=2))
        assert isinstance(placed, Placed) and nodes_of(placed) == [{ME}, {A}]  # the largest two
        lost = next(InstanceId(v.id) for v in placed.replicas if v.stages[0].node_id == A)
        busy = cluster.memory.pop(B)  # the spare node has no room for now
        cluster.dies(A)
        async with trio.open_nursery() as nursery:
            leader.repair_nowait(nursery)
        assert cluster.state.instances()[lost].stages[0].node == A  # not beside the other replica
        cluster.memory[B] = busy
        await trio.sleep(120)  # past the repair's backoff (mock clock)
        async with trio.open_nursery() as nursery:
            leader.repair_nowait(nursery)
        records = cluster.state.instances()
        assert records[lost].stages[0].node == B
        assert [s.node for r in records.values() if r.instance_id != lost for s in r.stages] == [ME]

    run(main)
