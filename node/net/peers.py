"""Who is connected and admitted: a sans-I/O book the Mesh drives from libp2p's notifications.

A peer is *authenticated* from the first successful challenge-response (either direction) until
its last connection closes; the I/O shell never delivers anything from a peer that is not. A peer
that fails is *refused* until `now + refuse_s`: its connections are closed on sight.

Connections are counted per peer because simultaneous dials can leave two. An *epoch* numbers
each stretch of connectedness (a fresh one each time the count leaves 0; 0 while disconnected),
so the outcome of a handshake that ran on a connection which has since died cannot leak into a
later one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Opened(enum.Enum):
    REFUSE = "refuse"
    """The peer is refused: close the connection."""
    AUTHENTICATE = "authenticate"
    """Start a handshake as initiator (the book now counts one as running)."""
    NOTHING = "nothing"
    """Already authenticated, or a handshake is already running."""


@dataclass
class _Peer:
    connections: int = 0
    epoch: int = 0
    authenticated: bool = False
    authenticating: bool = False
    refused_until: float = -math.inf


class PeerBook:
    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self._epochs = 0

    def _get(self, peer_id: str) -> _Peer:
        return self._peers.setdefault(peer_id, _Peer())

    # --- queries -------------------------------------------------------------------------------
    def is_authenticated(self, peer_id: str) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.authenticated

    def is_refused(self, peer_id: str, now: float) -> bool:
        peer = self._peers.get(peer_id)
        return peer is not None and peer.refused_until > now

    def refused_until(self, peer_id: str) -> float:
        peer = self._peers.get(peer_id)
        return -math.inf if peer is None else peer.refused_until

    def epoch(self, peer_id: str) -> int:
        return self._get(peer_id).epoch

    def connections(self, peer_id: str) -> int:
        peer = self._peers.get(peer_id)
        return 0 if peer is None else peer.connections

    def authenticated_peers(self) -> frozenset[str]:
        return frozenset(pid for pid, peer in self._peers.items() if peer.authenticated)

    # --- transitions ---------------------------------------------------------------------------
    def connection_opened(self, peer_id: str, now: float) -> Opened:
        self.forget_expired(now)
        peer = self._get(peer_id)
        if peer.connections == 0:
            self._epochs += 1
            peer.epoch = self._epochs
        peer.connections += 1
        if peer.refused_until > now:
            return Opened.REFUSE
        if peer.authenticated or peer.authenticating:
            return Opened.NOTHING
        peer.authenticating = True
        return Opened.AUTHENTICATE

    def connection_closed(self, peer_id: str) -> bool:
        """True when this closed an authenticated peer's last connection (it is now down)."""
        peer = self._get(peer_id)
        peer.connections = max(0, peer.connections - 1)
        if peer.connections > 0:
            return False
        was_up = peer.authenticated
        peer.authenticated = peer.authenticating = False
        peer.epoch = 0  # no stretch of connectedness: every handshake outcome is now stale
        if peer.refused_until == -math.inf:
            del self._peers[peer_id]  # nothing worth remembering
        return was_up

    def auth_succeeded(self, peer_id: str, epoch: int) -> bool:
        """True when the peer just became authenticated (announce it as up)."""
        peer = self._get(peer_id)
        if peer.epoch != epoch or peer.connections == 0 or peer.authenticated:
            return False  # stale, gone, or the other direction's handshake got there first
        peer.authenticated, peer.authenticating = True, False
        return True

    def auth_failed(self, peer_id: str, epoch: int, now: float, refuse_s: float, *, proven: bool) -> bool:
        """Record a failed handshake; True when the peer is now refused (close its connections).

        `proven`: the peer answered with a wrong proof or broke the protocol, as opposed to a
        timeout or a dead stream. A proven failure always refuses; otherwise only a peer that is
        still connected in the same epoch and not authenticated by the other direction is refused.
        """
        peer = self._get(peer_id)
        if peer.refused_until > now:
            return False  # already refused; its connections are being closed
        if not proven and (peer.epoch != epoch or peer.connections == 0 or peer.authenticated):
            if peer.epoch == epoch:
                peer.authenticating = False
            return False
        peer.authenticated = peer.authenticating = False
        peer.refused_until = now + refuse_s
        return True

    def forget_expired(self, now: float) -> None:
        """Drop peers with no connection whose refusal has ended (or who never had one).

        A refused peer is remembered after its last connection closes, so that it stays refused
        when it dials again; once the refusal has run out there is nothing left to remember.
        Every `connection_opened` calls this, so the book holds the connected peers and those
        refused in the last `refuse_s`, however many peer ids ever tried (one pass over a book
        that small costs less than the handshake the connection starts).
        """
        for pid in [
            p for p, peer in self._peers.items() if peer.connections == 0 and peer.refused_until <= now
        ]:
            del self._peers[pid]
