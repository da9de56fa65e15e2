"""Tensor-parallel instances across real nodes: placed through the API, every node holding a
slice of every layer, answering like one node from any node, and failing over when a rank's
process dies mid-stream."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_failover_nodes import assert_seamless, stream
from tests.test_instances import _instances, _tokens
from tests.waiting import wait_until

GREEDY = {
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "max_tokens": 200,
    "temperature": 0,
}


def _followers(node: RunningNode) -> list[psutil.Process]:
    """The tensor-parallel rank processes a node started (`node.tensor.follower`)."""
    children = psutil.Process(node.process.pid).children()
    return [c for c in children if "node.tensor.follower" in " ".join(c.cmdline())]


def test_bad_sharding_is_refused_with_the_reason(pair: list[RunningNode], random_model_dir: Path) -> None:
    url = f"{pair[0].base_url}/v1/instances"
    bogus = httpx.post(url, json={"model": str(random_model_dir), "sharding": "diagonal"}, timeout=30)
    assert bogus.status_code == 400 and "sharding" in bogus.text
    one = httpx.post(url, json={"model": str(random_model_dir), "nodes": 1, "sharding": "tensor"}, timeout=30)
    assert one.status_code == 422 and "at least 2 nodes" in one.json()["error"]["message"]
    assert _instances(pair[0]) == []


def test_auto_sharding_decides_on_the_round_trip_the_nodes_measured(
    pair: list[RunningNode], random_model_dir: Path
) -> None:
    """Each node measures its way to the other (`GET /v1/cluster` shows it); the leader weighs it
    against the model: the random model reads a few MB a token, far too little to pay for 7
    exchanges a token, so "auto" is pipeline, and the preview says why with the figures."""

    def measured() -> dict[str, dict[str, int]]:
        members = httpx.get(f"{pair[0].base_url}/v1/cluster", timeout=10).json()["members"]
        return {m["id"]: m["round_trips_us"] for m in members if m["round_trips_us"]}

    trips = wait_until(measured, 30, "both nodes measured their round trip to the other")
    assert len(trips) == 2 and all(0 < us < 1_000_000 for t in trips.values() for us in t.values())
    params = {"model": str(random_model_dir), "sharding": "auto"}
    preview = httpx.get(f"{pair[1].base_url}/v1/instances/preview", params=params, timeout=30)
    assert preview.status_code == 200, preview.text
    plan = preview.json()
    assert plan["sharding"] == "pipeline" and plan["sharding_reason"].startswith("pipeline: 2 ranks")
    assert "7 exchanges at a" in plan["sharding_reason"] and "us round trip" in plan["sharding_reason"]


def test_a_two_rank_instance_answers_like_one_node_and_fails_over(
    pair: list[RunningNode], random_model_dir: Path, random_node: RunningNode
) -> None:
    name = random_model_dir.name
    reference = _tokens(random_node, name)  # the same model on one node, one process
    body: dict[str, str | int] = {"model": str(random_model_dir), "nodes": 2, "sharding": "tensor"}
    preview = httpx.get(f"{pair[1].base_url}/v1/instances/preview", params=body, timeout=30)
    assert preview.status_code == 200, preview.text
    assert preview.json()["sharding"] == "tensor" and len(preview.json()["stage_bytes"]) == 2
    created = httpx.post(f"{pair[0].base_url}/v1/instances", json=body, timeout=30)
    assert created.status_code == 201, created.text
    instance: dict[str, Any] = created.json()
    assert instance["sharding"] == "tensor"
    ranks = instance["stages"]
    assert [(r["start_layer"], r["end_layer"]) for r in ranks] == [(0, 2), (0, 2)]
    by_id = {n.node_id: n for n in pair}
    entry, other = by_id[ranks[0]["node_id"]], by_id[ranks[1]["node_id"]]
    entry.wait_for_log(f"model {name} ready", timeout=120)
    other.wait_for_log("tensor rank 1 of 2 of", timeout=30)

    # From either node: one node's text.
    assert _tokens(other, name) == reference
    assert _tokens(entry, name) == reference

    # Rank 1's process dies mid-stream: its node starts it again, rank 0 forms the group anew and
    # the request is taken over; the client sees one uninterrupted answer.
    whole = stream(other, name, GREEDY)

    killed: list[int] = []

    def kill_rank() -> None:
        for process in _followers(other):
            os.kill(process.pid, signal.SIGKILL)
            killed.append(process.pid)

    assert_seamless(stream(other, name, GREEDY, kill_rank), whole)
    assert len(killed) == 1
    wait_until(lambda: [p for p in _followers(other) if p.pid not in killed], 30, "rank 1 running again")
    assert _tokens(entry, name) == reference

    # Rank 1's process freezes mid-stream: its node finds it silent (no heartbeat for 15 s) and
    # kills it, which breaks rank 0's step, and the request is taken over as above.
    def freeze_rank() -> None:
        for process in _followers(other):
            os.kill(process.pid, signal.SIGSTOP)
            killed.append(process.pid)

    assert_seamless(stream(other, name, GREEDY, freeze_rank), whole)
    other.wait_for_log(re.escape("sent no heartbeat for 15 s (frozen); killed it"), timeout=10)
    assert _tokens(entry, name) == reference
    deleted = httpx.delete(f"{entry.base_url}/v1/instances/{instance['id']}", timeout=30)
    assert deleted.status_code == 200


def test_a_cluster_with_a_secret_runs_tensor_parallel_on_sealed_links(
    random_model_dir: Path, random_node: RunningNode, tmp_path: Path
) -> None:
    """With a secret every link seals its frames: the tensor links too (AES-GCM, natively), with
    the key each pair's handshake gave; the text is one node's."""
    name = random_model_dir.name
    reference = _tokens(random_node, name)
    secret = ("--cluster-secret", "hunter2")
    nodes = [start_node(*secret, data_dir=tmp_path / "a", model=None)]
    try:
        nodes.append(start_node(*secret, "--peer", nodes[0].p2p_addr, data_dir=tmp_path / "b", model=None))
        wait_until(lambda: agreed_leader(nodes), 30, "the two nodes agree on a leader")
        body = {"model": str(random_model_dir), "nodes": 2, "sharding": "tensor"}
        created = httpx.post(f"{nodes[1].base_url}/v1/instances", json=body, timeout=30)
        assert created.status_code == 201, created.text
        ranks = created.json()["stages"]
        by_id = {n.node_id: n for n in nodes}
        entry, other = by_id[ranks[0]["node_id"]], by_id[ranks[1]["node_id"]]
        entry.wait_for_log(f"model {name} ready", timeout=120)
        assert _tokens(entry, name) == reference  # the first request forms the group
        other.wait_for_log("rank 1 of 2 joined its group, its frames sealed", timeout=30)
        assert _tokens(other, name) == reference
    finally:
        for node in nodes:
            node.stop()
