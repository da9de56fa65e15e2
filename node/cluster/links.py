"""Round trips from this node to its live peers, for "auto" sharding (`protocol.auto_sharding`).

A round trip here is the time a TCP connect to the peer's HTTP port takes: the SYN and its answer
are handled by the kernels at both ends, so it is the network's round trip plus one system call,
close to what a tensor-parallel exchange pays per hop (its sockets are plain TCP too), and it costs
the peer nothing (no request is sent). A peer is measured as soon as it is seen alive, then every
`PROBE_EVERY_S`; the lowest of its last rounds is published in this node's profile (`links`),
rounded so that jitter rewrites it seldom.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import trio

from protocol.cluster_records import RoundTrip
from protocol.ids import NodeId
from protocol.record_limits import MAX_LINKS

log = logging.getLogger("shoal.cluster")

PROBE_EVERY_S = 30.0
"""How often every live peer is measured again: a LAN's round trip moves on the scale of minutes (a
laptop changing from cable to Wi-Fi), and a placement reads the latest."""
NEW_PEER_CHECK_S = 1.0
"""How often the probe looks for peers it has not measured yet: a node that joined is measured
within a second or two, before a placement that might use it."""
CONNECTS_PER_ROUND = 5
"""Connects per peer per round; the lowest counts (scheduling only ever adds to a connect)."""
KEEP_ROUNDS = 4
"""Rounds a peer's figure is the lowest of: one round on a busy core does not move it."""
CONNECT_TIMEOUT_S = 1.0
"""A connect slower than this is no LAN: the peer is left unmeasured (placement then assumes the
worst for it)."""


def connect_round_trip(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> float | None:
    """Seconds the fastest of `CONNECTS_PER_ROUND` TCP connects to host:port took; None if any
    failed. Blocking: run it in a thread."""
    best = math.inf
    for _ in range(CONNECTS_PER_ROUND):
        start = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                best = min(best, time.perf_counter() - start)
        except OSError:
            return None
    return best


def rounded_us(seconds: float) -> int:
    """Microseconds to two significant figures (21, 230, 1200): a profile is rewritten on change."""
    us = max(1, round(seconds * 1e6))
    step = 10 ** max(0, len(str(us)) - 2)
    return max(1, round(us / step) * step)


def _address(api_url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(api_url)
        port = parts.port
    except ValueError:
        return None
    if parts.hostname is None or port is None:
        return None
    return parts.hostname, port


class LinkProbe:
    """Measures the round trip to each peer `peers()` names (node id -> its API URL)."""

    def __init__(self, peers: Callable[[], Mapping[NodeId, str]]) -> None:
        self._peers = peers
        self._rounds: dict[NodeId, deque[float]] = {}

    def links(self) -> tuple[RoundTrip, ...]:
        """The round trips of the live peers measured, for this node's profile."""
        live = self._peers()
        trips = [
            RoundTrip(node, rounded_us(min(rounds)))
            for node, rounds in self._rounds.items()
            if rounds and node in live
        ]
        return tuple(sorted(trips))[:MAX_LINKS]

    async def run(self) -> None:
        last_full = -math.inf
        while True:
            peers = dict(self._peers())
            for gone in set(self._rounds) - set(peers):
                del self._rounds[gone]
            full = trio.current_time() - last_full >= PROBE_EVERY_S
            if full:
                last_full = trio.current_time()
            for node, url in sorted(peers.items())[:MAX_LINKS]:
                if full or node not in self._rounds:
                    await self._probe(node, url)
            await trio.sleep(NEW_PEER_CHECK_S)

    async def _probe(self, node: NodeId, url: str) -> None:
        rounds = self._rounds.setdefault(node, deque(maxlen=KEEP_ROUNDS))
        address = _address(url)
        if address is None:
            return
        seconds = await trio.to_thread.run_sync(connect_round_trip, *address)
        if seconds is None:
            log.debug("no round trip to %s (%s)", node, url)
            return
        rounds.append(seconds)
