"""An emulated LAN for tests and benchmarks: network namespaces joined by a bridge (needs root).

    with emulated_lan(2) as lan:                      # 1 Gbit/s, 0.1 ms each way by default
        node = start_node(*lan.node_args(0), data_dir=..., model=None, netns=lan.namespaces[0],
                          prefix=lan.pinned(0))
        lan.run_in(0, [...])                          # a command inside node 0's namespace

Each node gets a namespace of its own (`<tag>n<i>`, address 10.<a>.<b>.<i + 1>/24) with a veth
whose other end hangs on a bridge in a switch namespace (`<tag>sw`); multicast is routed onto it,
so mDNS works between the nodes and never reaches the machine's real interfaces. Each node's
egress gets the link's rate (tc `tbf`) and delay (tc `netem`), so every packet between two nodes
passes one of each. Kernels built without netem (the Firecracker VMs these tests run on) get the
rate only: `delay_emulated` says which, and callers report it. `pinned(i)` runs a node on CPU
core i (modulo the cores there are). Everything is deleted on exit, also after a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

RATE = "1gbit"
"""A home LAN's wired link."""
DELAY_MS = 0.1
"""One way, per link: what a switched gigabit LAN adds (ping ~0.2-0.3 ms)."""


class LanUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip netns`)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Lan:
    tag: str
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    rate: str = RATE
    delay_ms: float = DELAY_MS
    delay_emulated: bool = False

    def node_args(self, index: int) -> list[str]:
        """`shoal run` flags that put node `index`'s API and p2p on its LAN address (mDNS on)."""
        ip = self.addresses[index]
        return ["--api-host", ip, "--p2p-host", ip]

    def pinned(self, index: int) -> list[str]:
        """A command prefix running node `index` on a core of its own (wrapping as needed)."""
        cores = sorted(os.sched_getaffinity(0))
        return ["taskset", "-c", str(cores[index % len(cores)])]

    def run_in(
        self, index: int, command: Sequence[str], timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` inside node `index`'s namespace (its API is reachable only from there)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespaces[index], *command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )

    def request(self, index: int, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """An HTTP request made from inside node `index`'s namespace; the JSON answer (raises on an
        error status, with its body)."""
        code = (
            "import json, sys, httpx\n"
            "r = httpx.request(sys.argv[1], sys.argv[2], json=json.loads(sys.argv[3]), timeout=300)\n"
            "print(r.text) if r.is_success else sys.exit(f'{r.status_code} {r.text}')"
        )
        done = self.run_in(index, [sys.executable, "-c", code, method, url, json.dumps(body)])
        return json.loads(done.stdout)

    def describe(self) -> str:
        delay = f"{self.delay_ms} ms each way" if self.delay_emulated else "no added delay (no netem here)"
        return f"emulated LAN: {len(self.namespaces)} nodes, {self.rate} per link, {delay}"


def _shape(ns: str, dev: str, rate: str, delay_ms: float) -> bool:
    """Rate and delay on `dev`'s egress; False when the kernel has no netem (rate only then)."""
    add = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"]
    try:
        subprocess.run(
            [*add, "netem", "delay", f"{delay_ms}ms", "rate", rate], check=True, capture_output=True
        )
        return True
    except subprocess.CalledProcessError:
        # tbf's burst must hold one timer tick of traffic at the rate: 1 Gbit/s at HZ 1000 is 125 KB.
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "20ms"]
        subprocess.run([*add, *tbf], check=True, capture_output=True, timeout=10)
        return False


@contextmanager
def emulated_lan(count: int, *, rate: str = RATE, delay_ms: float = DELAY_MS) -> Iterator[Lan]:
    """`count` node namespaces on one emulated switch; `LanUnavailable` where none can be made."""
    if os.geteuid() != 0:
        raise LanUnavailable("network namespaces need root")
    tag = f"sl{os.getpid() % 100000}"
    switch = f"{tag}sw"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    lan = Lan(tag, rate=rate, delay_ms=delay_ms)
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", switch)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LanUnavailable(
                f"`ip netns add` is not available here: {getattr(exc, 'stderr', '') or exc}"
            ) from exc
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(count):
            ns, ip, here, there = f"{tag}n{i}", f"{subnet}.{i + 1}", f"{tag}a{i}", f"{tag}b{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", here, "netns", ns)
            _ip("link", "set", there, "netns", switch)
            _ip("-n", switch, "link", "set", there, "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", here)
            _ip("-n", ns, "link", "set", here, "up", "multicast", "on")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", here)
            lan.delay_emulated = _shape(ns, here, rate, delay_ms)
            lan.namespaces.append(ns)
            lan.addresses.append(ip)
        yield lan
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its ends of the veth pairs too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
