"""Staying connected: the peers a mesh keeps dialing while they are disconnected, one loop each.

A peer is known from a bootstrap address, `Mesh.add_peer` or an mDNS announcement. While it has no
connection its loop dials all its addresses, at most once per backoff period (doubling from
`redial_min_s` to `redial_max_s`, jittered, reset once it is admitted again), never while admission
refuses it, and wakes early when the peer connects to us. An mDNS peer that is no longer announced
is forgotten; a bootstrap or added one never is.
"""

from __future__ import annotations

import logging
import random

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.net import quirks
from node.net.admission import Admission
from node.net.config import MeshConfig
from node.net.discovery import Announcement
from node.net.events import MeshStats
from node.net.host import parse_peer_multiaddr

log = logging.getLogger("shoal.net")


class Redialer:
    def __init__(
        self, *, host: IHost, admission: Admission, config: MeshConfig, stats: MeshStats, my_id: str
    ) -> None:
        self.host, self.admission, self.config, self.stats, self.my_id = host, admission, config, stats, my_id
        self.known: dict[str, list[str]] = {}
        """Peer id -> multiaddrs (with /p2p) we keep dialing while it is disconnected."""
        self._bootstrap: set[str] = set()
        self._dialers: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery | None) -> None:
        """Where the dial loops run; before this, peers are only remembered."""
        self._nursery = nursery

    def add(self, peer_multiaddr: str) -> None:
        """Keep dialing a peer (`/ip4/.../tcp/.../p2p/ID`) whenever it is disconnected; never forget it."""
        peer_id = parse_peer_multiaddr(peer_multiaddr).peer_id.to_base58()
        self._bootstrap.add(peer_id)
        if peer_multiaddr not in self.known.setdefault(peer_id, []):
            self.known[peer_id].append(peer_multiaddr)
        self.ensure(peer_id, delay=0.0)

    def dial_all(self) -> None:
        """Start a loop for every known peer (those added before the mesh ran)."""
        for peer_id in self.known:
            self.ensure(peer_id, delay=0.0)

    def ensure(self, peer_id: str, delay: float) -> None:
        if peer_id == self.my_id or peer_id in self._dialers or self._nursery is None:
            return
        scope = trio.CancelScope()
        self._dialers[peer_id] = scope
        self._nursery.start_soon(self._keep_connected, peer_id, scope, delay)

    async def _keep_connected(self, peer_id: str, scope: trio.CancelScope, delay: float) -> None:
        """Dial `peer_id` whenever it is disconnected, at most once per backoff period."""
        config, peer, book = self.config, ID.from_base58(peer_id), self.admission.book
        backoff, next_dial = config.redial_min_s, trio.current_time() + delay
        try:
            with scope:
                while addrs := self.known.get(peer_id):
                    now = trio.current_time()
                    if book.connections(peer_id) > 0:
                        if book.is_authenticated(peer_id):
                            backoff = config.redial_min_s
                        await self.admission.changed.wait()
                        continue
                    wait_until = max(next_dial, book.refused_until(peer_id))
                    if wait_until > now:
                        with trio.move_on_at(wait_until):
                            await self.admission.changed.wait()  # also wakes when it connects to us
                        continue
                    next_dial = now + backoff * random.uniform(0.8, 1.2)
                    backoff = min(backoff * 2, config.redial_max_s)
                    try:
                        await quirks.dial(
                            self.host, peer, [multiaddr.Multiaddr(a) for a in addrs], config.dial_timeout_s
                        )
                    except quirks.DialError as exc:
                        self.stats.dial_failures += 1
                        log.debug("dialing %s failed: %s", peer_id, exc)
        finally:
            if self._dialers.get(peer_id) is scope:
                del self._dialers[peer_id]

    # --- mDNS ----------------------------------------------------------------------------------
    def mdns_found(self, announcement: Announcement) -> None:
        peer_id = announcement.peer_id
        if peer_id not in self._bootstrap:
            self.known[peer_id] = announcement.peer_addrs()
        # The lower id dials at once; the higher waits, so mutual discovery makes one connection.
        self.ensure(peer_id, delay=0.0 if self.my_id < peer_id else self.config.mdns_dial_delay_s)

    def mdns_ignored(self, announcement: Announcement) -> None:
        self.stats.mdns_other_clusters += 1

    def mdns_lost(self, peer_id: str) -> None:
        if peer_id not in self._bootstrap:
            self.known.pop(peer_id, None)
            if (scope := self._dialers.get(peer_id)) is not None:
                scope.cancel()
