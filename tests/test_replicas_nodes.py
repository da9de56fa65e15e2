"""Replicas across real nodes: two instances of a model on three nodes share requests by load, a
killed replica's requests go to the other, and the leader re-places it on the spare node."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from node.cli.status import render
from node.net.identity import load_or_create_identity, peer_id_of
from protocol.cluster_view import ClusterView
from tests.nodes import RunningNode, agreed_leader, start_node, statuses
from tests.waiting import wait_until

BATCH = 8
ONE_THREAD = {"SHOAL_BLAS_THREADS": "1"}
"""Each runner computes on one thread: two runners and three nodes share this machine's cores, and
nodes starved of CPU miss heartbeats (then the detector declares them dead and replicas move)."""


def _replicas(node: RunningNode, model: str) -> dict[str, dict[str, Any]]:
    """The instances of `model` in `node`'s cluster view, by id."""
    return {i["id"]: i for i in node.cluster()["instances"] if i["model"] == model}


def _ready(instance: dict[str, Any]) -> bool:
    """Whether the instance's entry reported (in its last load record) that it takes requests."""
    return bool((instance["load"] or {}).get("ready"))


def _served(node: RunningNode, model: str) -> dict[str, int]:
    """Requests each replica's entry reports it took (0 before its first report)."""
    return {iid: (i["load"] or {}).get("served", 0) for iid, i in _replicas(node, model).items()}


def _served_all(node: RunningNode, model: str, total: int) -> dict[str, int] | None:
    """`_served` once the replicas report `total` requests (at least) between them."""
    served = _served(node, model)
    return served if sum(served.values()) >= total else None


def _chat(node: RunningNode, model: str, n: int) -> tuple[int, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Request {n}: count to forty."}],
        "temperature": 0,
        "max_tokens": 48,
    }
    answer = httpx.post(f"{node.base_url}/v1/chat/completions", json=body, timeout=120)
    text = answer.json()["choices"][0]["message"]["content"] if answer.status_code == 200 else answer.text
    return answer.status_code, text


def _batch(node: RunningNode, model: str) -> list[tuple[int, str]]:
    """`BATCH` requests at once through `node`."""
    with ThreadPoolExecutor(BATCH) as pool:
        return list(pool.map(lambda n: _chat(node, model, n), range(BATCH)))


def _place(node: RunningNode, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{node.base_url}/v1/instances", json=body, timeout=60)


@pytest.fixture(scope="module")
def lone_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    node = start_node(data_dir=tmp_path_factory.mktemp("lone"), model=None)
    yield node
    node.stop()


def test_bad_replicas_are_refused_in_openai_shape(lone_node: RunningNode) -> None:
    refused: list[object] = [0, -1, 10**6, "2", 2.5, 2.0, True, []]
    for bad in refused:
        answer = _place(lone_node, {"model": "anything", "replicas": bad})
        assert answer.status_code == 400, (bad, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "replicas", error
    for bad_text in ("two", "0", "1e9"):
        preview = httpx.get(
            f"{lone_node.base_url}/v1/instances/preview",
            params={"model": "anything", "replicas": bad_text},
            timeout=30,
        )
        assert preview.status_code == 400 and preview.json()["error"]["param"] == "replicas"


def test_two_replicas_share_requests_and_survive_a_kill(random_model_dir: Path, tmp_path: Path) -> None:
    # Identities made ahead, so that the first node is the leader (the smallest id): never killed.
    dirs = sorted(
        (tmp_path / f"n{i}" for i in range(3)), key=lambda d: peer_id_of(load_or_create_identity(d))
    )
    first = start_node(data_dir=dirs[0], model=None, env=ONE_THREAD)
    nodes = [first]
    try:
        for data_dir in dirs[1:]:
            nodes.append(start_node("--peer", first.p2p_addr, data_dir=data_dir, model=None, env=ONE_THREAD))
        wait_until(lambda: agreed_leader(nodes) == first.node_id, 20, "agreed on a leader")
        by_id = {n.node_id: n for n in nodes}
        model = random_model_dir.name

        # More replicas than fit beside the two: the preview plans one more (three nodes), writes nothing.
        placed = _place(nodes[1], {"model": str(random_model_dir), "replicas": 2})
        assert placed.status_code == 201, placed.text
        replicas = placed.json()["replicas"]
        entries = [r["stages"][0]["node_id"] for r in replicas]
        assert placed.json()["replicas_requested"] == 2 and len(set(entries)) == 2
        for entry in entries:
            by_id[entry].wait_for_log(f"model {model} ready", timeout=60)
        preview = httpx.get(
            f"{nodes[1].base_url}/v1/instances/preview",
            params={"model": str(random_model_dir), "replicas": "5"},
            timeout=30,
        )
        assert preview.status_code == 200 and len(preview.json()["replicas"]) == 3, preview.text
        assert len(_replicas(nodes[1], model)) == 2

        # The spare node (no replica) spreads a burst over both replicas.
        spare = next(n for n in nodes if n.node_id not in entries)
        # Both entries' reports say ready (a report sent while a runner loaded says not ready, and a
        # burst before the next one rightly goes all to the replica known ready).
        wait_until(lambda: all(map(_ready, _replicas(spare, model).values())), 10, "both reported ready")
        assert all(status == 200 for status, _ in _batch(spare, model))
        served = wait_until(lambda: _served_all(spare, model, BATCH), 10, "every request reported")
        assert served is not None and min(served.values()) >= 2, served  # both took a share
        # (at least: an attempt that failover abandons counts where it was opened)
        table = Console(record=True, width=200)
        table.print(render(ClusterView.model_validate(spare.cluster())))
        shown = table.export_text()
        assert "2 replicas" in shown and "served" in shown

        # kill -9 one replica's node: once the spare sees it gone, a new burst all goes to the other.
        victim = by_id[next(e for e in entries if e != first.node_id)]
        lost = next(r["id"] for r in replicas if r["stages"][0]["node_id"] == victim.node_id)
        victim.process.send_signal(signal.SIGKILL)
        nodes.remove(victim)
        wait_until(lambda: statuses(spare)[victim.node_id] != "alive", 10, "the victim not alive")
        assert [status for status, _ in _batch(spare, model)] == [200] * BATCH

        # The leader re-places the lost replica on the only node left free: the spare.
        def replaced() -> bool:
            found = _replicas(spare, model).get(lost)
            return found is not None and found["stages"][0]["node_id"] == spare.node_id

        wait_until(replaced, 20, "the lost replica re-placed")
        spare.wait_for_log(f"model {model} ready", timeout=60)
        assert _chat(spare, model, 0)[0] == 200
        # Asking for three now: no node is free, so the two that run are the answer.
        again = _place(spare, {"model": str(random_model_dir), "replicas": 3})
        assert again.status_code == 200 and len(again.json()["replicas"]) == 2, again.text
    finally:
        for node in nodes:
            node.stop()
