"""The stranger on real nodes: with a cluster secret, a process that is no member connects to the
second stage of a 2-stage instance and sends a well-formed HELLO whose route names its own listener,
another connects and stays silent, and then the first stage's runner is killed (a ring break). The
stage dials no stranger, is never held by one, and the instance answers as before."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from node.pipeline.frames import Frame, Kind, encode_frame
from node.pipeline.link_auth import AUTH_TIMEOUT
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_instances import _tokens
from tests.waiting import wait_until

COMMON = ("--cluster", "links-e2e", "--cluster-secret", "the stage links' secret")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[RunningNode]]:
    """Two model-less nodes of one cluster with a secret."""
    first = start_node(*COMMON, data_dir=tmp_path / "n0", model=None)
    nodes = [first]
    try:
        nodes.append(start_node(*COMMON, "--peer", first.p2p_addr, data_dir=tmp_path / "n1", model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "a leader agreed")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


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


def test_a_stranger_neither_redirects_nor_holds_a_stage(
    pair: list[RunningNode], random_model_dir: Path
) -> None:
    name = random_model_dir.name
    created = httpx.post(
        f"{pair[0].base_url}/v1/instances", json={"model": str(random_model_dir), "nodes": 2}, timeout=30
    )
    assert created.status_code == 201, created.text
    stages = created.json()["stages"]
    by_id = {n.node_id: n for n in pair}
    entry, second = by_id[stages[0]["node_id"]], by_id[stages[1]["node_id"]]
    entry.wait_for_log(f"model {name} ready", timeout=120)
    reference = _tokens(entry, name)
    host, port = second.wait_for_log(r"stage \[1, 2\) listens on (\S+):(\d+)", 10).groups()

    stranger = Stranger()
    hello = Frame(Kind.HELLO, meta={"layer": 1, "route": [stranger.address]})
    chatty = socket.create_connection((host, int(port)), timeout=10)
    silent = socket.create_connection((host, int(port)), timeout=10)
    try:
        chatty.sendall(b"".join(bytes(part) for part in encode_frame(hello)))
        old = _runner(entry)
        old.kill()  # the ring breaks; the node starts a new runner, which forms a new ring
        old.wait(10)
        wait_until(lambda: _tokens(entry, name) == reference, 90, "the same answers through a new ring")
        assert _closed_by_peer(chatty) and _closed_by_peer(silent)
        assert stranger.dialed == 0
        log = "".join(second.log)
        assert len(re.findall(r"refused a connection from .*: no handshake within", log)) == 2, log[-3000:]
    finally:
        for sock in (chatty, silent):
            sock.close()
        stranger.close()
