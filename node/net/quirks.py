"""Every py-libp2p 0.8.1 workaround lives here, each with the measured fact behind it.

The rest of `node/net` calls these helpers and never touches py-libp2p internals. When py-libp2p
fixes something, the fix is one function here. Facts are from /work/shared/notes/platform.md
(measured on these machines) or from reading py-libp2p 0.8.1's source; the file/function is named.

- `connection_config`: 250 ms per connect unless max_connections_per_peer=1; silent peer loss
  unnoticed unless health monitoring is on.
- `gossip_router`: GossipSub silently rate-limits our own publishes (spam protection).
- `allow_redial` / `dial`: the 60 s negative cache; dials that hang >100 s; one address per dial.
- `no_internal_retries`, `disable_auto_connector`: the swarm retrying and dialing on its own.
- `gate_pubsub`: pubsub has no allow-list; it talks to any connected peer.
- `route_libp2p_logging`: the `libp2p` logger is cut off from ours and logs normal events as errors.
(tests/test_net_mesh.py::test_quirk_negative_cache_is_bypassed pins the negative-cache behavior.)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.stream_muxer.yamux.yamux import Yamux

log = logging.getLogger("shoal.net")

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    BaseLibp2pError,  # StreamError/StreamEOF/StreamReset, SwarmException, Multiselect*Error, ...
    OSError,
    EOFError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)
"""What a libp2p stream or dial raises when the *remote* side or the network fails. Anything else
out of py-libp2p is treated as a bug and propagates."""
DIAL_ERRORS: tuple[type[BaseException], ...] = (trio.TooSlowError, *TRANSPORT_ERRORS)


def connection_config(*, health_check_interval_s: float, ping_timeout_s: float) -> ConnectionConfig:
    """The ConnectionConfig every Shoal host uses.

    - `max_connections_per_peer=1`: with the default (3) every `connect()` waits ~250 ms in the
      swarm's "happy eyeballs" loop (swarm.py `dial_peer`: `move_on_after(_HAPPY_EYEBALLS_DELAY)`
      runs until the per-peer count is reached); with 1 a loopback connect takes 6-20 ms (measured).
      Simultaneous dials A->B and B->A can still leave two connections; streams work over both,
      and Mesh counts connections per peer, so that is harmless (mDNS dial ordering makes it rare).
    - Health monitoring: a peer that silently vanishes (frozen process, cut cable) is *never*
      noticed by default; with these settings it is dropped within interval + ping timeout. Our own failure
      detector (heartbeats in the gossiped state) is still needed above this.
    """
    return ConnectionConfig(
        max_connections_per_peer=1,
        enable_health_monitoring=True,
        health_initial_delay=1.0,
        health_warmup_window=0.0,
        health_check_interval=health_check_interval_s,
        ping_timeout=ping_timeout_s,
        abort_connection_on_ping_failure=True,
    )


def gossip_router(*, degree: int, degree_low: int, degree_high: int, heartbeat_s: int) -> GossipSub:
    """A GossipSub router (v1.2, v1.1) for a small trusted cluster.

    - `spam_protection_enabled=False`: on by default it limits even our own publishes to 10 msg/s
      per topic and drops the rest silently; `publish()` never raises (measured).
    - `eclipse_protection_enabled=False`: it wants >= 3 distinct IPs in the mesh and grafts extra
      peers to get them; meaningless for a cluster on one LAN (or one host in tests), and every
      peer here has proven the cluster key anyway.
    Other silent drops remain and are designed around (state converges by merge; bulk data goes
    over requests): a peer's outbound queue holds 32 messages, a subscription buffers 32, and
    messages over 1 MiB are never delivered.
    """
    return GossipSub(
        [PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=degree,
        degree_low=degree_low,
        degree_high=degree_high,
        heartbeat_interval=heartbeat_s,
        spam_protection_enabled=False,
        eclipse_protection_enabled=False,
    )


def allow_redial(host: IHost, peer_id: ID) -> None:
    """Forget that dialing `peer_id` failed recently, so the next dial really dials.

    After a dial where every address failed, the swarm refuses to dial that peer again for 60 s
    ("negative cache", swarm.py `_NegativePeerCache`, raised as "recently failed all addresses").
    That blocks reconnecting to a peer that restarts within a minute. Shoal keeps its own backoff,
    so it clears the entry before each of its own dials. 0.8.1 has `Swarm.unblock_peer()` (not on
    the INetwork interface); older builds only have the private cache.
    """
    network: Any = host.get_network()
    if hasattr(network, "unblock_peer"):
        network.unblock_peer(peer_id)
    elif hasattr(network, "_negative_peer_cache"):
        network._negative_peer_cache.evict(str(peer_id))


MAX_DIAL_ADDRS = 4
"""Addresses tried per dial attempt (one per interface of the peer; more is unusual)."""


class DialError(Exception):
    """No address of the peer could be dialed; the message lists each address's failure."""


async def dial(host: IHost, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr], timeout_s: float) -> None:
    """Connect to a peer, trying each address in turn, each bounded by `timeout_s`.

    - Dialing a frozen peer (TCP accepts, nothing answers) hangs >100 s: a 30 s negotiation
      timeout times py-libp2p's retries (measured). `trio.fail_after` is the only reliable bound.
    - `Swarm.dial_peer` dials at most ONE TCP address per attempt (swarm.py: "Smart Address
      Selection", `MAX_ADDRS_PER_PEER = 2` with at most one per transport class), taken from the
      peerstore, which still holds the addresses of a peer's previous run for 120 s. So we put
      exactly one address in the peerstore per try: a peer that restarted on a new port, or has
      an unreachable interface listed first, is still reached.
    """
    errors: list[str] = []
    for addr in list(addrs)[:MAX_DIAL_ADDRS]:
        allow_redial(host, peer_id)
        host.get_peerstore().clear_addrs(peer_id)
        try:
            with trio.fail_after(timeout_s):
                await host.connect(PeerInfo(peer_id, [addr]))
            return
        except DIAL_ERRORS as exc:
            errors.append(f"{addr}: {exc!r}")
    raise DialError("; ".join(errors) or "no addresses")


def no_internal_retries(host: IHost) -> None:
    """Make one dial one attempt; Mesh retries with its own backoff.

    The swarm retries every address 3 more times with 0.1/0.2/0.4 s pauses (`RetryConfig`), so a
    dial of a stopped peer takes ~0.7 s instead of ~1 ms and logs four errors. `new_host()` has no
    parameter for it; the swarm reads `retry_config` at each dial.
    """
    network: Any = host.get_network()
    network.retry_config = RetryConfig(max_retries=0)


def disable_auto_connector(host: IHost) -> None:
    """Stop the swarm from dialing peers on its own; Mesh alone decides whom to (re)dial.

    The swarm's AutoConnector (network/auto_connector.py) wakes every 30 s and on every
    disconnect, and while below `low_watermark` (default 100 connections: always, for a cluster)
    dials up to 16-32 peers from the peerstore: refused peers, a restarted peer's dead address,
    racing our own dial with its own backoff. `maybe_connect` is its only dialing entry point.
    """

    async def never() -> None:
        await trio.lowlevel.checkpoint()

    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is not None:
        connector.maybe_connect = never


def route_libp2p_logging() -> None:
    """Send py-libp2p's warnings to our log (as `shoal.libp2p`), minus known-harmless noise.

    `import libp2p` calls its own `setup_logging()`: the `libp2p` logger gets level WARNING, no
    handlers and `propagate=False`, so its warnings vanish unless LIBP2P_DEBUG is set (then it logs
    to stderr and a temp file itself, and we leave it alone). A logger's filters do not see its
    children's records, so the filtering happens in a forwarding handler on `libp2p`.
    """
    if os.environ.get("LIBP2P_DEBUG"):
        return
    logger = logging.getLogger("libp2p")
    logger.setLevel(logging.WARNING)
    # Some modules set their own level: auto_connector.py does `setLevel(logging.INFO)` and then
    # logs two INFO lines per cycle ("initiating 200 new dials").
    for name, child in list(logging.root.manager.loggerDict.items()):
        is_chatty = isinstance(child, logging.Logger) and logging.NOTSET < child.level < logging.WARNING
        if name.startswith("libp2p.") and is_chatty:
            logging.getLogger(name).setLevel(logging.WARNING)
    if not any(isinstance(h, _ForwardLibp2p) for h in logger.handlers):
        logger.addHandler(_ForwardLibp2p())


class _ForwardLibp2p(logging.Handler):
    """Forwards py-libp2p records to `shoal.libp2p`, dropping those logged for normal events.

    Logged at ERROR by py-libp2p 0.8.1 although nothing is wrong (measured):
    - "Failed to open stream ... /ipfs/id/1.0.0", "Error in handle_incoming ...", "[Multiselect
      client] handshake read failed": a connection closed right after opening (shutdown, a refused
      peer), so the identify or pubsub stream it was negotiating lost its connection (the caller
      of that stream gets an exception and handles it);
    - "Failed to open TCP stream": every dial of a peer that is down, while we redial it.
    """

    NOISE = (
        "/ipfs/id/",
        "Error in handle_incoming",
        "handshake read failed",
        "MultiselectClient handshake",
        "Failed to open TCP stream",
    )

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not any(noise in message for noise in self.NOISE):
            logging.getLogger("shoal.libp2p").handle(record)


PeerGate = Callable[[ID], Awaitable[bool]]
"""Waits (bounded) until a peer's authentication is decided; True if it may talk to us."""


def gate_pubsub(host: IHost, pubsub: Pubsub, allowed: PeerGate) -> None:
    """Make pubsub talk only to peers `allowed` admits, in both directions.

    Pubsub opens its stream to every newly connected peer (`Pubsub._handle_new_peer`, fed by its
    network notifee and by its own retry paths) and accepts pubsub streams from any peer; it offers
    no allow-list hook (`blacklisted_peers` is the opposite and is not decided in time). So:
    - outbound: the instance's `_handle_new_peer` first awaits `allowed(peer)`; a plain return is
      what its retry loop treats as "done", so a refused peer is never retried;
    - inbound: the protocol handlers are replaced by one that awaits `allowed(peer)` and resets
      the stream when refused.
    Mesh also installs a topic validator (public API) that drops anything forwarded by a peer that
    is not authenticated: defense in depth if py-libp2p ever opens a stream through another path.
    """
    original_new_peer = pubsub._handle_new_peer
    original_handler = pubsub.stream_handler

    async def new_peer(peer_id: ID) -> None:
        if await allowed(peer_id):
            await original_new_peer(peer_id)

    async def stream_handler(stream: INetStream) -> None:
        if await allowed(stream.muxed_conn.peer_id):
            await original_handler(stream)
        else:
            await reset_quietly(stream)

    pubsub._handle_new_peer = new_peer  # type: ignore[method-assign]
    for protocol in pubsub.router.get_protocols():
        host.set_stream_handler(protocol, stream_handler)


async def reset_quietly(stream: INetStream) -> None:
    """Reset a stream that may already be dead (a reset of a dead stream raises)."""
    with contextlib.suppress(*TRANSPORT_ERRORS):
        await stream.reset()


async def close_quietly(stream: INetStream) -> None:
    with contextlib.suppress(*TRANSPORT_ERRORS):
        await stream.close()


FRAME_WRITE_TIMEOUT_S = 10.0
"""One yamux frame (<= 64 KiB) that cannot reach the socket in this long: the connection is dead."""


def shield_frame_writes() -> None:
    """Make a cancelled stream write unable to kill the whole connection (py-libp2p 0.8.1).

    Measured: a write cancelled at the wrong moment breaks the connection for every stream on
    it. `Yamux._write_frame` takes the connection's write lock, then Noise encrypts the frame
    (advancing the nonce) and only then awaits the socket; cancelled in between, the frame is
    never sent, the peer's next decryption fails ("Failed authentication of message") and it
    drops the connection, while our side still counts it as connected until the ping monitor
    notices. Cancelling a channel's read (its yamux window update) or send, a request's timeout,
    closing a stream from a cancelled scope: each could do it. So once the lock is held the write
    is shielded, bounded by FRAME_WRITE_TIMEOUT_S (a frame that slow means a dead connection:
    then it raises, as a closed connection would). Waiting for the lock stays cancellable.
    Process-wide and idempotent.
    """
    if getattr(Yamux._write_frame, "_shoal_shielded", False):
        return

    async def write_frame(self: Yamux, data: bytes) -> None:
        async with self._write_lock:
            with trio.CancelScope(shield=True), trio.move_on_after(FRAME_WRITE_TIMEOUT_S) as timer:
                await self.secured_conn.write(data)
            if timer.cancelled_caught:
                raise ConnectionClosedError(f"a yamux frame write took over {FRAME_WRITE_TIMEOUT_S:.0f} s")
        await trio.lowlevel.checkpoint()

    write_frame._shoal_shielded = True  # type: ignore[attr-defined]
    Yamux._write_frame = write_frame  # type: ignore[method-assign]
