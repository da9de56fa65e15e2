"""Find peers of our cluster on the local network with mDNS (python-zeroconf, not libp2p's mDNS).

Each node registers `<peer id>._shoal._tcp.local.` whose TXT records carry its peer id (`id`),
cluster name (`c`) and concrete multiaddrs without the /p2p part (`a0`, `a1`, ...). It browses
the same type and reports every node of its own cluster (never itself) to the layer above;
other clusters' announcements are ignored (and counted).

Why not libp2p's mDNS: it blocks the trio loop ~1.7 s at start, binds every interface and
advertises `/ip4/0.0.0.0/...` when listening on 0.0.0.0 (measured). Here:
- zeroconf binds only the interfaces we listen on (`Zeroconf(interfaces=[...])`);
- its threaded `ServiceBrowser` calls back on its own thread; results reach trio through
  `trio.from_thread.run_sync(..., trio_token=...)`;
- `register_service` probes for ~1.65 s, so it runs in `trio.to_thread.run_sync`, after the
  browser starts: a newcomer finds existing nodes in 0.2-0.5 s, they see it in ~1.2-2 s (measured).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.net.mdns")

SERVICE_TYPE = "_shoal._tcp.local."
MAX_TXT_VALUE = 200
"""A TXT string holds at most 255 bytes (key=value); 200 leaves room for the key."""
MAX_ADDRS = 16
"""Announced/accepted multiaddrs per node (a machine rarely has more than a few interfaces)."""
RESOLVE_TIMEOUT_MS = 2000
"""How long the browser thread waits to resolve a newly seen service's TXT/SRV records."""
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Announcement:
    peer_id: str
    cluster: str
    addrs: tuple[str, ...]
    """Multiaddrs without /p2p (e.g. /ip4/10.0.0.5/tcp/4001)."""

    def peer_addrs(self) -> list[str]:
        return [f"{addr}/p2p/{self.peer_id}" for addr in self.addrs]


def encode_txt(announcement: Announcement) -> dict[str, str]:
    if len(announcement.cluster.encode()) > MAX_TXT_VALUE:
        raise ValueError(f"cluster name longer than {MAX_TXT_VALUE} bytes cannot be announced")
    txt = {"id": announcement.peer_id, "c": announcement.cluster}
    for i, addr in enumerate(announcement.addrs[:MAX_ADDRS]):
        txt[f"a{i}"] = addr
    return txt


def decode_txt(properties: Mapping[bytes, bytes | None]) -> Announcement | None:
    """The announcement in a service's TXT records, or None if it isn't a Shoal node's."""
    try:
        text = {k.decode(): v.decode() for k, v in properties.items() if v is not None}
    except UnicodeDecodeError:
        return None
    peer_id, cluster = text.get("id"), text.get("c")
    if not peer_id or cluster is None:
        return None
    addrs = tuple(
        text[f"a{i}"] for i in range(MAX_ADDRS) if f"a{i}" in text and text[f"a{i}"].startswith("/")
    )
    return Announcement(peer_id=peer_id, cluster=cluster, addrs=addrs)


def _peer_id_from_name(name: str) -> str:
    return name.removesuffix("." + SERVICE_TYPE)


class MdnsDiscovery:
    """Announce ourselves and report same-cluster peers. A trio service: `nursery.start(d.run)`.

    `on_found(announcement)` runs on the trio thread for each new or changed peer; `on_lost(peer
    id)` when its service goes away (it may still be reachable: that only stops using mDNS for it);
    `on_ignored(announcement)` for each announcement of another cluster.
    """

    def __init__(
        self,
        *,
        me: Announcement,
        interfaces: Sequence[str],
        port: int,
        on_found: Callable[[Announcement], None],
        on_lost: Callable[[str], None],
        on_ignored: Callable[[Announcement], None] | None = None,
    ) -> None:
        self.me = me
        self.interfaces = list(interfaces)
        self.port = port
        self.on_found = on_found
        self.on_lost = on_lost
        self.on_ignored = on_ignored
        self._token: trio.lowlevel.TrioToken | None = None
        self._txt = encode_txt(me)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Browse, then register; started once browsing. Unregisters and closes on exit."""
        self._token = trio.lowlevel.current_trio_token()
        zc = await trio.to_thread.run_sync(self._open)
        browser: ServiceBrowser | None = None
        try:
            browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[self._on_change])
            task_status.started()
            info = ServiceInfo(
                SERVICE_TYPE,
                f"{self.me.peer_id}.{SERVICE_TYPE}",
                parsed_addresses=self.interfaces,
                port=self.port,
                properties=self._txt,
            )
            await trio.to_thread.run_sync(zc.register_service, info)
            log.info("mDNS: announcing %s on %s", self.me.peer_id, ", ".join(self.interfaces))
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await trio.to_thread.run_sync(self._close, zc, browser)

    def _open(self) -> Zeroconf:
        return Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)

    @staticmethod
    def _close(zc: Zeroconf, browser: ServiceBrowser | None) -> None:
        if browser is not None:
            browser.cancel()
        zc.unregister_all_services()
        zc.close()

    # --- the browser thread ---------------------------------------------------------------------
    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        try:
            if state_change is ServiceStateChange.Removed:
                self._to_trio(self._lost, _peer_id_from_name(name))
                return
            info = zeroconf.get_service_info(service_type, name, timeout=RESOLVE_TIMEOUT_MS)
            if info is not None and (announcement := decode_txt(info.properties)) is not None:
                self._to_trio(self._found, announcement)
        except Exception:  # a thread boundary: log, never kill the browser thread
            log.exception("mDNS: handling %s for %s failed", state_change, name)

    def _to_trio(self, fn: Callable[[Announcement], None] | Callable[[str], None], arg: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the node is shutting down
            trio.from_thread.run_sync(fn, arg, trio_token=self._token)

    # --- back on the trio thread ----------------------------------------------------------------
    def _found(self, announcement: Announcement) -> None:
        if announcement.peer_id == self.me.peer_id:
            return
        if announcement.cluster != self.me.cluster:
            if self.on_ignored is not None:
                self.on_ignored(announcement)
            log.debug("mDNS: ignoring %s of cluster %r", announcement.peer_id, announcement.cluster)
            return
        self.on_found(announcement)

    def _lost(self, peer_id: str) -> None:
        if peer_id != self.me.peer_id:
            self.on_lost(peer_id)
