"""Multi-stage instances across real nodes: a model split over two nodes answers like one node does,
and a stage node killed mid-stream ends the request with an error, then the instance is re-placed."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.model_factory import make_random_model
from tests.nodes import RunningNode, agreed_leader, start_node, wait_until
from tests.test_instances import _instances, _tokens


@pytest.fixture
def trio_nodes(tmp_path: Path) -> Iterator[list[RunningNode]]:
    """Three model-less nodes in one cluster."""
    first = start_node(data_dir=tmp_path / "n0", model=None)
    nodes = [first]
    try:
        for i in (1, 2):
            nodes.append(start_node("--peer", first.p2p_addr, data_dir=tmp_path / f"n{i}", model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "agreed")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _stream_until_killed(node: RunningNode, model: str, victim: RunningNode) -> tuple[list[str], float]:
    """Stream a long generation, SIGKILL `victim` after 3 chunks; the lines after and seconds to [DONE]."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "temperature": 0,
        "max_tokens": 1500,
        "stream": True,
    }
    killed_at: float | None = None
    after: list[str] = []
    seen = 0
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if killed_at is None:
                seen += 1
                assert line != "data: [DONE]", "the generation ended before the kill"
                if seen == 3:
                    victim.process.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                continue
            after.append(line)
            if line == "data: [DONE]":
                return after, time.monotonic() - killed_at
    raise AssertionError(f"the stream ended without [DONE]: {after[-3:]}")


def test_two_stage_instance_serves_like_one_node_and_survives_a_stage_kill(
    trio_nodes: list[RunningNode], random_model_dir: Path, random_node: RunningNode
) -> None:
    name = random_model_dir.name
    reference = _tokens(random_node, name)  # the same model on one node, one process

    created = httpx.post(
        f"{trio_nodes[0].base_url}/v1/instances",
        json={"model": str(random_model_dir), "nodes": 2},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    instance: dict[str, Any] = created.json()
    stages = instance["stages"]
    assert len(stages) == 2 and stages[0]["node_id"] != stages[1]["node_id"]
    assert (stages[0]["start_layer"], stages[0]["end_layer"], stages[1]["end_layer"]) == (0, 1, 2)
    by_id = {n.node_id: n for n in trio_nodes}
    entry, second = by_id[stages[0]["node_id"]], by_id[stages[1]["node_id"]]
    outsider = next(n for n in trio_nodes if n is not entry and n is not second)
    entry.wait_for_log(f"model {name} ready", timeout=120)

    # Through the node holding no shard, and through the second stage's node: one node's text.
    assert _tokens(outsider, name) == reference
    assert _tokens(second, name) == reference

    # Kill the second stage's node mid-stream: an error event, then [DONE], within 5 s.
    after, seconds = _stream_until_killed(outsider, name, second)
    print(f"kill -> [DONE] in {seconds:.2f}s")
    assert seconds < 5.0, seconds
    errors = [json.loads(line[6:]) for line in after if line != "data: [DONE]" and "error" in line]
    assert errors and "error" in errors[-1], after[-3:]
    survivors = [n for n in trio_nodes if n is not second]

    def replaced() -> bool:
        found = _instances(survivors[0])
        return bool(found) and all(s["node_id"] != second.node_id for s in found[0]["stages"])

    wait_until(replaced, 30, "instance re-placed on the survivors")
    wait_until(lambda: _tokens(outsider, name) == reference, 90, "the re-placed instance serving")


@pytest.fixture(scope="module")
def four_layer_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("models") / "tiny-llama-4", num_layers=4, tokenizer_from=builtin_model_dir
    )


def test_three_stage_instance_matches_one_stage(
    trio_nodes: list[RunningNode], four_layer_model: Path
) -> None:
    name = four_layer_model.name
    base = trio_nodes[1].base_url
    created = httpx.post(
        f"{base}/v1/instances", json={"model": str(four_layer_model), "nodes": 3}, timeout=30
    )
    assert created.status_code == 201, created.text
    stages = created.json()["stages"]
    assert len({s["node_id"] for s in stages}) == 3 and stages[-1]["end_layer"] == 4
    entry = next(n for n in trio_nodes if n.node_id == stages[0]["node_id"])
    entry.wait_for_log(f"model {name} ready", timeout=120)
    split = _tokens(trio_nodes[2], name)
    assert split[2] == 24

    deleted = httpx.delete(f"{base}/v1/instances/{created.json()['id']}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    wait_until(lambda: all(n.health()["runners"] == [] for n in trio_nodes), 20, "runners stopped")
    for stage in stages[1:]:  # and the stage processes with them
        holder = next(n for n in trio_nodes if n.node_id == stage["node_id"])
        holder.wait_for_log(rf"stage \[{stage['start_layer']}, {stage['end_layer']}\) stopped", timeout=20)
    whole = httpx.post(f"{base}/v1/instances", json={"model": str(four_layer_model), "nodes": 1}, timeout=30)
    assert whole.status_code == 201 and len(whole.json()["stages"]) == 1, whole.text
    wait_until(lambda: _tokens(trio_nodes[2], name) == split, 90, "the 1-stage instance answering the same")
