"""Admission: the cluster handshake on every new connection, and the verdicts that gate delivery.

The I/O shell around `PeerBook` (the verdicts) and `auth` (the handshake bytes):
- libp2p's connection callbacks (`notifee`) feed the book; they run inline in the swarm, so they
  only update it and spawn work;
- each side that has not yet admitted a peer runs the initiator role on its first connection;
  each side always answers the responder role. Either run completing admits the peer;
- a failed handshake refuses the peer for `refuse_s` and closes its connections;
- `wait_admitted(peer)` is the gate every inbound pubsub/sync stream passes: it waits (at most
  `auth_timeout_s`) for the verdict, so a stream that races the handshake is not lost.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from node.net import auth, quirks
from node.net.config import MeshConfig
from node.net.events import MeshStats, PeerEvent
from node.net.peers import Opened, PeerBook
from protocol.framing import FrameError

log = logging.getLogger("shoal.net")

AUTH_PROTOCOL = TProtocol(auth.PROTOCOL_ID)
_NO_ANSWER: tuple[type[BaseException], ...] = (trio.TooSlowError, FrameError, *quirks.TRANSPORT_ERRORS)
"""A handshake got no complete answer in time (the peer died, stalled, or hung up on us)."""


class Admission:
    def __init__(
        self,
        *,
        host: IHost,
        my_id: ID,
        key: bytes,
        config: MeshConfig,
        stats: MeshStats,
        emit: Callable[[PeerEvent], None],
    ) -> None:
        self.host, self.my_id, self.key, self.config, self.stats = host, my_id, key, config, stats
        self.emit = emit
        self.book = PeerBook()
        self.changed = trio.Event()
        """Set (and replaced) on every change of connections or verdicts: a broadcast condition."""
        self.notifee: INotifee = _Notifee(self)
        self._nursery: trio.Nursery | None = None
        host.set_stream_handler(AUTH_PROTOCOL, self._serve_auth)
        host.get_network().register_notifee(self.notifee)

    def attach(self, nursery: trio.Nursery | None) -> None:
        """Where handshakes and disconnects run; before this, connections are only counted."""
        self._nursery = nursery

    def _changed_now(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    # --- libp2p's callbacks --------------------------------------------------------------------
    def on_connected(self, peer: ID) -> None:
        peer_id = peer.to_base58()
        action = self.book.connection_opened(peer_id, trio.current_time())
        if action is Opened.REFUSE:
            self.stats.refused_connections += 1
            self._spawn(self._disconnect, peer)
        elif action is Opened.AUTHENTICATE:
            self._spawn(self._initiate, peer, self.book.epoch(peer_id))
        self._changed_now()

    def on_disconnected(self, peer: ID) -> None:
        if self.book.connection_closed(peer.to_base58()):
            log.info("peer %s disconnected", peer)
            self.emit(PeerEvent(peer.to_base58(), up=False))
        self._changed_now()

    # --- the gate ------------------------------------------------------------------------------
    async def wait_admitted(self, peer: ID) -> bool:
        """Wait (at most `auth_timeout_s`) until `peer` is authenticated; False if it isn't."""
        peer_id = peer.to_base58()
        with trio.move_on_after(self.config.auth_timeout_s):
            while not self.book.is_authenticated(peer_id):
                if self.book.is_refused(peer_id, trio.current_time()):
                    break
                await self.changed.wait()
        admitted = self.book.is_authenticated(peer_id)
        if not admitted:
            self.stats.refused_streams += 1
        return admitted

    # --- the handshake -------------------------------------------------------------------------
    async def _initiate(self, peer: ID, epoch: int) -> None:
        started = trio.current_time()
        try:
            with trio.fail_after(self.config.auth_timeout_s):
                stream = await self.host.new_stream(peer, [AUTH_PROTOCOL])
                try:
                    await auth.initiate(stream, self.key, self.my_id.to_bytes(), peer.to_bytes())
                finally:
                    await quirks.close_quietly(stream)
        except auth.AuthError as exc:
            await self._failed(peer, epoch, f"{exc}", proven=True)
        except _NO_ANSWER as exc:
            await self._failed(peer, epoch, f"no valid answer ({exc!r})", proven=False)
        else:
            self._succeeded(peer, epoch, trio.current_time() - started)

    async def _serve_auth(self, stream: INetStream) -> None:
        """Responder side: always answer, whatever we already think of the peer."""
        peer = stream.muxed_conn.peer_id
        epoch, started = self.book.epoch(peer.to_base58()), trio.current_time()
        try:
            with trio.fail_after(self.config.auth_timeout_s):
                await auth.respond(stream, self.key, self.my_id.to_bytes(), peer.to_bytes())
        except auth.AuthError as exc:
            await quirks.reset_quietly(stream)
            await self._failed(peer, epoch, f"{exc}", proven=True)
        except _NO_ANSWER as exc:
            await quirks.reset_quietly(stream)
            await self._failed(peer, epoch, f"no valid answer ({exc!r})", proven=False)
        else:
            await quirks.close_quietly(stream)
            self._succeeded(peer, epoch, trio.current_time() - started)

    def _succeeded(self, peer: ID, epoch: int, took_s: float) -> None:
        if self.book.auth_succeeded(peer.to_base58(), epoch):
            self.stats.auth_succeeded += 1
            log.info("peer %s authenticated (%.1f ms)", peer, took_s * 1000)
            self.emit(PeerEvent(peer.to_base58(), up=True))
        self._changed_now()

    async def _failed(self, peer: ID, epoch: int, why: str, *, proven: bool) -> None:
        now = trio.current_time()
        # A wrong proof is refused for long; a handshake that merely got no answer (a busy or
        # restarting peer) only briefly, so the next dial retries it soon.
        refuse_s = self.config.refuse_s if proven else self.config.unanswered_refuse_s
        refused = self.book.auth_failed(peer.to_base58(), epoch, now, refuse_s, proven=proven)
        self._changed_now()
        if refused:
            self.stats.auth_failed += 1
            log.warning("refusing peer %s for %.0f s: %s", peer, refuse_s, why)
            await self._disconnect(peer)

    async def _disconnect(self, peer: ID) -> None:
        with trio.move_on_after(self.config.dial_timeout_s):
            try:
                await self.host.disconnect(peer)
            except quirks.TRANSPORT_ERRORS as exc:
                log.debug("disconnecting %s: %r", peer, exc)


class _Notifee(INotifee):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self.admission.on_connected(conn.muxed_conn.peer_id)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self.admission.on_disconnected(conn.muxed_conn.peer_id)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass
