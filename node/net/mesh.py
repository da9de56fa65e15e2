"""The node's view of the network: authenticated peers, gossip, requests, connection events.

`Mesh` owns the libp2p host (TCP + Noise + Yamux), admits only peers that prove the cluster key
(`auth.py`), and gives the layer above a small byte-oriented interface:

- gossip: `await mesh.publish(data)`; `mesh.gossip` yields `Gossip(peer_id, data)` for every
  message of the cluster's GossipSub topic (never our own), best effort: GossipSub drops silently,
  so the state above must converge by merge and anti-entropy;
- requests: `await mesh.request(peer_id, payload) -> bytes` on `/shoal/sync/1.0.0` (or any other
  `protocol=`), served by the handler given to `set_request_handler(handler, protocol=...)`;
- channels: `await mesh.open_channel(peer_id, protocol) -> Channel`, many frames both ways on one
  stream (`node/net/channel.py`), served by the handler given to `set_channel_handler()`;
- `mesh.events` yields `PeerEvent(peer_id, up)` when a peer becomes authenticated / loses its last
  connection; `mesh.connected_peers()` is the authenticated set now;
- peers from `bootstrap_peers`, `add_peer()` and mDNS are redialed while disconnected
  (`node/net/redial.py`); `mesh.known_peers()` lists them.

Nothing from a peer that has not passed authentication is ever delivered upward: its pubsub,
request and channel streams wait for the verdict and are reset when refused, gossip it forwards is
rejected.

Measured on loopback, two meshes in one trio process on the 2-core machine (medians; 10
connects, 200 small requests, 50 gossip messages):
- connect (dial returns): 6.7 ms (max_connections_per_peer=1; ~250 ms without it);
- authentication, connect -> both sides admitted: 15 ms;
- request round trip, 100 B (new stream, frame, handler, answer, close): 3.7 ms; 64 KiB: 4.4 ms;
- gossip publish -> delivered: 3.6 ms once the GossipSub mesh has formed, which takes one
  heartbeat (~1 s) after the peers connect; until then publishes may be lost.
Channels, two processes: open + first frame back 3.2 ms; small frames streamed one way
140-290 us each (3.5-7k frames/s; both ends in one process: ~0.6 ms).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from node.net import auth, quirks
from node.net.admission import Admission
from node.net.channel import Channel, ChannelError
from node.net.config import MeshConfig
from node.net.discovery import Announcement, MdnsDiscovery
from node.net.events import Gossip, MeshStats, PeerEvent
from node.net.framing import read_frame, write_frame
from node.net.host import P2PHost
from node.net.identity import load_or_create_identity
from node.net.redial import Redialer
from protocol.framing import FrameError

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.net")

SYNC_PROTOCOL = TProtocol("/shoal/sync/1.0.0")
STATUS_OK, STATUS_ERROR = 0, 1
"""First byte of a response frame; ONLY APPEND new statuses."""
_STREAM_ERRORS: tuple[type[BaseException], ...] = (FrameError, *quirks.TRANSPORT_ERRORS)
"""A request/answer stream failed: the peer broke framing or the connection died."""


class RequestError(Exception):
    """A request failed: peer unavailable, transport failure, timeout, or the peer's handler failed."""


class RemoteError(RequestError):
    """The peer answered with an error (no handler, handler raised, response too large)."""


RequestHandler = Callable[[str, bytes], Awaitable[bytes]]
ChannelHandler = Callable[[str, Channel], Awaitable[None]]
"""`await handler(peer_id, channel)`; the channel is closed (reset if the handler raised) after it."""


class Mesh:
    def __init__(self, config: MeshConfig, key_pair: KeyPair | None = None) -> None:
        quirks.route_libp2p_logging()
        quirks.shield_frame_writes()
        self.config = config
        key_pair = key_pair or load_or_create_identity(config.data_dir)
        self._p2p = P2PHost(
            key_pair,
            connection_config=quirks.connection_config(
                health_check_interval_s=config.health_check_interval_s, ping_timeout_s=config.ping_timeout_s
            ),
            listen_host=config.listen_host,
            port=config.p2p_port,
            advertise_ips=config.advertise_ips,
        )
        self.host = self._p2p.host
        quirks.disable_auto_connector(self.host)
        quirks.no_internal_retries(self.host)
        self.peer_id = self._p2p.peer_id
        self.stats = MeshStats()
        self.topic = f"/shoal/{config.cluster}/gossip/1"
        self._handlers: dict[str, RequestHandler] = {}
        self._inbound_channels = 0
        self._request_limiter = trio.CapacityLimiter(config.max_concurrent_requests)
        self._answer_cap = config.max_request_bytes + 1
        """An answer frame: a status byte, then at most `max_request_bytes`."""
        self._nursery: trio.Nursery | None = None
        self._gossip_send, self.gossip = trio.open_memory_channel[Gossip](config.gossip_buffer)
        self._event_send, self.events = trio.open_memory_channel[PeerEvent](config.event_buffer)

        self._router = quirks.gossip_router(
            degree=config.gossip_degree,
            degree_low=config.gossip_degree_low,
            degree_high=config.gossip_degree_high,
            heartbeat_s=config.gossip_heartbeat_s,
        )
        self._admission = Admission(
            host=self.host,
            my_id=self._p2p.id,
            key=auth.derive_key(config.cluster, config.secret),
            config=config,
            stats=self.stats,
            emit=self._emit,
        )
        self._book = self._admission.book
        self._redial = Redialer(
            host=self.host, admission=self._admission, config=config, stats=self.stats, my_id=self.peer_id
        )
        self._pubsub = Pubsub(self.host, self._router, allowed_topics={self.topic})
        quirks.gate_pubsub(self.host, self._pubsub, self._admission.wait_admitted)
        self._pubsub.set_topic_validator(self.topic, self._validate_gossip, False)
        self.host.set_stream_handler(SYNC_PROTOCOL, functools.partial(self._serve_request, SYNC_PROTOCOL))
        for peer in config.bootstrap_peers:
            self._redial.add(peer)

    # --- the service ---------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, join the gossip topic, dial bootstrap peers, run mDNS; started with our addrs."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._admission.attach(nursery)
                self._redial.attach(nursery)
                addrs: list[str] = await nursery.start(self._p2p.run)
                async with background_trio_service(self._pubsub), background_trio_service(self._router):
                    await self._pubsub.wait_until_ready()
                    subscription = await self._pubsub.subscribe(self.topic)
                    nursery.start_soon(self._pump_gossip, subscription)
                    self._redial.dial_all()
                    if self.config.mdns:
                        await nursery.start(self._discovery(addrs).run)
                    task_status.started(addrs)
                    await trio.sleep_forever()
        finally:
            self._nursery = None
            self._admission.attach(None)
            self._redial.attach(None)

    def addrs(self) -> list[str]:
        return self._p2p.addrs()

    def connected_peers(self) -> frozenset[str]:
        """Peers authenticated now (each has at least one open connection)."""
        return self._book.authenticated_peers()

    def known_peers(self) -> dict[str, list[str]]:
        """Peers we dial when disconnected (bootstrap, `add_peer`, mDNS) and their multiaddrs."""
        return {peer_id: list(addrs) for peer_id, addrs in self._redial.known.items()}

    def set_request_handler(self, handler: RequestHandler, protocol: str = SYNC_PROTOCOL) -> None:
        """`await handler(peer_id, payload) -> response` for requests on `protocol`.

        Only authenticated peers reach it. One handler per protocol; setting another replaces it.
        """
        if protocol not in self._handlers and protocol != SYNC_PROTOCOL:
            self.host.set_stream_handler(
                TProtocol(protocol), functools.partial(self._serve_request, protocol)
            )
        self._handlers[protocol] = handler

    def add_peer(self, peer_multiaddr: str) -> None:
        """Dial a peer (`/ip4/.../tcp/.../p2p/ID`) now and again whenever it is disconnected."""
        self._redial.add(peer_multiaddr)

    # --- gossip --------------------------------------------------------------------------------
    async def publish(self, data: bytes) -> None:
        """Gossip `data` to the cluster, best effort. ValueError if over `max_gossip_bytes`."""
        if len(data) > self.config.max_gossip_bytes:
            raise ValueError(f"gossip of {len(data)} bytes exceeds max_gossip_bytes; use a request")
        await self._pubsub.publish(self.topic, data)

    def _validate_gossip(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        ok = (forwarder == self._p2p.id or self._book.is_authenticated(forwarder.to_base58())) and len(
            msg.data
        ) <= self.config.max_gossip_bytes
        if not ok:
            self.stats.gossip_rejected += 1
        return ok

    async def _pump_gossip(self, subscription: Any) -> None:
        async for msg in subscription:
            origin = ID(msg.from_id)
            if origin == self._p2p.id:
                continue  # pubsub hands us our own publishes too
            try:
                self._gossip_send.send_nowait(Gossip(origin.to_base58(), bytes(msg.data)))
                self.stats.gossip_delivered += 1
            except trio.WouldBlock:
                self.stats.gossip_dropped += 1

    # --- requests ------------------------------------------------------------------------------
    async def request(self, peer_id: str, payload: bytes, protocol: str = SYNC_PROTOCOL) -> bytes:
        """Send `payload` to an authenticated peer's handler for `protocol` and return its answer.

        Bounded by `request_timeout_s` (wrap it in a tighter cancel scope if needed). Raises
        RequestError (RemoteError when the peer answered with an error); ValueError when
        `payload` exceeds `max_request_bytes`.
        """
        if len(payload) > self.config.max_request_bytes:
            raise ValueError(f"request of {len(payload)} bytes exceeds max_request_bytes")
        if not self._book.is_authenticated(peer_id):
            raise RequestError(f"peer {peer_id} is not connected")
        try:
            with trio.fail_after(self.config.request_timeout_s):
                stream = await self.host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
                try:
                    await write_frame(stream, payload, self.config.max_request_bytes)
                    answer = await read_frame(stream, self._answer_cap)
                finally:
                    await quirks.close_quietly(stream)
        except trio.TooSlowError as exc:
            raise RequestError(f"request to {peer_id} timed out") from exc
        except _STREAM_ERRORS as exc:
            raise RequestError(f"request to {peer_id} failed: {exc!r}") from exc
        if not answer or answer[0] not in (STATUS_OK, STATUS_ERROR):
            raise RequestError(f"malformed answer from {peer_id}")
        if answer[0] == STATUS_ERROR:
            raise RemoteError(f"{peer_id}: {answer[1:].decode(errors='replace')}")
        return answer[1:]

    async def _serve_request(self, protocol: str, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        if not await self._admission.wait_admitted(peer):
            await quirks.reset_quietly(stream)
            return
        reading = True
        async with self._request_limiter:
            with trio.move_on_after(self.config.request_timeout_s) as scope:
                try:
                    payload = await read_frame(stream, self.config.max_request_bytes)
                except _STREAM_ERRORS as exc:
                    self.stats.bad_frames += 1
                    log.debug("dropped a request from %s: %r", peer, exc)
                    await quirks.reset_quietly(stream)
                    return
                reading = False
                answer = await self._answer(protocol, peer.to_base58(), payload)
                try:
                    await write_frame(stream, answer, self._answer_cap)
                except quirks.TRANSPORT_ERRORS as exc:
                    log.debug("could not answer %s: %r", peer, exc)
            if scope.cancelled_caught:
                if reading:  # the peer stalled mid-request
                    self.stats.bad_frames += 1
                else:
                    log.warning("request from %s not answered within request_timeout_s", peer)
                await quirks.reset_quietly(stream)
                return
        await quirks.close_quietly(stream)

    async def _answer(self, protocol: str, peer_id: str, payload: bytes) -> bytes:
        self.stats.requests_served += 1
        handler = self._handlers.get(protocol)
        if handler is None:
            return bytes([STATUS_ERROR]) + b"no request handler"
        try:
            response = await handler(peer_id, payload)
        except Exception as exc:  # the handler is the layer above's code: answer, log, carry on
            log.exception("request handler failed for a request from %s", peer_id)
            return bytes([STATUS_ERROR]) + f"handler failed: {type(exc).__name__}".encode()
        if len(response) > self.config.max_request_bytes:
            log.error("request handler answered %d bytes (> max_request_bytes)", len(response))
            return bytes([STATUS_ERROR]) + b"response too large"
        return bytes([STATUS_OK]) + response

    # --- channels ------------------------------------------------------------------------------
    async def open_channel(
        self, peer_id: str, protocol: str, *, max_frame_bytes: int | None = None
    ) -> Channel:
        """Open a channel to an authenticated peer's handler for `protocol`.

        `max_frame_bytes` caps the frames each side sends and accepts (default `max_request_bytes`;
        both sides must agree). Opening is bounded by `channel_open_timeout_s` (a frozen peer never
        answers the protocol negotiation; wrap it in a tighter cancel scope if needed). Raises
        ChannelError when the peer is not connected, has no handler for `protocol`, or does not
        answer; RuntimeError when the mesh is not running. The caller closes the channel.
        """
        if self._nursery is None:
            raise RuntimeError("the mesh is not running")
        if not self._book.is_authenticated(peer_id):
            raise ChannelError(f"peer {peer_id} is not connected")
        try:
            with trio.fail_after(self.config.channel_open_timeout_s):
                stream = await self._new_stream(peer_id, protocol)
        except trio.TooSlowError as exc:
            raise ChannelError(f"opening a channel to {peer_id} timed out") from exc
        except quirks.TRANSPORT_ERRORS as exc:
            raise ChannelError(f"opening a channel to {peer_id} failed: {exc!r}") from exc
        channel = Channel(stream, peer_id, protocol, max_frame_bytes or self.config.max_request_bytes)
        channel.start_reading(self._nursery)
        return channel

    async def _new_stream(self, peer_id: str, protocol: str) -> Any:
        """A stream, tried a second time after a transport error: when two nodes dial each other
        as one joins, the connection a first stream picked can be the one being closed (seen as a
        503 on the first request to a node that had just joined, under load). Nothing was sent
        yet, so trying again is safe."""
        for attempt in range(2):
            try:
                return await self.host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
            except quirks.TRANSPORT_ERRORS:
                if attempt == 1 or not self._book.is_authenticated(peer_id):
                    raise
                await trio.sleep(0.2)
        raise AssertionError("unreachable")

    def set_channel_handler(
        self, protocol: str, handler: ChannelHandler, *, max_frame_bytes: int | None = None
    ) -> None:
        """Serve channels on `protocol`: `await handler(peer_id, channel)` for each, concurrently.

        Only authenticated peers reach it. After the handler returns the channel is closed (reset
        if it raised). Over `max_inbound_channels` open at once, new ones are reset at once.
        """
        cap = max_frame_bytes or self.config.max_request_bytes
        self.host.set_stream_handler(
            TProtocol(protocol), functools.partial(self._serve_channel, protocol, handler, cap)
        )

    async def _serve_channel(
        self, protocol: str, handler: ChannelHandler, max_frame_bytes: int, stream: INetStream
    ) -> None:
        peer = stream.muxed_conn.peer_id
        if not await self._admission.wait_admitted(peer):
            await quirks.reset_quietly(stream)
            return
        if self._inbound_channels >= self.config.max_inbound_channels:
            log.warning("refused a %s channel from %s: max_inbound_channels open", protocol, peer)
            await quirks.reset_quietly(stream)
            return
        self._inbound_channels += 1
        try:
            async with trio.open_nursery() as nursery:
                channel = Channel(stream, peer.to_base58(), protocol, max_frame_bytes)
                channel.start_reading(nursery)
                try:
                    await handler(peer.to_base58(), channel)
                except ChannelError as exc:
                    log.debug("%s channel from %s broke: %s", protocol, peer, exc)
                    await channel.reset()
                except Exception:  # the handler is the layer above's code: log, reset, carry on
                    log.exception("%s channel handler failed (peer %s)", protocol, peer)
                    await channel.reset()
                else:
                    await channel.aclose()
        finally:
            self._inbound_channels -= 1

    def _emit(self, event: PeerEvent) -> None:
        try:
            self._event_send.send_nowait(event)
        except trio.WouldBlock:
            self.stats.events_dropped += 1
            log.warning("peer event dropped (nobody reads mesh.events?): %s", event)

    def _discovery(self, addrs: list[str]) -> MdnsDiscovery:
        plain = [a.removesuffix(f"/p2p/{self.peer_id}") for a in addrs]
        return MdnsDiscovery(
            me=Announcement(self.peer_id, self.config.cluster, tuple(plain)),
            interfaces=self._p2p.advertise_ips,
            port=self._p2p.port,
            on_found=self._redial.mdns_found,
            on_lost=self._redial.mdns_lost,
            on_ignored=self._redial.mdns_ignored,
        )
