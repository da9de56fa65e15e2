"""The stranger on real nodes: with a cluster secret, a process that is no member connects to the
second stage of a 2-stage instance and sends a well-formed HELLO whose route names its own listener,
another connects and stays silent, and then the first stage's runner is killed (a ring break). The
stage dials no stranger, is never held by one, and the instance answers as before.

Without a secret the link key follows from the cluster's name, so a stranger can pass for the
previous stage (the README says so); even then its HELLO's route steers nothing: a stage sends
only where its node, asking the mesh, says."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from node.net.auth import derive_key
from node.pipeline.frames import Frame, Kind, encode_frame
from node.pipeline.hop import OutLink, dial_member
from node.pipeline.link_auth import AUTH_TIMEOUT, LinkSecurity
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_instances import _tokens
from tests.waiting import wait_until

CLUSTER = "links-e2e"
COMMON = ("--cluster", CLUSTER, "--cluster-secret", "the stage links' secret")


def _pair(tmp_path: Path, *common: str) -> Iterator[list[RunningNode]]:
    first = start_node(*common, data_dir=tmp_path / "n0", model=None)
    nodes = [first]
    try:
        nodes.append(start_node(*common, "--peer", first.p2p_addr, data_dir=tmp_path / "n1", model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "a leader agreed")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[RunningNode]]:
    """Two model-less nodes of one cluster with a secret."""
    yield from _pair(tmp_path, *COMMON)


@pytest.fixture
def open_pair(tmp_path: Path) -> Iterator[list[RunningNode]]:
    """Two model-less nodes of one cluster without a secret."""
    yield from _pair(tmp_path, "--cluster", CLUSTER)


class Stranger:
    """A listener no member should ever dial, counting who does."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.dialed = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def _count(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = self.listener.accept()
                self.dialed += 1
                conn.close()

    def close(self) -> None:
        self._done.set()
        self._thread.join(2)
        self.listener.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` within the handshake deadline (after its challenge)."""
    sock.settimeout(AUTH_TIMEOUT + 10)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:  # closed with our bytes unread
        return True
    except TimeoutError:
        return False
    return True


def _runner(node: RunningNode) -> psutil.Process:
    (runner,) = [
        c for c in psutil.Process(node.process.pid).children() if "node.runner" in " ".join(c.cmdline())
    ]
    return runner


@dataclass
class TwoStages:
    """A ready 2-stage instance, its first greedy answer, and where its second stage listens."""

    instance: str
    model: str
    entry: RunningNode
    second: RunningNode
    reference: tuple[str, int, int]
    address: tuple[str, int]

    def answers_as_before(self) -> bool:
        return _tokens(self.entry, self.model) == self.reference

    def kill_runner(self) -> None:
        """Kill the entry's runner: the ring breaks, and the node starts a new runner, whose driver
        listens on a new port and forms a new ring."""
        old = _runner(self.entry)
        old.kill()
        old.wait(10)


def _two_stages(nodes: list[RunningNode], model_dir: Path) -> TwoStages:
    created = httpx.post(
        f"{nodes[0].base_url}/v1/instances", json={"model": str(model_dir), "nodes": 2}, timeout=30
    )
    assert created.status_code == 201, created.text
    by_id = {n.node_id: n for n in nodes}
    entry, second = (by_id[stage["node_id"]] for stage in created.json()["stages"])
    entry.wait_for_log(f"model {model_dir.name} ready", timeout=120)
    host, port = second.wait_for_log(r"stage \[1, 2\) listens on (\S+):(\d+)", 10).groups()
    reference = _tokens(entry, model_dir.name)
    return TwoStages(created.json()["id"], model_dir.name, entry, second, reference, (host, int(port)))


def test_a_stranger_neither_redirects_nor_holds_a_stage(
    pair: list[RunningNode], random_model_dir: Path
) -> None:
    ring = _two_stages(pair, random_model_dir)

    stranger = Stranger()
    hello = Frame(Kind.HELLO, meta={"layer": 1, "route": [stranger.address]})
    chatty = socket.create_connection(ring.address, timeout=10)
    silent = socket.create_connection(ring.address, timeout=10)
    try:
        chatty.sendall(b"".join(bytes(part) for part in encode_frame(hello)))
        ring.kill_runner()
        wait_until(ring.answers_as_before, 90, "the same answers through a new ring")
        assert _closed_by_peer(chatty) and _closed_by_peer(silent)
        assert stranger.dialed == 0
        # The stage logs each refusal as it closes the socket; the line reaches the node's log
        # through two pipes, so it may come a moment after the test saw the close.
        refusals = re.compile(r"refused a connection from .*: no handshake within")
        wait_until(lambda: len(refusals.findall("".join(ring.second.log))) == 2, 10, "both strangers refused")
    finally:
        for sock in (chatty, silent):
            sock.close()
        stranger.close()


def test_without_a_secret_a_stranger_passing_for_a_stage_redirects_nothing(
    open_pair: list[RunningNode], random_model_dir: Path
) -> None:
    ring = _two_stages(open_pair, random_model_dir)

    stranger = Stranger()
    key = LinkSecurity.for_instance(derive_key(CLUSTER, None), ring.instance, sealed=False)
    sock, cipher = dial_member(ring.address, key, 1, timeout=10)  # it passes for stage 0
    link = OutLink(sock, name="stranger", cipher=cipher)
    rings = "".join(ring.second.log).count("ring up")
    try:
        link.send(Frame(Kind.HELLO, meta={"route": [stranger.address]}))
        ring.kill_runner()  # the ring breaks, and the stranger is the first to say HELLO to the stage
        # Its driver's new port reaches the stage from the mesh; the stranger's route, never.
        wait_until(
            lambda: "".join(ring.second.log).count("ring up") > rings, 60, "the stage dialed its next hop"
        )
        link.close()
        wait_until(ring.answers_as_before, 90, "the same answers through a new ring")
        assert stranger.dialed == 0
    finally:
        link.close()
        stranger.close()
