"""The cluster driver's timing, in one process on trio's mock clock: three `ClusterService`s over an
in-memory mesh, with the default failure detector and election settings.

What the real-process tests (tests/test_cluster_nodes.py) can only watch happen, this checks against
the configured periods: the leader claims only after its start-up grace; a killed node (its
connections close) is dead within `lost_dead_after_s` and a tick, and the next node leads by then;
a frozen one (connections open, silent) is judged by silence, `dead_after_s` after its last
heartbeat, and is alive again with its first heartbeat after it wakes; views that disagree cost
terms at the detector's pace, not one per message. Real-process figures for the same: bench/mesh.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
import trio
import trio.testing

from node.cluster.service import ClusterConfig, ClusterService
from node.net import Gossip, Mesh, MeshConfig, RequestError
from node.net.events import PeerEvent
from protocol.cluster_records import NodeProfile
from protocol.ids import NodeId
from protocol.membership import Status
from tests.waiting import wait_until_async

if TYPE_CHECKING:
    from trio_typing import TaskStatus

CONFIG = ClusterConfig()
DETECTOR = CONFIG.detector
NAMES = ("node-a", "node-b", "node-c")
LATENCY = 0.001
"""Seconds each message takes: with none, two nodes that disagree could answer each other forever
without the mock clock moving on."""
STEP = 0.01
"""How often the test looks (seconds of the mock clock): every time it reads is late by at most this."""
SLACK = STEP + 2 * LATENCY


class FakeMesh:
    """What `ClusterService` uses of a `Mesh`, delivered at once through a `FakeNetwork`."""

    def __init__(self, network: FakeNetwork, peer_id: str) -> None:
        self.peer_id = peer_id
        self.config = MeshConfig(data_dir=Path("/nonexistent"))  # only its size limits are read
        self._network = network
        self._gossip_in, self.gossip = trio.open_memory_channel[Gossip](math.inf)
        self._events_in, self.events = trio.open_memory_channel[PeerEvent](math.inf)
        self.handler: Callable[[str, bytes], Awaitable[bytes]] | None = None

    def set_request_handler(self, handler: Callable[[str, bytes], Awaitable[bytes]]) -> None:
        self.handler = handler

    def connected_peers(self) -> frozenset[str]:
        return self._network.peers_of(self.peer_id)

    def known_peers(self) -> dict[str, list[str]]:
        return {peer: [] for peer in self._network.meshes if peer != self.peer_id}

    def add_peer(self, peer_multiaddr: str) -> None:
        pass  # everyone is connected (or cut) by the test

    async def publish(self, data: bytes) -> None:
        await trio.sleep(LATENCY)
        for peer in self._network.reachable(self.peer_id):
            self._network.meshes[peer]._gossip_in.send_nowait(Gossip(self.peer_id, data))

    async def request(self, peer_id: str, payload: bytes) -> bytes:
        if peer_id not in self.connected_peers():
            raise RequestError(f"not connected to {peer_id}")
        await trio.sleep(LATENCY)
        target = self._network.meshes[peer_id]
        if peer_id not in self._network.reachable(self.peer_id) or target.handler is None:
            await trio.sleep(self.config.request_timeout_s)  # a frozen peer never answers
            raise RequestError(f"{peer_id} did not answer")
        return await target.handler(self.peer_id, payload)


class FakeNetwork:
    """Every node connected to every other; a node can be killed (its connections close) or frozen
    (its connections stay open, nothing crosses them: see `Cluster.freeze`)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.meshes = {name: FakeMesh(self, name) for name in names}
        self.up: set[str] = set()
        self.frozen: set[str] = set()

    def peers_of(self, peer_id: str) -> frozenset[str]:
        return frozenset(self.up - {peer_id}) if peer_id in self.up else frozenset()

    def reachable(self, peer_id: str) -> frozenset[str]:
        return frozenset() if peer_id in self.frozen else self.peers_of(peer_id) - self.frozen

    def connect(self, peer_id: str) -> None:
        for other in self.up:
            self.meshes[other]._events_in.send_nowait(PeerEvent(peer_id, up=True))
            self.meshes[peer_id]._events_in.send_nowait(PeerEvent(other, up=True))
        self.up.add(peer_id)

    def cut(self, peer_id: str) -> None:
        self.up.discard(peer_id)
        for other in self.up:
            self.meshes[other]._events_in.send_nowait(PeerEvent(peer_id, up=False))


def profile() -> NodeProfile:
    return NodeProfile("host", "linux", "cpu", 2**30, 2**29, "http://127.0.0.1:1", "0", 0.0)


class Service(ClusterService):
    """A `ClusterService` whose heartbeat task can be held while the rest of it (gossip, answers,
    ticks, claims) runs on: how a push awaited in that task held it before pushes went to the
    background, and how any other wait there would."""

    def __init__(self, mesh: FakeMesh, clock: Callable[[], float]) -> None:
        super().__init__(cast(Mesh, mesh), profile, CONFIG, clock=clock)
        self._resumed = trio.Event()
        self._resumed.set()
        self._beating = trio.CancelScope()

    def hold_heartbeats(self) -> None:
        self._resumed = trio.Event()
        self._beating.cancel()

    def resume_heartbeats(self) -> None:
        self._resumed.set()

    async def _heartbeats(self) -> None:
        while True:
            await self._resumed.wait()
            with trio.CancelScope() as self._beating:
                await super()._heartbeats()


class Cluster:
    """Three services on one `FakeNetwork`, each in its own cancel scope (a kill cancels it) and on
    its own clock (a frozen node's stands still)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.network = FakeNetwork(NAMES)
        self._stopped_at: dict[str, float] = {}
        self.services = {
            name: Service(mesh, functools.partial(self._clock, name))
            for name, mesh in self.network.meshes.items()
        }
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nursery = nursery

    async def start(self) -> None:
        for name, service in self.services.items():
            self._scopes[name] = await self._nursery.start(self._run, service)
            self.network.connect(name)

    @staticmethod
    async def _run(service: Service, *, task_status: TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                task_status.started(scope)

    def _clock(self, name: str) -> float:
        return self._stopped_at.get(name, trio.current_time())

    def freeze(self, name: str) -> None:
        """SIGSTOP, as far as the others and its own judgements go: nothing crosses its connections
        (which stay open) and its clock stands still, so that when it resumes it sees one long
        pause (which `protocol.membership` does not count against its peers)."""
        self.network.frozen.add(name)
        self._stopped_at[name] = trio.current_time()

    def thaw(self, name: str) -> None:
        self.network.frozen.discard(name)
        del self._stopped_at[name]

    def kill(self, name: str) -> None:
        """kill -9: its connections close at once, and it sends nothing more (no goodbye either)."""
        self.network.cut(name)
        self._scopes[name].cancel()

    def leaders(self, names: tuple[str, ...] = NAMES) -> set[NodeId | None]:
        return {self.services[name].decision.leader for name in names}

    def status(self, watcher: str, of: str) -> Status | None:
        return self.services[watcher].view.status(NodeId(of))

    def agreed(self, names: tuple[str, ...] = NAMES) -> NodeId | None:
        """The leader all of `names` follow once each sees the others alive; None before that."""
        alive = all(self.status(w, o) is Status.ALIVE for w in names for o in names if w != o)
        (leader,) = self.leaders(names) if len(self.leaders(names)) == 1 else (None,)
        return leader if alive else None


def run(scenario: Callable[[Cluster], Awaitable[None]]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cluster = Cluster(nursery)
            await cluster.start()
            await scenario(cluster)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def elapsed_until(check: Callable[[], object], since: float, what: str) -> float:
    """Mock-clock seconds from `since` until `check` holds (read every `STEP`)."""
    await wait_until_async(check, 60, what, interval=STEP)
    return trio.current_time() - since


def test_the_smallest_id_leads_after_the_startup_grace() -> None:
    async def scenario(cluster: Cluster) -> None:
        agreed = await elapsed_until(lambda: cluster.agreed() == "node-a", 0.0, "agreed on node-a")
        grace = CONFIG.election.startup_grace_s
        assert grace <= agreed <= grace + DETECTOR.tick_interval_s + SLACK, agreed
        assert {s.decision.term for s in cluster.services.values()} == {1}

    run(scenario)


def test_a_killed_leader_is_dead_and_replaced_once_its_connections_close() -> None:
    async def scenario(cluster: Cluster) -> None:
        await wait_until_async(lambda: cluster.agreed() == "node-a", 60, "agreed on node-a")
        killed = trio.current_time()
        cluster.kill("node-a")
        survivors = NAMES[1:]
        dead = await elapsed_until(
            lambda: all(cluster.status(s, "node-a") is Status.DEAD for s in survivors), killed, "a dead"
        )
        led = await elapsed_until(lambda: cluster.agreed(survivors) == "node-b", killed, "node-b leads")
        # The closed connection is the fast signal: dead at the first tick `lost_dead_after_s` after
        # it, not `dead_after_s` after the last heartbeat; the election follows on that same tick.
        fast = DETECTOR.lost_dead_after_s
        assert fast <= dead <= fast + DETECTOR.tick_interval_s + SLACK, dead
        assert led <= dead + SLACK, (led, dead)
        assert {cluster.services[s].decision.term for s in survivors} == {2}

    run(scenario)


async def settled(cluster: Cluster) -> None:
    """Agreed on node-a, and past every node's `direct_push_s` (the nodes started a few message
    latencies after 0), when heartbeats go by gossip alone."""
    await wait_until_async(lambda: cluster.agreed() == "node-a", 60, "agreed on node-a")
    await trio.sleep_until(CONFIG.direct_push_s + 1)


@pytest.mark.parametrize("who", ["node-b", "node-a"], ids=["follower", "leader"])
def test_a_frozen_node_is_judged_by_silence_and_alive_again_when_it_wakes(who: str) -> None:
    async def scenario(cluster: Cluster) -> None:
        await settled(cluster)
        watcher = "node-c"
        frozen = trio.current_time()
        cluster.freeze(who)
        dead = await elapsed_until(lambda: cluster.status(watcher, who) is Status.DEAD, frozen, "dead")
        # Its last heartbeat left at most one interval before the freeze; dead `dead_after_s` after it.
        low, high = DETECTOR.dead_after_s - DETECTOR.heartbeat_interval_s, DETECTOR.dead_after_s
        assert low <= dead <= high + DETECTOR.tick_interval_s + SLACK, dead
        others = tuple(n for n in NAMES if n != who)
        await wait_until_async(lambda: cluster.agreed(others) == others[0], 10, "the others agreed")
        woke = trio.current_time()
        cluster.thaw(who)
        back = await elapsed_until(lambda: cluster.status(watcher, who) is Status.ALIVE, woke, "alive")
        assert back <= DETECTOR.heartbeat_interval_s + SLACK, back
        # Back to the smallest id; every handover is one term (no claim war), and the woken node
        # counted its pause as its own, not its peers' silence: it never judged them dead.
        await wait_until_async(lambda: cluster.agreed() == "node-a", 10, "node-a leading again")
        terms = {s.decision.term for s in cluster.services.values()}
        assert terms == ({1} if who == "node-b" else {3}), terms
        assert all(cluster.status(who, o) is Status.ALIVE for o in others)

    run(scenario)


def test_a_frozen_peer_does_not_stall_a_young_nodes_heartbeats() -> None:
    async def scenario(cluster: Cluster) -> None:
        await wait_until_async(lambda: cluster.agreed() == "node-a", 60, "agreed on node-a")
        assert trio.current_time() < CONFIG.direct_push_s
        cluster.freeze("node-b")
        # Stop looking before node-c would judge node-a dead: from there node-c claims the lead
        # while node-a (which still sees node-c alive) claims it back, a term per message round.
        # (Its next heartbeat still goes out, then the push to node-b waits: suspect after that one.)
        await trio.sleep(DETECTOR.heartbeat_interval_s + DETECTOR.suspect_after_s + DETECTOR.tick_interval_s)
        assert cluster.status("node-a", "node-c") is Status.ALIVE
        assert cluster.status("node-c", "node-a") is Status.ALIVE

    run(scenario)


HELD = 2 * DETECTOR.dead_after_s
"""How long the heartbeats are held below: long enough for two rounds of judging the others dead."""


def test_views_that_disagree_cost_terms_per_silence_not_per_message() -> None:
    """Every node's heartbeats are held while the rest of it runs on (as a push to a frozen peer once
    held every young node's; a node held alone answers the suspicion the others gossip). Each judges
    the others dead: node-b or node-c claims the lead while node-a, to whom the claimer is alive,
    claims it back. A claim is written with a heartbeat, so it revives its writer wherever it
    arrives: a judgement costs a handover and a takeback, once per `dead_after_s` of silence.
    Before, the views stayed apart and the nodes outbid each other every message round (thousands
    of terms here)."""

    async def scenario(cluster: Cluster) -> None:
        await settled(cluster)
        held = trio.current_time()
        for service in cluster.services.values():
            service.hold_heartbeats()
        await trio.sleep(HELD)
        for service in cluster.services.values():
            service.resume_heartbeats()
        await wait_until_async(lambda: cluster.agreed() == "node-a", 10, "node-a leading again")
        (term,) = {s.decision.term for s in cluster.services.values()}
        await trio.sleep_until(held + 30)
        assert cluster.agreed() == "node-a"
        assert {s.decision.term for s in cluster.services.values()} == {term}
        # Silence from the last heartbeat before the hold (an interval at most) to the first after it
        # (an interval after the resume) fits this many judgements; each costs two terms at most.
        silence = HELD + 2 * DETECTOR.heartbeat_interval_s
        judgements = math.floor(silence / DETECTOR.dead_after_s)
        assert 3 <= term <= 1 + 2 * judgements, term

    run(scenario)
