"""Hypothesis strategies for cluster states: small pools of ids and values, so keys collide and
versions tie (the cases merge must get right)."""

from __future__ import annotations

from hypothesis import strategies as st

from protocol.cluster import ClusterState
from protocol.cluster_records import (
    LEADER_KEY_ID,
    Entry,
    InstanceRecord,
    LeaderClaim,
    Liveness,
    NodeProfile,
    RecordKey,
    RecordKind,
    StageAssignment,
    Suspicion,
)
from protocol.ids import InstanceId, ModelId, NodeId

NODES = [NodeId(f"12D3KooWNode{c}") for c in "ABCDE"]
INSTANCES = [InstanceId(f"inst-{i}") for i in range(3)]

node_ids = st.sampled_from(NODES)
small = st.integers(0, 3)

profiles = st.builds(
    NodeProfile,
    hostname=st.sampled_from(["a", "b"]),
    os=st.just("linux"),
    accelerator=st.sampled_from(["cpu", "cuda"]),
    memory_total=st.just(1 << 34),
    memory_available=st.sampled_from([1 << 30, 1 << 31]),
    api_url=st.just("http://10.0.0.1:8000"),
    version=st.just("0.1.0"),
    started_at=st.sampled_from([1.5, 2.25]),
    multiaddrs=st.lists(st.just("/ip4/10.0.0.1/tcp/4001"), max_size=2).map(tuple),
)
livenesses = st.builds(
    Liveness,
    left=st.booleans(),
    suspects=st.lists(st.builds(Suspicion, node_ids, small), max_size=2, unique=True).map(
        lambda s: tuple(sorted(s))
    ),
)


@st.composite
def instance_records(draw: st.DrawFn, instance_id: InstanceId) -> InstanceRecord:
    split = draw(st.integers(1, 23))
    stages = (StageAssignment(draw(node_ids), 0, split), StageAssignment(draw(node_ids), split, 24))
    return InstanceRecord(instance_id, ModelId(draw(st.sampled_from(["m/a", "m/b"]))), stages)


@st.composite
def entries(draw: st.DrawFn) -> tuple[RecordKey, Entry]:
    """One valid (key, entry) pair of any kind, tombstones included."""
    kind = draw(st.sampled_from(list(RecordKind)))
    if kind is RecordKind.PROFILE or kind is RecordKind.LIVENESS:
        node = draw(node_ids)
        value: NodeProfile | Liveness | InstanceRecord | None
        value = draw(profiles) if kind is RecordKind.PROFILE else draw(livenesses)
        return (kind, node), Entry(node, (draw(small), draw(small)), value)
    if kind is RecordKind.LEADER:
        node, term = draw(node_ids), draw(small)
        return (kind, LEADER_KEY_ID), Entry(node, (term, 0), LeaderClaim(node, term))
    instance_id = draw(st.sampled_from(INSTANCES))
    value = draw(st.none() | instance_records(instance_id))
    return (kind, instance_id), Entry(draw(node_ids), (draw(small), draw(small)), value)


states = st.lists(entries(), max_size=12).map(ClusterState.of)
