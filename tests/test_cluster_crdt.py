"""The cluster state CRDT: merge laws, deltas, anti-entropy convergence, owned writes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cluster import ClusterState, NotLeaderError
from protocol.cluster_records import InstanceRecord, NodeProfile, RecordKind, StageAssignment, Suspicion
from protocol.cluster_sim import SimConfig, simulate
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.record_limits import MAX_SUSPECTS, RecordError
from tests.cluster_strategies import NODES, states

A, B, C, D, E = NODES


def same(x: ClusterState, y: ClusterState) -> bool:
    """Equal entries, compared field by field (not only by digest)."""
    return dict(x.entries) == dict(y.entries) and x == y


def profile(hostname: str = "h", started_at: float = 1.0) -> NodeProfile:
    return NodeProfile(hostname, "linux", "cpu", 1 << 34, 1 << 33, "http://h:8000", "0.1.0", started_at)


def instance(instance_id: str, node: NodeId = A, model: str = "m/a") -> InstanceRecord:
    return InstanceRecord(InstanceId(instance_id), ModelId(model), (StageAssignment(node, 0, 24),))


# Merge laws.
@settings(deadline=None)
@given(states, states)
def test_merge_is_commutative(x: ClusterState, y: ClusterState) -> None:
    assert same(x.merge(y), y.merge(x))


@settings(deadline=None)
@given(states, states, states)
def test_merge_is_associative(x: ClusterState, y: ClusterState, z: ClusterState) -> None:
    assert same(x.merge(y).merge(z), x.merge(y.merge(z)))


@settings(deadline=None)
@given(states, states)
def test_merge_is_idempotent_and_empty_is_neutral(x: ClusterState, y: ClusterState) -> None:
    assert same(x.merge(x), x)
    assert same(x.merge(ClusterState.empty()), x)
    assert same(ClusterState.empty().merge(x), x)
    merged = x.merge(y)
    assert same(merged.merge(y), merged)
    assert merged.merge(x) is merged  # nothing new: no copy


@settings(deadline=None)
@given(states, states)
def test_missing_for_is_exactly_what_the_remote_lacks(x: ClusterState, y: ClusterState) -> None:
    delta = x.missing_for(y.digest())
    assert same(y.merge(delta), y.merge(x))
    assert len(x.missing_for(x.merge(y).digest())) == 0
    # Each entry of the delta beats the remote's (or the remote has none).
    for key, entry in delta:
        theirs = y.entries.get(key)
        assert theirs is None or entry.stamp > theirs.stamp


@settings(deadline=None)
@given(states, states)
def test_missing_for_with_a_limit_converges_in_steps(x: ClusterState, y: ClusterState) -> None:
    for _ in range(len(x) + 1):
        y = y.merge(x.missing_for(y.digest(), limit=1))
    assert len(x.missing_for(y.digest())) == 0


@settings(deadline=None)
@given(states, states)
def test_delta_since_carries_the_changes(x: ClusterState, y: ClusterState) -> None:
    after = x.merge(y)
    assert same(x.merge(after.delta_since(x)), after)


# Convergence under a hostile network.
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 5), st.floats(0, 0.6))
def test_replicas_converge_after_lossy_gossip_and_anti_entropy(seed: int, n: int, loss: float) -> None:
    rng = random.Random(seed)
    ids = NODES[:n]
    replicas = [ClusterState.empty() for _ in ids]
    in_flight: list[tuple[int, ClusterState]] = []
    for step in range(30):
        i = rng.randrange(n)
        before = replicas[i]
        op = rng.randrange(4)
        if op == 0:
            replicas[i] = before.with_heartbeat(ids[i], [Suspicion(rng.choice(ids), rng.randrange(2))])
        elif op == 1:
            replicas[i] = before.with_profile(ids[i], profile(started_at=float(step)))
        elif op == 2:
            replicas[i] = before.with_leader_claim(ids[i], rng.randrange(1, 4))
        else:
            claim = before.leader_claim()
            if claim is not None and claim.node == ids[i]:
                if rng.random() < 0.3:
                    replicas[i] = before.without_instance(ids[i], claim.term, InstanceId("inst-0"))
                else:
                    replicas[i] = before.with_instance(ids[i], claim.term, instance("inst-0", ids[i]))
        delta = replicas[i].delta_since(before)
        for j in range(n):  # gossip: dropped, duplicated, delivered later in any order
            if j != i and rng.random() >= loss:
                in_flight += [(j, delta)] * rng.choice([1, 1, 2])
        rng.shuffle(in_flight)
        for _ in range(rng.randrange(len(in_flight) + 1)):
            j, message = in_flight.pop()
            replicas[j] = replicas[j].merge(message)
    everything = ClusterState.empty()
    for replica in replicas:
        everything = everything.merge(replica)
    # Anti-entropy on a ring, both directions, each exchange lossless: n rounds always suffice.
    for _ in range(n):
        for i in range(n):
            j = (i + 1) % n
            reply = replicas[j].missing_for(replicas[i].digest())
            replicas[i] = replicas[i].merge(reply)
            replicas[j] = replicas[j].merge(replicas[i].missing_for(replicas[j].digest()))
    for replica in replicas:
        assert same(replica, everything)


def test_fifty_nodes_with_twenty_percent_loss_converge_within_bounded_rounds() -> None:
    for seed in range(3):
        result = simulate(SimConfig(nodes=50, loss=0.2), random.Random(seed))
        assert result.converged
        assert result.rounds_after_writes <= 10, result
        assert result.lost > 0


def test_simulation_through_the_wire_counts_bytes() -> None:
    result = simulate(SimConfig(nodes=8, loss=0.1, through_wire=True), random.Random(1))
    assert result.converged and result.wire_bytes > 0


# Node-owned writes.
def test_heartbeats_and_profile_writes_share_one_growing_counter() -> None:
    s = ClusterState.empty().with_heartbeat(A)
    assert s.node_version(A) == (0, 1)
    s = s.with_profile(A, profile())
    assert s.node_version(A) == (0, 2)
    assert s.with_profile(A, profile()) is s  # unchanged profile: no write
    s = s.with_heartbeat(A)
    assert s.heartbeats()[A].counter == 3
    assert s.profiles() == {A: profile()}
    assert s.members() == (A,)


def test_a_restarted_node_overrides_its_previous_life_once_it_has_merged_it() -> None:
    old = ClusterState.empty().with_profile(A, profile(started_at=1.0))
    for _ in range(50):
        old = old.with_heartbeat(A)
    old = old.with_leave(A)
    fresh = ClusterState.empty().with_profile(A, profile(started_at=99.0)).with_heartbeat(A)
    merged = fresh.merge(old)
    assert merged.heartbeats()[A].left  # the first writes of the new life lose to the old ones
    merged = merged.with_profile(A, profile(started_at=99.0)).with_heartbeat(A)
    assert not merged.heartbeats()[A].left
    assert merged.profiles()[A].started_at == 99.0
    assert old.merge(merged) == merged


def test_a_suspected_node_refutes_by_bumping_its_incarnation() -> None:
    s = ClusterState.empty().with_heartbeat(A).with_heartbeat(B, [Suspicion(A, 0)])
    assert s.is_suspected(A) and not s.is_suspected(B)
    s = s.with_heartbeat(A)
    assert s.heartbeats()[A].incarnation == 1
    assert not s.is_suspected(A)  # B's record names incarnation 0: outdated
    assert s.with_heartbeat(A).heartbeats()[A].incarnation == 1


def test_suspicions_from_a_node_that_left_do_not_count() -> None:
    s = ClusterState.empty().with_heartbeat(A).with_heartbeat(B, [Suspicion(A, 0)]).with_leave(B)
    assert not s.is_suspected(A)


def test_suspects_are_capped_not_refused() -> None:
    many = [Suspicion(NodeId(f"12D3KooW{i:03d}"), 0) for i in range(MAX_SUSPECTS + 10)]
    assert len(ClusterState.empty().with_heartbeat(A, many).heartbeats()[A].suspects) == MAX_SUSPECTS


# Leader-owned writes.
def test_only_the_claim_holder_writes_instances() -> None:
    s = ClusterState.empty().with_leader_claim(A, 1)
    with pytest.raises(NotLeaderError):
        s.with_instance(B, 1, instance("i1"))
    with pytest.raises(NotLeaderError):
        s.with_instance(A, 2, instance("i1"))
    assert s.with_instance(A, 1, instance("i1")).instances() == {"i1": instance("i1")}


def test_a_higher_term_supersedes_per_key_and_a_leader_change_keeps_instances() -> None:
    s = ClusterState.empty().with_leader_claim(A, 1)
    s = s.with_instance(A, 1, instance("i1")).with_instance(A, 1, instance("i2"))
    s = s.with_instance(A, 1, instance("i1", model="m/old"))  # counter 3 at term 1
    s = s.with_leader_claim(B, 2)
    assert set(s.instances()) == {"i1", "i2"}  # kept across the term change
    new = s.with_instance(B, 2, instance("i1", model="m/new"))  # counter 1 at term 2 still wins
    stale = s.merge(ClusterState.empty().with_leader_claim(A, 1).with_instance(A, 1, instance("i9")))
    merged = new.merge(stale)
    assert merged.instances()[InstanceId("i1")].model == "m/new"
    assert set(merged.instances()) == {"i1", "i2", "i9"}  # the new leader must reconcile i9 itself
    assert merged.leader_claim() is not None and merged.leader_claim().node == B  # type: ignore[union-attr]


def test_a_delete_is_a_tombstone_that_merges_like_a_write() -> None:
    base = ClusterState.empty().with_leader_claim(A, 1).with_instance(A, 1, instance("i1"))
    deleted = base.without_instance(A, 1, InstanceId("i1"))
    assert deleted.instances() == {}
    assert (RecordKind.INSTANCE, "i1") in deleted.entries
    assert base.merge(deleted).instances() == {}
    assert deleted.merge(base).instances() == {}
    recreated = deleted.with_instance(A, 1, instance("i1"))
    assert base.merge(recreated).merge(deleted).instances() == {"i1": instance("i1")}


def test_a_lower_claim_loses_the_merge() -> None:
    s = ClusterState.empty().with_leader_claim(B, 3)
    assert s.with_leader_claim(A, 2).leader_claim() == s.leader_claim()


def test_records_enforce_their_limits() -> None:
    with pytest.raises(RecordError):
        profile(hostname="x" * 1000)
    with pytest.raises(RecordError):
        InstanceRecord(InstanceId("i"), ModelId("m"), (StageAssignment(A, 0, 4), StageAssignment(B, 5, 8)))
    with pytest.raises(RecordError):
        StageAssignment(A, 4, 4)
