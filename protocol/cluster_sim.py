"""An in-memory simulation of N nodes gossiping the cluster state over a lossy network. Pure: the
randomness is the `random.Random` passed in, time is counted in rounds.

Each round:
1. writes: while `round < write_rounds`, every node writes a heartbeat (and its profile in round 0);
   the smallest node claims term 1 in round 0 and places an instance in round 1;
2. gossip: every node publishes its new writes; each copy reaches each other node (or `gossip_fanout`
   random ones) unless lost, in random order, sometimes twice;
3. anti-entropy: every node runs a push-pull exchange with `anti_entropy_peers` random peers; each of
   its three messages may be lost too.
The run stops when every replica holds the same state, or after `max_rounds`.
It backs tests (convergence under loss) and a benchmark (rounds and bytes for 50 and 100 nodes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from protocol.cluster import ClusterState
from protocol.cluster_codec import (
    Delta,
    DigestReply,
    DigestRequest,
    GossipMessage,
    decode_message,
    encode_message,
)
from protocol.cluster_records import InstanceRecord, NodeProfile, StageAssignment
from protocol.ids import InstanceId, ModelId, NodeId


@dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 50
    loss: float = 0.2
    """Probability that any one message (one copy, one hop) is lost."""
    duplicate: float = 0.05
    """Probability that a delivered gossip message arrives twice."""
    write_rounds: int = 3
    gossip_fanout: int | None = None
    """None: a publish goes to every node (GossipSub floods its topic); else to this many random ones."""
    anti_entropy_peers: int = 1
    max_rounds: int = 100
    through_wire: bool = False
    """Encode and decode every message with the codec (counts bytes; slower)."""


@dataclass(frozen=True, slots=True)
class SimResult:
    converged: bool
    rounds: int
    """Rounds run, write rounds included (the last one is the round all replicas became equal)."""
    rounds_after_writes: int
    """Rounds from the end of the last write round to convergence."""
    messages: int
    lost: int
    wire_bytes: int
    """Bytes of all messages sent (0 unless `through_wire`)."""


def sim_node_id(index: int) -> NodeId:
    return NodeId(f"12D3KooWSim{index:05d}")


def _profile(index: int) -> NodeProfile:
    return NodeProfile(
        hostname=f"host-{index}",
        os="linux",
        accelerator="cpu",
        memory_total=16 << 30,
        memory_available=8 << 30,
        api_url=f"http://10.0.{index // 250}.{index % 250}:8000",
        version="0.1.0",
        started_at=1_700_000_000.0 + index,
        multiaddrs=(f"/ip4/10.0.{index // 250}.{index % 250}/tcp/4001",),
    )


class _Network:
    def __init__(self, config: SimConfig, rng: random.Random) -> None:
        self.config, self.rng = config, rng
        self.messages = self.lost = self.wire_bytes = 0

    def send(self, message: GossipMessage) -> GossipMessage | None:
        """The message as received, or None if lost."""
        self.messages += 1
        if self.config.through_wire:
            data = encode_message(message)
            self.wire_bytes += len(data)
            message = decode_message(data)
        if self.rng.random() < self.config.loss:
            self.lost += 1
            return None
        return message


def _write(states: list[ClusterState], ids: list[NodeId], round_: int) -> list[ClusterState]:
    """Each node's writes for this round; returns each node's delta (its own writes) to publish."""
    deltas = []
    for i, node in enumerate(ids):
        state = before = states[i]
        if round_ == 0:
            state = state.with_profile(node, _profile(i))
        state = state.with_heartbeat(node)
        if i == 0 and round_ == 0:
            state = state.with_leader_claim(node, 1)
        if i == 0 and round_ == 1:
            stages = (StageAssignment(ids[0], 0, 12), StageAssignment(ids[-1], 12, 24))
            record = InstanceRecord(InstanceId("inst-1"), ModelId("sim/model"), stages)
            state = state.with_instance(node, 1, record)
        states[i] = state
        deltas.append(state.delta_since(before))
    return deltas


def _gossip(states: list[ClusterState], deltas: list[ClusterState], net: _Network) -> None:
    n, rng, config = len(states), net.rng, net.config
    inbox: list[tuple[int, ClusterState]] = []
    for i, delta in enumerate(deltas):
        if not len(delta):
            continue
        others = [j for j in range(n) if j != i]
        if config.gossip_fanout is not None:
            others = rng.sample(others, min(config.gossip_fanout, len(others)))
        for j in others:
            received = net.send(Delta(delta))
            if isinstance(received, Delta):
                copies = 2 if rng.random() < config.duplicate else 1
                inbox += [(j, received.state)] * copies
    rng.shuffle(inbox)
    for j, delta in inbox:
        states[j] = states[j].merge(delta)


def _anti_entropy(states: list[ClusterState], net: _Network) -> None:
    n, rng = len(states), net.rng
    for a in rng.sample(range(n), n):
        for b in rng.sample([j for j in range(n) if j != a], min(net.config.anti_entropy_peers, n - 1)):
            request = net.send(DigestRequest(states[a].digest()))
            if not isinstance(request, DigestRequest):
                continue
            reply = net.send(DigestReply(states[b].missing_for(request.digest), states[b].digest()))
            if not isinstance(reply, DigestReply):
                continue
            states[a] = states[a].merge(reply.delta)
            back = net.send(Delta(states[a].missing_for(reply.digest)))
            if isinstance(back, Delta):
                states[b] = states[b].merge(back.state)


def simulate(config: SimConfig, rng: random.Random) -> SimResult:
    """Runs the simulation described in the module docstring."""
    ids = [sim_node_id(i) for i in range(config.nodes)]
    states = [ClusterState.empty() for _ in ids]
    net = _Network(config, rng)
    for round_ in range(config.max_rounds):
        if round_ < config.write_rounds:
            _gossip(states, _write(states, ids, round_), net)
        if config.nodes > 1:
            _anti_entropy(states, net)
        if round_ + 1 >= config.write_rounds and all(s == states[0] for s in states):
            return SimResult(
                True, round_ + 1, round_ + 1 - config.write_rounds, net.messages, net.lost, net.wire_bytes
            )
    return SimResult(
        False,
        config.max_rounds,
        config.max_rounds - config.write_rounds,
        net.messages,
        net.lost,
        net.wire_bytes,
    )
