"""Who may download model files: a request signed with the cluster key, checked by the server.

The HTTP API is open to anyone on the network, so each file request carries three headers:

    x-shoal-node:  the requester's node id (its libp2p peer id)
    x-shoal-time:  the requester's clock, whole Unix seconds
    x-shoal-mac:   hex HMAC-SHA256(cluster key, LABEL | method | path | time | node id)

keyed by `node.net.auth.derive_key(cluster, secret)`, the key that admits nodes to the mesh. The
server recomputes the MAC and accepts only a fresh one (`MAX_SKEW_S`). What this does not do: it
encrypts nothing, and a captured request can be replayed within the window, which only gets the
same file again (anyone who can capture it can read the file in transit anyway).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Collection, Mapping
from typing import Literal

NODE_HEADER = "x-shoal-node"
TIME_HEADER = "x-shoal-time"
MAC_HEADER = "x-shoal-mac"
LABEL = b"shoal/files/1"
MAX_SKEW_S = 300
"""Accepted clock difference in seconds either way: Kerberos's default, for machines whose clocks
are set by NTP but not perfectly; a request older than this is refused as stale."""
MAX_NODE_ID_CHARS = 128

Verdict = Literal["ok", "unauthenticated", "forbidden"]
"""`api.files.AuthVerdict`: no (or malformed) credentials -> 401; wrong, stale or not a member -> 403."""


def request_mac(key: bytes, method: str, path: str, timestamp: int, node_id: str) -> str:
    fields = (LABEL, method.upper().encode(), path.encode(), str(timestamp).encode(), node_id.encode())
    message = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, node_id: str, now: float) -> dict[str, str]:
    """The headers that let a request for `path` (the URL path, not percent-encoded) through."""
    timestamp = int(now)
    return {
        NODE_HEADER: node_id,
        TIME_HEADER: str(timestamp),
        MAC_HEADER: request_mac(key, method, path, timestamp, node_id),
    }


class RequestChecker:
    """The server side: `check(headers, method, path)` for each request (sync: one HMAC).

    `members`, when given, returns the node ids allowed now (e.g. the cluster's live members); a
    requester outside it is refused even with a good MAC.
    """

    def __init__(
        self,
        key: bytes,
        *,
        clock: Callable[[], float],
        max_skew_s: float = MAX_SKEW_S,
        members: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self._key = key
        self._clock = clock
        self._max_skew_s = max_skew_s
        self._members = members

    def check(self, headers: Mapping[str, str], method: str, path: str) -> Verdict:
        node_id, stamp, mac = (headers.get(h) for h in (NODE_HEADER, TIME_HEADER, MAC_HEADER))
        if not node_id or not stamp or not mac or len(node_id) > MAX_NODE_ID_CHARS:
            return "unauthenticated"
        if not stamp.isascii() or not stamp.isdigit() or len(stamp) > 12 or not mac.isascii():
            return "unauthenticated"
        timestamp = int(stamp)
        expected = request_mac(self._key, method, path, timestamp, node_id)
        if not hmac.compare_digest(expected, mac.lower()):
            return "forbidden"
        if abs(self._clock() - timestamp) > self._max_skew_s:
            return "forbidden"
        if self._members is not None and node_id not in self._members():
            return "forbidden"
        return "ok"
