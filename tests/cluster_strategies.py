"""Hypothesis strategies for cluster states: small pools of ids and values, so keys collide and
versions tie (the cases merge must get right)."""

from __future__ import annotations

from hypothesis import strategies as st

from protocol.cluster import ClusterState
from protocol.cluster_records import (
    LEADER_KEY_ID,
    Entry,
    EntryLoad,
    Holding,
    InstanceRecord,
    LeaderClaim,
    Liveness,
    NodeHoldings,
    NodeLoad,
    NodeProfile,
    NodeTransfers,
    RecordKey,
    RecordKind,
    RecordValue,
    RoundTrip,
    StageAssignment,
    Suspicion,
)
from protocol.health import RUNNER_STATES
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import FileEntry, TransferProgress, manifest_of
from protocol.model_shape import ModelShape

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
    links=st.dictionaries(node_ids, st.sampled_from([21, 1200]), max_size=2).map(
        lambda trips: tuple(RoundTrip(node, us) for node, us in sorted(trips.items()))
    ),
)
livenesses = st.builds(
    Liveness,
    left=st.booleans(),
    suspects=st.lists(st.builds(Suspicion, node_ids, small), max_size=2, unique=True).map(
        lambda s: tuple(sorted(s))
    ),
)


MANIFESTS = [
    manifest_of([FileEntry(path="config.json", size=2, sha256="a" * 64)]),
    manifest_of(
        [FileEntry(path=f"model-{i}.safetensors", size=10 + i, sha256=f"{i}" * 64) for i in range(3)],
        derived_from=FileEntry(path="m.gguf", size=99, sha256="b" * 64),
    ),
]
SHAPE = ModelShape.uniform(ModelId("m/a"), num_layers=24, bytes_per_layer=7, embedding_bytes=3, head_bytes=2)
holdings = st.builds(
    NodeHoldings,
    st.lists(
        st.builds(
            Holding,
            st.sampled_from([m.id for m in MANIFESTS]),
            st.none() | st.lists(st.integers(0, 3), max_size=3, unique=True).map(lambda i: tuple(sorted(i))),
        ),
        max_size=2,
        unique_by=lambda h: h.manifest_id,
    ).map(lambda hs: tuple(sorted(hs, key=lambda h: h.manifest_id))),
)
transfers = st.builds(
    NodeTransfers,
    st.lists(
        st.builds(
            TransferProgress,
            manifest_id=st.sampled_from([m.id for m in MANIFESTS]),
            model=st.just("m/a"),
            source=st.sampled_from(["peers", "hub"]),
            state=st.sampled_from(["fetching", "done", "failed"]),
            bytes_done=small,
            bytes_total=small,
            rate_bps=st.sampled_from([0.0, 1.5e6]),
            files_done=small,
            files_total=small,
            peers=small,
            error=st.none() | st.just("no peer holds it"),
        ),
        max_size=2,
    ).map(tuple),
)
loads = st.builds(
    NodeLoad,
    st.lists(
        st.builds(
            EntryLoad,
            st.sampled_from(INSTANCES),
            st.sampled_from((None, *RUNNER_STATES)),
            small,
            small,
            small,
            st.sampled_from(("", "out of memory")),
        ),
        max_size=2,
        unique_by=lambda e: e.instance_id,
    ).map(lambda es: tuple(sorted(es, key=lambda e: e.instance_id))),
)


@st.composite
def instance_records(draw: st.DrawFn, instance_id: InstanceId) -> InstanceRecord:
    split = draw(st.integers(1, 23))
    stages = (StageAssignment(draw(node_ids), 0, split), StageAssignment(draw(node_ids), split, 24))
    model = ModelId(draw(st.sampled_from(["m/a", "m/b"])))
    if not draw(st.booleans()):
        return InstanceRecord(instance_id, model, stages)
    manifest, hub = draw(st.sampled_from(MANIFESTS)), draw(st.sampled_from(["", "org/m"]))
    return InstanceRecord(instance_id, model, stages, "/data/m", manifest, SHAPE, hub)


@st.composite
def entries(draw: st.DrawFn) -> tuple[RecordKey, Entry]:
    """One valid (key, entry) pair of any kind, tombstones included."""
    kind = draw(st.sampled_from(list(RecordKind)))
    owned: dict[RecordKind, st.SearchStrategy[RecordValue]] = {
        RecordKind.PROFILE: profiles,
        RecordKind.LIVENESS: livenesses,
        RecordKind.HOLDINGS: holdings,
        RecordKind.TRANSFERS: transfers,
        RecordKind.LOAD: loads,
    }
    value: RecordValue | None
    if kind in owned:
        node = draw(node_ids)
        value = draw(owned[kind])
        return (kind, node), Entry(node, (draw(small), draw(small)), value)
    if kind is RecordKind.LEADER:
        node, term = draw(node_ids), draw(small)
        return (kind, LEADER_KEY_ID), Entry(node, (term, 0), LeaderClaim(node, term))
    instance_id = draw(st.sampled_from(INSTANCES))
    value = draw(st.none() | instance_records(instance_id))
    return (kind, instance_id), Entry(draw(node_ids), (draw(small), draw(small)), value)


states = st.lists(entries(), max_size=12).map(ClusterState.of)
