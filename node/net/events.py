"""What the mesh hands upward (gossip, peer events) and what it counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Gossip(NamedTuple):
    peer_id: str
    """The message's origin (it signed it; only authenticated peers relayed it)."""
    data: bytes


class PeerEvent(NamedTuple):
    peer_id: str
    up: bool
    """True: just authenticated (first connection); False: its last connection closed."""


@dataclass
class MeshStats:
    """Counters for logs, /health and tests; remote misbehavior is counted, never raised."""

    auth_succeeded: int = 0
    auth_failed: int = 0
    """Peers refused after a failed handshake (wrong key, broken protocol, silence)."""
    refused_connections: int = 0
    """Connections from refused peers, closed on sight."""
    refused_streams: int = 0
    """Pubsub/sync streams reset because their peer was not (or not yet, in time) authenticated."""
    gossip_delivered: int = 0
    gossip_dropped: int = 0
    """Inbound gossip dropped because the layer above did not keep up (`gossip_buffer` full)."""
    gossip_rejected: int = 0
    """Gossip relayed by an unauthenticated peer, or over `max_gossip_bytes`."""
    requests_served: int = 0
    bad_frames: int = 0
    """Sync streams dropped for broken framing (oversized length, truncated) or stalling."""
    events_dropped: int = 0
    dial_failures: int = 0
    """Dial attempts (all of a peer's addresses) that failed; each is retried after backoff."""
    mdns_other_clusters: int = 0
    """mDNS announcements of other clusters, ignored."""
