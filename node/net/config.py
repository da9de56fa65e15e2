"""Every setting of the mesh in one place, each default with its reason (memberlist style).

`add_mesh_arguments()` and `mesh_config_from_args()` give `shoal run` its flags:
`--cluster NAME`, `--cluster-secret S` / `--cluster-secret-file F` / env `SHOAL_CLUSTER_SECRET`,
`--peer MULTIADDR` (repeatable), `--p2p-host`, `--p2p-port`, `--no-mdns`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CLUSTER = "shoal"
SECRET_ENV = "SHOAL_CLUSTER_SECRET"
MAX_SECRET_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class MeshConfig:
    data_dir: Path
    """Holds `identity.key`: the node's peer id survives restarts."""

    # --- who we talk to ------------------------------------------------------------------------
    cluster: str = DEFAULT_CLUSTER
    """Nodes only join peers of the same cluster name: mDNS ignores other names, auth fails across."""
    secret: bytes | None = None
    """The cluster secret. None derives the auth key from the cluster name alone: zero-config works,
    but then anyone who knows the name can join. The secret is what provides protection."""
    bootstrap_peers: tuple[str, ...] = ()
    """`/ip4/<ip>/tcp/<port>/p2p/<peer id>` addresses dialed at start and re-dialed while disconnected."""
    mdns: bool = True
    """Announce and browse `_shoal._tcp.local.` on the interfaces we listen on."""

    # --- where we listen ------------------------------------------------------------------------
    listen_host: str = "0.0.0.0"
    """All IPv4 interfaces; we advertise each concrete interface address, never 0.0.0.0."""
    p2p_port: int = 0
    """0 = any free port (announced by mDNS and logged); fix it when peers use `--peer`."""
    advertise_ips: tuple[str, ...] = ()
    """Empty = every non-loopback IPv4 of this machine (loopback only when there is nothing else or
    when `listen_host` is loopback). Set it when some interfaces must not be announced."""

    # --- timing ------------------------------------------------------------------------------------
    dial_timeout_s: float = 5.0
    """One dial attempt. py-libp2p can hang >100 s dialing a frozen peer; a LAN dial takes ~10-20 ms."""
    auth_timeout_s: float = 5.0
    """A new peer must finish the challenge-response within this (loopback: a few ms)."""
    refuse_s: float = 30.0
    """A peer that failed auth with a wrong proof is disconnected and refused this long."""
    unanswered_refuse_s: float = 2.0
    """A peer whose handshake got no answer in time (busy, restarting) is disconnected and refused
    only this long: long enough to stop a tight loop, short enough that a redial soon admits it."""
    redial_min_s: float = 0.5
    redial_max_s: float = 10.0
    """Backoff between dials of a known but disconnected peer: doubles from min to max, +-20% jitter;
    a restarted peer is back within about `redial_max_s`."""
    mdns_dial_delay_s: float = 1.0
    """After an mDNS discovery the lower peer id dials at once, the higher one only if still not
    connected after this, so two nodes that find each other don't both dial (two connections)."""
    request_timeout_s: float = 10.0
    """A whole request/response (open stream, send, handler, answer); servers use it per request too."""
    channel_open_timeout_s: float = 5.0
    """Opening a channel (new stream + protocol negotiation: ~1-3 ms on a LAN). A frozen peer never
    answers the negotiation; callers that must answer sooner wrap `open_channel` tighter."""

    # --- sizes ---------------------------------------------------------------------------------
    max_gossip_bytes: int = 256 * 1024
    """Gossip is for small deltas; GossipSub silently drops messages over 1 MiB. Larger raises."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Cap on a request or response frame (a full state sync); a larger announced length is dropped."""
    max_concurrent_requests: int = 64
    """Inbound requests handled at once; more wait (within their timeout)."""
    max_inbound_channels: int = 256
    """Inbound channels open at once (e.g. generations served for other nodes); more are reset at
    once, so their requesters fail fast instead of waiting. 200 streams to one peer measured fine."""
    gossip_buffer: int = 1024
    """Inbound gossip queued for the layer above; when full, new messages are dropped and counted
    (the state above converges by merge and anti-entropy, so a lost message costs nothing)."""
    event_buffer: int = 1024
    """Peer up/down events queued for the layer above; when full they are dropped, counted, logged."""

    # --- GossipSub -----------------------------------------------------------------------------
    gossip_degree: int = 3
    gossip_degree_low: int = 2
    gossip_degree_high: int = 5
    """Mesh degree D (and bounds): each message reaches D peers directly, the rest within ~log_D(N)
    hops; small because clusters are small (a few to a few dozen machines)."""
    gossip_heartbeat_s: int = 1
    """Mesh maintenance period (py-libp2p takes whole seconds): a new peer joins the mesh within ~1 s."""

    # --- connection health (py-libp2p's ping monitor) ---------------------------------------------
    health_check_interval_s: float = 2.0
    ping_timeout_s: float = 5.0
    """A silently vanished peer (frozen, cut link) is dropped after ~interval + timeout (~7 s);
    without the monitor py-libp2p never notices it. py-libp2p closes the connection on the first
    ping that times out, and a node starting up on a busy 2-core machine (runners loading) has
    answered pings 1-2 s late: with 1 s the connection flapped, the closed connection made the
    member dead 1.5 s later (`lost_dead_after_s`), and the leader re-placed its instances. The
    failure detector judges a frozen peer by heartbeat silence (`dead_after_s`) anyway, so the longer ping
    timeout only delays dropping a dead connection, not declaring its node dead."""


def derive_secret(
    flag: str | None, secret_file: Path | None, *, env: str = SECRET_ENV, what: str = "cluster secret"
) -> bytes | None:
    """A secret (the cluster's, or the API key) from the flag, else the file, else `$env`, else None.

    A file's secret is its content without surrounding whitespace (a trailing newline is usual).
    """
    if flag:
        return flag.encode()
    if secret_file is not None:
        data = secret_file.read_bytes()[: MAX_SECRET_FILE_BYTES + 1]
        if len(data) > MAX_SECRET_FILE_BYTES:
            raise ValueError(f"{secret_file}: a {what} file must be under 64 KiB")
        secret = data.strip()
        if not secret:
            raise ValueError(f"{secret_file} is empty")
        return secret
    value = os.environ.get(env)
    return value.encode() if value else None


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--cluster", default=DEFAULT_CLUSTER, help="cluster name: only nodes with the same name join"
    )
    group.add_argument(
        "--cluster-secret",
        default=None,
        help=f"shared secret that admits nodes (default ${SECRET_ENV}; none = anyone with the name)",
    )
    group.add_argument("--cluster-secret-file", type=Path, default=None, help="read the secret from a file")
    group.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="bootstrap peer /ip4/IP/tcp/PORT/p2p/PEERID (repeatable)",
    )
    group.add_argument("--p2p-host", default=MeshConfig.listen_host, help="address the p2p port binds")
    group.add_argument("--p2p-port", type=int, default=MeshConfig.p2p_port, help="p2p port, 0 = any free")
    group.add_argument("--no-mdns", action="store_true", help="don't discover peers on the local network")


def mesh_config_from_args(args: argparse.Namespace, data_dir: Path) -> MeshConfig:
    """Raises ValueError with a message for the user when a flag is unusable."""
    from node.net.host import parse_peer_multiaddr

    for peer in args.peer:
        parse_peer_multiaddr(peer)
    if not 0 <= args.p2p_port <= 65535:
        raise ValueError(f"--p2p-port must be between 0 and 65535, got {args.p2p_port}")
    return MeshConfig(
        data_dir=data_dir,
        cluster=args.cluster,
        secret=derive_secret(args.cluster_secret, args.cluster_secret_file),
        bootstrap_peers=tuple(args.peer),
        mdns=not args.no_mdns,
        listen_host=args.p2p_host,
        p2p_port=args.p2p_port,
    )
