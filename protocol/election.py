"""Leader election: a pure rule over the live membership and the leader claims. No I/O, no clock.

The rule, which every node computes alike from the same view:
- The leader should be the live member with the smallest node id (`expected`).
- Leadership is held by a `LeaderClaim(node, term)` in the cluster state; the merge keeps the claim with
  the highest term (equal terms: a deterministic tie-break), so every replica ends with the same claim.
- The expected node, when the claim is not its own, claims term = highest term seen + 1.
- Everyone else follows the claim's holder while it is live, and has no leader while it is not.

Properties (tested in tests/test_election.py):
- Once views and claims agree (stable), exactly one node in a connected component is leader: the
  expected one, holding the highest term.
- After a partition heals, the claims merge to the highest one; if its holder is not the smallest live
  node, the smallest claims a higher term: one leader again.
- A new leader takes over the cluster state as it is: instance records stay until it rewrites them.
- Views that disagree for long (asymmetric links) can make two nodes outbid each other's terms; terms
  only grow, and it stops as soon as their views agree. The node writes each claim with a heartbeat
  (node/cluster/service.py), so a claim revives its writer for whoever reads it: at most one handover and
  takeback per `dead_after_s` of silence, never one per message round.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from protocol.cluster import ClusterState
from protocol.cluster_records import LeaderClaim
from protocol.ids import NodeId


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    startup_grace_s: float = 3.0
    """A starting node claims nothing for this long: enough to be discovered (mDNS ~1.2 s), connect
    and run an anti-entropy round, so that it does not lead a cluster of one before learning the rest."""


@dataclass(frozen=True, slots=True)
class Decision:
    leader: NodeId | None
    """Who leads now, as far as this node can tell; None while the election is open."""
    term: int
    """The leader's term (or the highest seen, while open)."""
    expected: NodeId
    """The smallest live node: who should lead once claims settle."""
    claim: bool
    """This node must write `LeaderClaim(self, term)` into the state and publish it now."""

    def is_leader(self, node: NodeId) -> bool:
        return self.leader == node


def best_claim(claims: Iterable[LeaderClaim]) -> LeaderClaim | None:
    """The claim that stands: highest term; at equal terms, the smallest node id."""
    best: LeaderClaim | None = None
    for claim in claims:
        if best is None or (claim.term, best.node) > (best.term, claim.node):
            best = claim
    return best


def may_claim(now: float, started_at: float, config: ElectionConfig) -> bool:
    """Whether a node started at local time `started_at` is past its startup grace at `now`."""
    return now - started_at >= config.startup_grace_s


def decide_leader(
    alive: Collection[NodeId],
    claims: Iterable[LeaderClaim],
    self_id: NodeId,
    *,
    may_claim: bool = True,
) -> Decision:
    """Applies the rule. `alive`: the live peers (this node counts itself live whether listed or not)."""
    live = set(alive) | {self_id}
    expected = min(live)
    claim = best_claim(claims)
    term = claim.term if claim is not None else 0
    # The claim is ours and we are the one expected: we lead, nothing to write.
    if claim is not None and claim.node == self_id == expected:
        return Decision(self_id, term, expected, claim=False)
    # We should lead and the claim is someone else's (or absent): outbid it.
    if expected == self_id and may_claim:
        return Decision(self_id, term + 1, expected, claim=True)
    # Follow the holder while it is live (even if it is not the expected one, until that one claims).
    if claim is not None and claim.node in live:
        return Decision(claim.node, term, expected, claim=False)
    # The holder is gone and the expected node has not claimed yet.
    return Decision(None, term, expected, claim=False)


def apply_decision(state: ClusterState, decision: Decision, self_id: NodeId) -> ClusterState:
    """Writes the claim the decision asks for (if any); the caller publishes the delta."""
    if not decision.claim:
        return state
    return state.with_leader_claim(self_id, decision.term)
