"""Instances across real nodes: placement by the leader, routing from any node, failures, deletion."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import openai

from node.net.identity import load_or_create_identity, peer_id_of
from tests.nodes import RunningNode, agreed_leader, start_node, statuses
from tests.waiting import wait_until


def _instances(node: RunningNode) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = httpx.get(f"{node.base_url}/v1/instances", timeout=10).json()["data"]
    return data


def _tokens(node: RunningNode, model: str, content: str = "Count to twenty.") -> tuple[str, int, int]:
    """Streamed greedy text and token counts (prompt, completion) through the openai SDK."""
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    return text, usage.prompt_tokens, usage.completion_tokens


def test_place_route_and_delete(pair: list[RunningNode], random_model_dir: Path) -> None:
    model = str(random_model_dir)
    preview = httpx.get(f"{pair[1].base_url}/v1/instances/preview", params={"model": model}, timeout=30)
    assert preview.status_code == 200, preview.text
    assert len(preview.json()["stages"]) == 1 and preview.json()["stage_bytes"][0] > 0
    assert _instances(pair[0]) == []  # a preview writes nothing

    too_many = httpx.post(f"{pair[1].base_url}/v1/instances", json={"model": model, "nodes": 3}, timeout=30)
    assert too_many.status_code == 422 and too_many.json()["error"]["code"] == "insufficient_memory"

    created = httpx.post(f"{pair[1].base_url}/v1/instances", json={"model": model}, timeout=30)
    assert created.status_code == 201, created.text
    instance = created.json()
    assert instance["model"] == random_model_dir.name
    (stage,) = instance["stages"]
    holder = next(n for n in pair if n.node_id == stage["node_id"])
    other = next(n for n in pair if n is not holder)
    holder.wait_for_log(f"model {random_model_dir.name} ready", timeout=60)
    wait_until(lambda: _instances(other) == [_instances(holder)[0]], 10, "instance seen everywhere")

    # Same tokens through the node holding the model and through the one that does not.
    local = _tokens(holder, random_model_dir.name)
    routed = _tokens(other, random_model_dir.name)
    assert routed == local and local[2] == 24

    again = httpx.post(f"{pair[0].base_url}/v1/instances", json={"model": model}, timeout=30)
    assert again.status_code == 200 and again.json()["id"] == instance["id"]  # one instance per model

    deleted = httpx.delete(f"{other.base_url}/v1/instances/{instance['id']}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    wait_until(lambda: _instances(holder) == [] and holder.health()["runners"] == [], 10, "runner stopped")
    gone = httpx.post(
        f"{other.base_url}/v1/chat/completions",
        json={"model": random_model_dir.name, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = httpx.delete(f"{other.base_url}/v1/instances/{instance['id']}", timeout=30)
    assert missing.status_code == 404


def test_killed_stage_node_is_replaced_and_leader_change_keeps_serving(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """The model runs on a node that is not the leader. A node joining (and taking the leadership) and
    the leader's death leave it serving untouched; killing the holder makes the leader re-place it
    on a survivor, and the next request works."""
    # Identities made ahead, so the node given the model is never the leader (the smallest id).
    dirs = sorted(
        (tmp_path / f"n{i}" for i in range(4)), key=lambda d: peer_id_of(load_or_create_identity(d))
    )
    holder = start_node(data_dir=dirs[3], model=str(random_model_dir))  # alone: places it on itself
    nodes = [holder]
    try:
        for data_dir in dirs[1:3]:
            nodes.append(start_node("--peer", holder.p2p_addr, data_dir=data_dir, model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "agreed")
        wait_until(lambda: len(_instances(nodes[2])) == 1, 30, "instance placed")
        holder_id = holder.node_id
        assert _instances(nodes[2])[0]["stages"][0]["node_id"] == holder_id
        holder.wait_for_log(f"model {random_model_dir.name} ready", timeout=60)
        before = _tokens(nodes[2], random_model_dir.name)
        runner_pid = holder.runner_pid()

        # The smallest id joins: it becomes the leader, and the instance stays as it was.
        leader = start_node("--peer", holder.p2p_addr, data_dir=dirs[0], model=None)
        nodes.append(leader)
        wait_until(lambda: agreed_leader(nodes) == leader.node_id, 20, "the newcomer leading")
        assert [i["stages"][0]["node_id"] for i in _instances(leader)] == [holder_id]
        assert _tokens(leader, random_model_dir.name) == before

        leader.process.send_signal(signal.SIGKILL)
        nodes.remove(leader)
        wait_until(lambda: agreed_leader(nodes) is not None, 15, "a new leader")
        assert [i["id"] for i in _instances(nodes[1])] == [_instances(holder)[0]["id"]]
        assert _tokens(holder, random_model_dir.name) == before
        assert holder.runner_pid() == runner_pid  # never torn down: the same runner process throughout

        survivors = [n for n in nodes if n is not holder]
        holder.process.send_signal(signal.SIGKILL)
        nodes.remove(holder)

        def replaced() -> bool:
            found = _instances(survivors[0])
            return bool(found) and found[0]["stages"][0]["node_id"] != holder_id

        wait_until(replaced, 20, "instance re-placed on a survivor")
        new_holder = next(
            n for n in survivors if n.node_id == _instances(survivors[0])[0]["stages"][0]["node_id"]
        )
        assert statuses(survivors[0])[holder_id] == "dead"
        new_holder.wait_for_log(f"model {random_model_dir.name} ready", timeout=60)
        assert _tokens(survivors[-1], random_model_dir.name) == before
    finally:
        for node in nodes:
            node.stop()
