"""Real mDNS discovery between two network namespaces joined by a veth pair (needs root).

The test makes its own namespaces (`shoal<pid>a`/`b`, addresses 10.231.<n>.1 and .2/24) and
deletes them in `finally`; multicast never touches the machine's real interfaces. Each namespace
runs `tests/mdns_probe.py` (a Mesh with mDNS on and no bootstrap peer). A third probe in the first
namespace belongs to another cluster: it must be ignored, and must not join either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.nodes import agreed_leader, start_node
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces joined by veth; yields (ns_a, ip_a, ns_b, ip_b)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = f"shoal{os.getpid() % 100000}"
    ns_a, ns_b = f"{tag}a", f"{tag}b"
    subnet = f"10.231.{os.getpid() % 250}"
    ip_a, ip_b = f"{subnet}.1", f"{subnet}.2"
    try:
        _ip("netns", "add", ns_a)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"`ip netns add` is not available here: {detail}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for ns, dev, ip in ((ns_a, f"{tag}va", ip_a), (ns_b, f"{tag}vb", ip_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up", "multicast", "on")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield ns_a, ip_a, ns_b, ip_b
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _probe(ns: str, listen: str, data_dir: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.mdns_probe"]
    cmd += ["--data-dir", str(data_dir), "--listen", listen, "--timeout", "30", *extra]
    return subprocess.Popen(
        cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the probe bounds itself (--timeout) and then prints
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"probe printed nothing:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(line)
    return result


def test_two_namespaces_discover_each_other(namespaces: tuple[str, str, str, str], tmp_path: Path) -> None:
    ns_a, ip_a, ns_b, ip_b = namespaces
    procs = [
        _probe(ns_a, ip_a, tmp_path / "a", "--cluster", "lab", "--secret", "s3", "--expect-ignored", "1"),
        # b listens on 0.0.0.0: it must find and advertise its concrete address itself.
        _probe(
            ns_b, "0.0.0.0", tmp_path / "b", "--cluster", "lab", "--secret", "s3", "--expect-ignored", "1"
        ),
        _probe(
            ns_a, ip_a, tmp_path / "other", "--cluster", "elsewhere", "--expect", "0", "--expect-ignored", "2"
        ),
    ]
    try:
        a, b, other = (_report(p) for p in procs)
    finally:
        logs = []
        for proc in procs:
            if proc.poll() is None:
                proc.communicate(input="", timeout=30)  # closing stdin stops the probe
            logs.append(proc.stderr.read() if proc.stderr and not proc.stderr.closed else "")
    print(json.dumps({"a": a, "b": b, "other": other}, indent=1))
    assert a["ok"] and b["ok"] and other["ok"], (a, b, other)
    assert a["connected"] == [b["peer_id"]] and b["connected"] == [a["peer_id"]]
    # With no --peer, the connection proves mDNS: at least one side found the other and dialed (the
    # other may be connected before its own browser reports the announcement).
    assert a["discovered"] == [b["peer_id"]] or b["discovered"] == [a["peer_id"]]
    assert set(a["discovered"]) <= {b["peer_id"]} and set(b["discovered"]) <= {a["peer_id"]}
    for report, ip in ((a, ip_a), (b, ip_b)):
        port = report["addrs"][0].split("/")[4]
        assert report["addrs"] == [f"/ip4/{ip}/tcp/{port}/p2p/{report['peer_id']}"]
    assert other["connected"] == [] and other["discovered"] == []


def test_shoal_nodes_in_namespaces_form_a_cluster_by_mdns(
    namespaces: tuple[str, str, str, str], tmp_path: Path
) -> None:
    """Two real `shoal run` processes, one per namespace, no --peer: mDNS alone makes them one cluster."""
    ns_a, ip_a, ns_b, ip_b = namespaces
    nodes = [
        start_node(
            "--api-host",
            ip,
            "--p2p-host",
            ip,
            "--cluster",
            "lab",
            data_dir=tmp_path / ns,
            model=None,
            netns=ns,
        )
        for ns, ip in ((ns_a, ip_a), (ns_b, ip_b))
    ]
    try:
        ids = {node.node_id for node in nodes}
        wait_until(lambda: agreed_leader(nodes) == min(ids), 30, "one cluster with one leader")
        for node in nodes:
            assert {m["id"] for m in node.cluster()["members"]} == ids
    finally:
        for node in nodes:
            node.stop()
