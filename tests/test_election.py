"""Leader election: the rule as a table, then whole scenarios through the cluster state."""

from __future__ import annotations

import pytest

from protocol.cluster import ClusterState
from protocol.cluster_records import InstanceRecord, LeaderClaim, StageAssignment
from protocol.election import (
    Decision,
    ElectionConfig,
    apply_decision,
    best_claim,
    decide_leader,
    may_claim,
)
from protocol.ids import InstanceId, ModelId, NodeId

A, B, C, D, E = (NodeId(f"12D3KooW{c}") for c in "abcde")


def claim(node: NodeId, term: int) -> LeaderClaim:
    return LeaderClaim(node, term)


@pytest.mark.parametrize(
    ("name", "alive", "claims", "me", "expected"),
    [
        ("single node, no claim: claims term 1", [], [], A, Decision(A, 1, A, claim=True)),
        ("single node holding its claim", [], [claim(A, 1)], A, Decision(A, 1, A, claim=False)),
        ("3 nodes, smallest claims", [B, C], [], A, Decision(A, 1, A, claim=True)),
        ("3 nodes, others wait for the smallest", [A, C], [], B, Decision(None, 0, A, claim=False)),
        ("3 nodes, stable", [A, C], [claim(A, 1)], B, Decision(A, 1, A, claim=False)),
        ("leader dead: next smallest outbids", [C], [claim(A, 1)], B, Decision(B, 2, B, claim=True)),
        ("leader dead: others wait", [B], [claim(A, 1)], C, Decision(None, 1, B, claim=False)),
        ("leader dead: new claim followed", [B], [claim(B, 2)], C, Decision(B, 2, B, claim=False)),
        ("smaller node joins: it outbids", [B, C], [claim(B, 4)], A, Decision(A, 5, A, claim=True)),
        (
            "smaller node joins: holder leads meanwhile",
            [A, C],
            [claim(B, 4)],
            B,
            Decision(B, 4, A, claim=False),
        ),
        (
            "stale claims: the highest term stands",
            [A, C],
            [claim(A, 1), claim(C, 3), claim(A, 2)],
            B,
            Decision(C, 3, A, claim=False),
        ),
        (
            "stale claims: the expected outbids the highest",
            [B, C],
            [claim(A, 1), claim(C, 3)],
            A,
            Decision(A, 4, A, claim=True),
        ),
        (
            "equal terms: the smallest id stands",
            [A, B, D],
            [claim(C, 2), claim(B, 2)],
            D,
            Decision(B, 2, A, claim=False),
        ),
        ("a claim by a dead node is not followed", [B], [claim(D, 7)], C, Decision(None, 7, B, claim=False)),
    ],
)
def test_decide_leader(
    name: str, alive: list[NodeId], claims: list[LeaderClaim], me: NodeId, expected: Decision
) -> None:
    assert decide_leader(alive, claims, me) == expected, name


def test_no_claim_during_startup_grace() -> None:
    config = ElectionConfig(startup_grace_s=3.0)
    assert not may_claim(now=12.0, started_at=10.0, config=config)
    assert may_claim(now=13.0, started_at=10.0, config=config)
    assert decide_leader([B], [], A, may_claim=False) == Decision(None, 0, A, claim=False)
    assert decide_leader([B], [claim(B, 3)], A, may_claim=False) == Decision(B, 3, A, claim=False)


def test_best_claim_is_order_independent() -> None:
    claims = [claim(C, 2), claim(B, 2), claim(A, 1)]
    assert best_claim(claims) == best_claim(reversed(claims)) == claim(B, 2)
    assert best_claim([]) is None


# Scenarios: each node keeps a ClusterState; `alive` views are given, the claims travel by merge.
class Cluster:
    def __init__(self, nodes: list[NodeId]) -> None:
        self.states = {n: ClusterState.empty() for n in nodes}

    def step(self, components: list[list[NodeId]]) -> dict[NodeId, Decision]:
        """Each node decides on the view of its component; then each component gossips fully."""
        decisions = {}
        for component in components:
            for node in component:
                others = [n for n in component if n != node]
                state = self.states[node]
                decision = decide_leader(others, [c for c in [state.leader_claim()] if c], node)
                self.states[node] = apply_decision(state, decision, node)
                decisions[node] = decision
            merged = ClusterState.empty()
            for node in component:
                merged = merged.merge(self.states[node])
            for node in component:
                self.states[node] = self.states[node].merge(merged)
        return decisions

    def settle(self, components: list[list[NodeId]], rounds: int = 4) -> dict[NodeId, Decision]:
        for _ in range(rounds):
            decisions = self.step(components)
        return decisions


def leaders(decisions: dict[NodeId, Decision], component: list[NodeId]) -> set[NodeId | None]:
    return {decisions[n].leader for n in component}


def test_three_nodes_elect_the_smallest_then_the_next_when_it_dies() -> None:
    cluster = Cluster([A, B, C])
    decisions = cluster.settle([[A, B, C]])
    assert leaders(decisions, [A, B, C]) == {A}
    term = decisions[A].term
    decisions = cluster.settle([[B, C]])
    assert leaders(decisions, [B, C]) == {B}
    assert decisions[C].term > term


def test_partition_gives_one_leader_per_component_and_healing_gives_one() -> None:
    everyone = [A, B, C, D, E]
    cluster = Cluster(everyone)
    cluster.settle([everyone])
    left, right = [A, B, C], [D, E]
    decisions = cluster.settle([left, right])
    assert leaders(decisions, left) == {A}
    assert leaders(decisions, right) == {D}
    assert decisions[D].term > decisions[A].term
    decisions = cluster.settle([everyone])
    assert leaders(decisions, everyone) == {A}
    assert len({decisions[n].term for n in everyone}) == 1
    assert len({cluster.states[n] for n in everyone}) == 1


def test_a_leader_change_keeps_the_cluster_state() -> None:
    cluster = Cluster([A, B, C])
    decisions = cluster.settle([[A, B, C]])
    record = InstanceRecord(InstanceId("i1"), ModelId("m"), (StageAssignment(B, 0, 8),))
    cluster.states[A] = cluster.states[A].with_instance(A, decisions[A].term, record)
    cluster.settle([[A, B, C]])
    decisions = cluster.settle([[B, C]])
    assert decisions[B].is_leader(B)
    assert cluster.states[B].instances() == {"i1": record}
    assert cluster.states[C].instances() == {"i1": record}
