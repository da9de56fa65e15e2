"""The trio driver of the mesh's pure cores: heartbeats, gossip, anti-entropy, failure detection, election.

It owns this node's `ClusterState` and `View` and moves bytes through the `Mesh`; every decision is
made by a pure function in `protocol/` (merge, `observe_state`/`tick`, `decide_leader`). Gossip is
best effort (GossipSub drops silently), so each node also runs push-pull anti-entropy with one
random peer every `anti_entropy_interval_s`, and at once with every newly connected peer.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from node.net.host import PeerAddrError
from node.net.mesh import Mesh, RequestError
from protocol.cluster import ClusterState, NotLeaderError
from protocol.cluster_codec import (
    Delta,
    DigestReply,
    DigestRequest,
    WireDecodeError,
    decode_message,
    encode_delta,
    encode_digest_reply,
    encode_message,
)
from protocol.cluster_records import InstanceRecord, NodeHoldings, NodeLoad, NodeProfile, NodeTransfers
from protocol.cluster_view import ClusterView, MemberView
from protocol.election import Decision, ElectionConfig, apply_decision, decide_leader, may_claim
from protocol.ids import InstanceId, NodeId
from protocol.membership import (
    FailureDetectorConfig,
    Status,
    Transition,
    View,
    disconnected,
    observe_state,
    reconnected,
    tick,
)
from protocol.model_files import holding_views, instance_view
from protocol.replicas import load_view

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.cluster")

MEMORY_ROUNDING = 64 * 2**20
"""Available memory is published in 64 MiB steps, so that small changes don't each cost a gossip message."""


@dataclass(frozen=True)
class ClusterConfig:
    cluster: str = "shoal"
    detector: FailureDetectorConfig = field(default_factory=FailureDetectorConfig)
    election: ElectionConfig = field(default_factory=ElectionConfig)
    anti_entropy_interval_s: float = 1.0
    """One push-pull round with a random peer per interval heals any lost gossip within seconds."""
    direct_push_s: float = 5.0
    """For this long after start, heartbeats also go point to point to every connected peer:
    GossipSub takes ~1 s to put a newcomer into its mesh and silently drops what it publishes before,
    and a newcomer counts as alive only once a second heartbeat of it arrives."""
    leave_grace_s: float = 0.3
    """On a clean shutdown, time given to the goodbye delta to leave before the host closes."""


@dataclass
class ClusterStats:
    dropped_messages: int = 0
    """Gossip or sync payloads that failed to decode (malformed, hostile, other schema)."""
    anti_entropy_rounds: int = 0
    gossip_bytes_out: int = 0
    """Deltas published on the gossip topic."""
    sync_bytes_out: int = 0
    """Anti-entropy requests and answers sent (digests and deltas)."""


class ClusterService:
    def __init__(
        self,
        mesh: Mesh,
        profile: Callable[[], NodeProfile],
        config: ClusterConfig,
        *,
        clock: Callable[[], float] = trio.current_time,
        files: Callable[[], tuple[NodeHoldings, NodeTransfers]] | None = None,
    ) -> None:
        self.mesh = mesh
        self.me = NodeId(mesh.peer_id)
        self.config = config
        self.stats = ClusterStats()
        self._profile = profile
        self._files = files
        """The model files this node serves and those moving to it (`ClusterFiles.records`), written
        with each heartbeat when they changed."""
        self._load: Callable[[], NodeLoad] | None = None
        self._clock = clock
        self.state = ClusterState.empty()
        self.view = View.empty()
        self.decision = Decision(None, 0, self.me, claim=False)
        self._started_at = 0.0
        self._running = False
        self._changed = trio.Event()
        self._pushing: set[str] = set()
        """Peers with a direct push in flight (see `_push_to_all`)."""

    # --- the service -------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started_at = self._clock()
        self._running = True
        self.mesh.set_request_handler(self._answer)
        await self._write(self._own_records().with_heartbeat(self.me))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            nursery.start_soon(self._ticks)
            nursery.start_soon(self._receive_gossip)
            nursery.start_soon(self._anti_entropy)
            nursery.start_soon(self._peer_events)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2 * self.config.leave_grace_s):
                    await self._write(self.state.with_leave(self.me))
                    await trio.sleep(self.config.leave_grace_s)

    async def wait_changed(self) -> None:
        """Returns at the next change of the state or of the view (for tests and `--watch`-like loops)."""
        await self._changed.wait()

    async def publish_own(self) -> None:
        """Write and gossip this node's own records now if they changed (e.g. a model it just began
        to serve: peers placed on it should find it at once, not at the next heartbeat)."""
        if self._running:
            await self._write(self._own_records())

    def report_load(self, load: Callable[[], NodeLoad]) -> None:
        """Write `load()` (the instances this node is the entry of) with each heartbeat when it changed."""
        self._load = load

    # --- writing and merging -----------------------------------------------------------------
    async def _write(self, new_state: ClusterState) -> ClusterState:
        """Adopt a locally written state and gossip what changed; returns that delta."""
        delta = new_state.delta_since(self.state)
        self.state = new_state
        self._notify()
        await self._publish(delta)
        return delta

    async def _publish(self, delta: ClusterState) -> None:
        if len(delta) == 0:
            return
        for payload in encode_delta(delta, self.mesh.config.max_gossip_bytes):
            self.stats.gossip_bytes_out += len(payload)
            await self.mesh.publish(payload)

    async def _merge(self, remote: ClusterState, *, regossip: bool = False) -> None:
        """Merge a peer's records. `regossip`: they came point to point (anti-entropy), so pass what
        was news to us on to everyone: a newcomer known to one node is known to all within a hop."""
        merged = self.state.merge(remote)
        if merged == self.state:
            return
        news = merged.delta_since(self.state) if regossip else ClusterState.empty()
        self.state = merged
        self._connect_to_members()
        self.view, changes = observe_state(self.view, merged, self.me, self._clock())
        self._log(changes)
        if merged.is_suspected(self.me):
            log.info("refuting a suspicion of this node")
            await self._write(self.state.with_heartbeat(self.me, self.view.suspects()))
        await self._elect()
        self._notify()
        await self._publish(news)

    def _own_records(self) -> ClusterState:
        """The state with this node's profile, files and load records as they are now (no-ops if same)."""
        state = self.state.with_profile(self.me, self._profile())
        if self._files is not None:
            holdings, transfers = self._files()
            state = state.with_holdings(self.me, holdings).with_transfers(self.me, transfers)
        return state if self._load is None else state.with_load(self.me, self._load())

    def _connect_to_members(self) -> None:
        """Dial every member the state names that the mesh doesn't know yet: a full mesh, so that the
        loss of one node (say, the bootstrap peer everyone dialed) never splits the others."""
        known = self.mesh.known_peers()
        for node, profile in self.state.profiles().items():
            if node == self.me or node in known:
                continue
            for addr in profile.multiaddrs:
                if not addr.endswith(f"/p2p/{node}"):
                    continue  # an address that isn't the member's own is never dialed
                try:
                    self.mesh.add_peer(addr)
                except PeerAddrError as exc:
                    log.debug("member %s advertises an unusable address: %s", node, exc)

    async def _elect(self) -> None:
        now = self._clock()
        claim = self.state.leader_claim()
        decision = decide_leader(
            self.view.live(),
            [claim] if claim is not None else [],
            self.me,
            may_claim=may_claim(now, self._started_at, self.config.election),
        )
        if decision.leader != self.decision.leader and decision.leader is not None:
            log.info("leader is %s (term %d)", decision.leader, decision.term)
        self.decision = decision
        if decision.claim:
            # A claim is proof of life: written with a heartbeat, it revives this node for whoever
            # learns of it, and no node that judged it dead can outbid it a message round later.
            claimed = apply_decision(self.state, decision, self.me)
            await self._write(claimed.with_heartbeat(self.me, self.view.suspects()))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _log(self, changes: list[Transition]) -> None:
        for change in changes:
            log.info("member %s: %s -> %s", change.node, change.before or "new", change.after)

    # --- loops -------------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        async with trio.open_nursery() as pushes:
            while True:
                await trio.sleep(self.config.detector.heartbeat_interval_s)
                state = self._own_records()
                delta = await self._write(state.with_heartbeat(self.me, self.view.suspects()))
                if self._clock() - self._started_at < self.config.direct_push_s:
                    self._push_to_all(pushes, delta)

    def _push_to_all(self, pushes: trio.Nursery, delta: ClusterState) -> None:
        """Send a delta point to point to every connected peer, best effort, in the background: a
        heartbeat never waits on a slow or frozen peer. A peer still busy with an earlier push is
        skipped (later heartbeats supersede this one), so at most one push per peer is open."""
        payloads = encode_delta(delta, self.mesh.config.max_request_bytes)
        for peer_id in self.mesh.connected_peers() - self._pushing:
            self._pushing.add(peer_id)
            pushes.start_soon(self._push, peer_id, payloads)

    async def _push(self, peer_id: str, payloads: list[bytes]) -> None:
        """One push, bounded by the mesh's request timeout (a slow peer gets it late, not never)."""
        try:
            with suppress(RequestError):
                for payload in payloads:
                    await self._request(peer_id, payload)
        finally:
            self._pushing.discard(peer_id)

    async def _ticks(self) -> None:
        while True:
            await trio.sleep(self.config.detector.tick_interval_s)
            self.view, changes = tick(self.view, self._clock(), self.config.detector)
            self._log(changes)
            await self._elect()
            if changes:
                self._notify()

    async def _receive_gossip(self) -> None:
        async for gossip in self.mesh.gossip:
            message = self._decode(gossip.data)
            if isinstance(message, Delta):
                await self._merge(message.state)

    async def _anti_entropy(self) -> None:
        while True:
            await trio.sleep(self.config.anti_entropy_interval_s)
            peers = sorted(self.mesh.connected_peers())
            if peers:
                await self._sync_with(random.choice(peers))

    async def _peer_events(self) -> None:
        async for event in self.mesh.events:
            if event.up:
                self.view = reconnected(self.view, NodeId(event.peer_id))
                await self._sync_with(event.peer_id)
            else:  # crashed or killed, most likely: the detector may call it dead sooner
                self.view = disconnected(self.view, NodeId(event.peer_id), self._clock())

    async def _sync_with(self, peer_id: str) -> None:
        """Push-pull: send our digest, merge what the peer says we lack, send what it lacks."""
        self.stats.anti_entropy_rounds += 1
        try:
            answer = await self._request(peer_id, encode_message(DigestRequest(self.state.digest())))
            reply = self._decode(answer)
            if not isinstance(reply, DigestReply):
                return
            await self._merge(reply.delta, regossip=True)
            missing = self.state.missing_for(reply.digest)
            for payload in encode_delta(missing, self.mesh.config.max_request_bytes):
                await self._request(peer_id, payload)
        except RequestError as exc:
            log.debug("anti-entropy with %s failed: %s", peer_id, exc)

    async def _request(self, peer_id: str, payload: bytes) -> bytes:
        self.stats.sync_bytes_out += len(payload)
        return await self.mesh.request(peer_id, payload)

    async def _answer(self, peer_id: str, payload: bytes) -> bytes:
        message = self._decode(payload)
        if isinstance(message, DigestRequest):
            reply = encode_digest_reply(self.state, message.digest, self.mesh.config.max_request_bytes)
            self.stats.sync_bytes_out += len(reply)
            return reply
        if isinstance(message, Delta):
            await self._merge(message.state, regossip=True)
        return b""

    def _decode(self, payload: bytes) -> Delta | DigestRequest | DigestReply | None:
        try:
            return decode_message(payload)
        except WireDecodeError as exc:
            self.stats.dropped_messages += 1
            log.debug("dropped an undecodable cluster message: %s", exc)
            return None

    # --- leader writes and membership reads (for instance placement) --------------------------
    @property
    def is_leader(self) -> bool:
        return self.decision.leader == self.me

    async def put_instance(self, record: InstanceRecord) -> None:
        """Write (or overwrite) an instance record; only the leader may (NotLeaderError otherwise)."""
        if not self.is_leader:
            raise NotLeaderError(f"{self.me} is not the leader")
        await self._write(self.state.with_instance(self.me, self.decision.term, record))

    async def remove_instance(self, instance_id: InstanceId) -> None:
        if not self.is_leader:
            raise NotLeaderError(f"{self.me} is not the leader")
        await self._write(self.state.without_instance(self.me, self.decision.term, instance_id))

    def alive_memory(self) -> dict[NodeId, int]:
        """Available memory of every node alive now (this one included), from their profiles."""
        alive = self.view.alive() | {self.me}
        return {node: p.memory_available for node, p in self.state.profiles().items() if node in alive}

    def peer_urls(self) -> dict[NodeId, str]:
        """The API URL of every other node alive now (`node.cluster.links` measures the way there)."""
        alive = self.view.alive() - {self.me}
        return {node: p.api_url for node, p in self.state.profiles().items() if node in alive and p.api_url}

    # --- what the API shows ------------------------------------------------------------------
    def snapshot(self) -> ClusterView:
        now = self._clock()
        leader = self.decision.leader
        holdings, transfers = self.state.holdings(), self.state.transfers()
        members = []
        for node, profile in sorted(self.state.profiles().items()):
            if node == self.me:
                status, last_seen = Status.ALIVE, None
            else:
                member = self.view.members.get(node)
                status = member.status if member is not None else Status.UNKNOWN
                last_seen = round(now - member.last_advance, 2) if member is not None else None
            members.append(
                MemberView(
                    id=node,
                    host=profile.hostname,
                    role="leader" if node == leader else "follower",
                    status=status.value,
                    backend=profile.accelerator,
                    os=profile.os,
                    memory_total=profile.memory_total,
                    memory_available=profile.memory_available,
                    last_seen_s=last_seen,
                    api_url=profile.api_url,
                    version=profile.version,
                    multiaddrs=profile.multiaddrs,
                    models=holding_views(holdings.get(node, NodeHoldings())),
                    transfers=transfers.get(node, NodeTransfers()).transfers,
                    round_trips_us={trip.node: trip.us for trip in profile.links},
                )
            )
        loads = self.state.loads()
        instances = [
            instance_view(record, transfers).model_copy(update={"load": load_view(record, loads)})
            for record in self.state.instances().values()
        ]
        return ClusterView(
            cluster=self.config.cluster,
            self=self.me,
            leader=leader,
            term=self.decision.term,
            members=tuple(members),
            instances=tuple(instances),
        )
