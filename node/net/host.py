"""The node's py-libp2p host: TCP + Noise + Yamux, nothing else, on concrete addresses.

- Security is Noise only and muxing Yamux only. py-libp2p's defaults also offer plaintext, SECIO
  and TLS, and fall back to Mplex, whose receive path costs ~38 ms of CPU per MB vs ~6 ms for
  Yamux+Noise (measured).
- It listens on `listen_host` (default 0.0.0.0) but advertises each concrete interface IPv4
  (`/ip4/<ip>/tcp/<port>/p2p/<peer id>`), never 0.0.0.0, which nobody can dial.
- `run()` is a trio service: started means listening, and `task_status.started()` carries the
  dialable multiaddrs. On exit the host is closed (py-libp2p leaks sockets otherwise).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ifaddr
import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from node.net.identity import peer_id_of

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.net")

CLOSE_TIMEOUT_S = 5.0
"""`host.close()` normally takes milliseconds; never let shutdown hang on it."""


class PeerAddrError(ValueError):
    """A peer multiaddr we cannot dial (the message says why)."""


def parse_peer_multiaddr(text: str) -> PeerInfo:
    """`/ip4/<ip>/tcp/<port>/p2p/<peer id>` -> PeerInfo; PeerAddrError if it isn't one."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:  # multiaddr and libp2p raise a variety of types for bad text
        raise PeerAddrError(
            f"{text!r} is not a peer address like /ip4/IP/tcp/PORT/p2p/PEERID: {exc}"
        ) from exc


def local_ipv4s(listen_host: str) -> list[str]:
    """The concrete IPv4s to advertise for `listen_host`.

    A concrete listen address is advertised as is. For 0.0.0.0: every up interface's IPv4 except
    loopback and link-local (169.254/16), or 127.0.0.1 when there is nothing else.
    """
    if listen_host != "0.0.0.0":
        return [listen_host]
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not isinstance(ip.ip, str):
                continue  # IPv6 entries are tuples
            address = ipaddress.IPv4Address(ip.ip)
            if not (address.is_loopback or address.is_link_local or ip.ip in found):
                found.append(ip.ip)
    return found or ["127.0.0.1"]


class P2PHost:
    """One py-libp2p host with a fixed identity. Construct, then `await nursery.start(host.run)`."""

    def __init__(
        self,
        key_pair: KeyPair,
        *,
        connection_config: ConnectionConfig,
        listen_host: str = "0.0.0.0",
        port: int = 0,
        advertise_ips: Sequence[str] = (),
    ) -> None:
        self.peer_id = peer_id_of(key_pair)
        self.id = ID.from_base58(self.peer_id)
        self.listen_host = listen_host
        self.port = port
        self.advertise_ips = list(advertise_ips) or local_ipv4s(listen_host)
        noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
        self.host: IHost = new_host(
            key_pair=key_pair,
            sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            connection_config=connection_config,
            addrs_factory=self._concrete_addrs,
            # Identify's "observed address" would add whatever NAT/loopback address a peer saw.
            disable_identify_address_discovery=True,
        )

    def _concrete_addrs(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """Identify and `get_addrs()` advertise these: listen addrs with 0.0.0.0 made concrete."""
        out: list[multiaddr.Multiaddr] = []
        for addr in candidates:
            ip, port = addr.value_for_protocol("ip4"), addr.value_for_protocol("tcp")
            if ip is None or port is None:
                continue
            ips = self.advertise_ips if ip == "0.0.0.0" else [ip]
            out.extend(multiaddr.Multiaddr(f"/ip4/{concrete}/tcp/{port}") for concrete in ips)
        return out

    def addrs(self) -> list[str]:
        """Dialable multiaddrs with our peer id (empty before `run()` started)."""
        return [str(addr) for addr in self.host.get_addrs()]

    async def run(self, *, task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; started with our dialable multiaddrs. Closes the host on exit."""
        listen = multiaddr.Multiaddr(f"/ip4/{self.listen_host}/tcp/{self.port}")
        try:
            async with self.host.run([listen]):
                bound = self.host.get_transport_addrs()
                if not bound:
                    raise OSError(f"cannot listen on {self.listen_host}:{self.port}")
                self.port = int(bound[0].value_for_protocol("tcp") or 0)
                addrs = self.addrs()
                log.info("p2p node %s listening on %s", self.peer_id, ", ".join(addrs))
                task_status.started(addrs)
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await self.host.close()
