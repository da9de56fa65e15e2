"""Real `shoal run` processes on 127.0.0.1 as a cluster: agreement, failures, admission, `shoal status`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cbor2
import pytest
import trio

from node.net import Mesh, MeshConfig, RequestError
from tests.nodes import RunningNode, agreed_leader, start_node, statuses
from tests.waiting import wait_until

SECRET = {"SHOAL_CLUSTER_SECRET": "correct horse battery staple"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningNode]]:
    first = start_node(data_dir=tmp_path_factory.mktemp("n0"), model=None, env=SECRET)
    nodes = [first]
    try:
        for i in (1, 2):
            data = tmp_path_factory.mktemp(f"n{i}")
            nodes.append(start_node("--peer", first.p2p_addr, data_dir=data, model=None, env=SECRET))
        yield nodes
    finally:
        for node in nodes:
            node.process.send_signal(signal.SIGCONT)
            node.stop()


def test_three_nodes_agree_on_members_and_leader(cluster: list[RunningNode]) -> None:
    # The rule: the smallest live id leads (once past its start-up grace).
    leader = min(n.node_id for n in cluster)
    wait_until(lambda: agreed_leader(cluster) == leader, 15, "agreed on the smallest id as leader")
    for node in cluster:
        view = node.cluster()
        assert view["self"] == node.node_id
        member = next(m for m in view["members"] if m["id"] == node.node_id)
        assert member["multiaddrs"] == [node.p2p_addr] and member["api_url"] == node.base_url
        roles = {m["id"]: m["role"] for m in view["members"]}
        assert [i for i, r in roles.items() if r == "leader"] == [leader]


def test_status_cli_shows_the_cluster(cluster: list[RunningNode]) -> None:
    wait_until(lambda: agreed_leader(cluster), 15, "agreed on one leader")
    shoal = [sys.executable, "-m", "node.cli", "status", "--api", cluster[1].base_url]
    table = subprocess.run(
        shoal, capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"}
    )
    assert table.returncode == 0, table.stderr
    for node in cluster:
        assert node.node_id[-8:] in table.stdout
    assert "leader" in table.stdout and "alive" in table.stdout
    raw = subprocess.run([*shoal, "--json"], capture_output=True, text=True, timeout=30)
    view = json.loads(raw.stdout)
    assert {m["id"] for m in view["members"]} == {n.node_id for n in cluster}

    nobody = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--api", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert nobody.returncode == 1
    assert "no Shoal node answers at http://127.0.0.1:9" in nobody.stderr and "Traceback" not in nobody.stderr


def test_node_with_wrong_secret_cannot_join(cluster: list[RunningNode], tmp_path: Path) -> None:
    intruder = start_node(
        "--peer",
        cluster[0].p2p_addr,
        data_dir=tmp_path,
        model=None,
        env={"SHOAL_CLUSTER_SECRET": "wrong"},
    )
    try:
        intruder.wait_for_log("authentication .*failed|refus", timeout=15)
        # Give gossip and anti-entropy several rounds to (wrongly) carry it anywhere.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for node in cluster:
                assert intruder.node_id not in statuses(node)
            time.sleep(0.2)
        assert set(statuses(intruder)) == {intruder.node_id}
    finally:
        intruder.stop()


def test_garbage_cluster_messages_are_dropped_and_counted(cluster: list[RunningNode], tmp_path: Path) -> None:
    """An admitted peer sends undecodable gossip and sync payloads: counted, dropped, node unharmed."""
    target = cluster[0]
    before = target.health()["cluster"]["dropped_messages"]
    config = MeshConfig(
        data_dir=tmp_path,
        secret=SECRET["SHOAL_CLUSTER_SECRET"].encode(),
        bootstrap_peers=(target.p2p_addr,),
        mdns=False,
        listen_host="127.0.0.1",
    )
    garbage = [b"", b"\xff" * 64, cbor2.dumps({"v": 999}), cbor2.dumps([1] * 10_000), os.urandom(4096)]

    async def attack() -> None:
        mesh = Mesh(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(mesh.run)
            with trio.fail_after(10):
                async for event in mesh.events:
                    if event.up and event.peer_id == target.node_id:
                        break
            for payload in garbage:
                with contextlib.suppress(RequestError):
                    await mesh.request(target.node_id, payload)
            nursery.cancel_scope.cancel()

    trio.run(attack)
    wait_until(
        lambda: target.health()["cluster"]["dropped_messages"] >= before + len(garbage),
        10,
        "counted as dropped",
    )
    assert target.process.poll() is None
    wait_until(lambda: agreed_leader(cluster), 15, "agreed on one leader")


def test_stopped_node_is_marked_dead_then_alive_again(cluster: list[RunningNode]) -> None:
    wait_until(lambda: agreed_leader(cluster), 15, "agreed on one leader")
    leader = agreed_leader(cluster)
    follower = next(n for n in cluster if n.node_id != leader)
    watcher = next(n for n in cluster if n is not follower)
    follower.process.send_signal(signal.SIGSTOP)  # when, on the mock clock: test_cluster_service.py
    try:
        wait_until(lambda: statuses(watcher)[follower.node_id] == "dead", 10, "marked dead")
    finally:
        follower.process.send_signal(signal.SIGCONT)
    wait_until(lambda: statuses(watcher)[follower.node_id] == "alive", 15, "alive again after SIGCONT")
    wait_until(lambda: agreed_leader(cluster) == leader, 15, "back to the same leader")


def test_killed_leader_is_replaced(cluster: list[RunningNode]) -> None:
    wait_until(lambda: agreed_leader(cluster), 15, "agreed on one leader")
    leader_id = agreed_leader(cluster)
    assert leader_id is not None
    leader = next(n for n in cluster if n.node_id == leader_id)
    survivors = [n for n in cluster if n is not leader]
    term = survivors[0].cluster()["term"]
    leader.process.kill()

    def new_leader() -> bool:
        views = [s.cluster() for s in survivors]
        return (
            all(
                statuses(s)[leader_id] == "dead" and v["leader"] not in (None, leader_id) and v["term"] > term
                for s, v in zip(survivors, views, strict=True)
            )
            and len({v["leader"] for v in views}) == 1
        )

    # How soon (the closed connection is the fast signal): tests/test_cluster_service.py on trio's
    # mock clock, and bench/mesh.py's "dead noticed s" / "new leader s" on real processes.
    wait_until(new_leader, 10, "a new agreed leader")
    assert survivors[0].cluster()["leader"] == min(s.node_id for s in survivors)
