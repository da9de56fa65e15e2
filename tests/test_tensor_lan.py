"""A tensor-parallel instance over the emulated LAN (`tests/lan.py`): two nodes in network
namespaces on one bridge, each on its own core, find each other by mDNS alone; the second fetches
the model's files from the first over the files route, and the group's links run over the LAN.
The answer, asked from either node, is one node's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lan import Lan, LanUnavailable, emulated_lan
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

QUESTION = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24, "temperature": 0}


@pytest.fixture
def lan() -> Iterator[Lan]:
    try:
        with emulated_lan(2) as made:
            yield made
    except LanUnavailable as exc:
        pytest.skip(str(exc))


def test_a_tensor_instance_over_the_lan_answers_like_one_node(
    lan: Lan, random_model_dir: Path, random_node: RunningNode, tmp_path: Path
) -> None:
    name = random_model_dir.name
    reference = _answer(random_node.base_url, name)
    holder = tmp_path / "n0"
    (holder / "models").mkdir(parents=True)
    (holder / "models" / name).symlink_to(random_model_dir)  # only the first node has the files
    nodes: list[RunningNode] = []
    try:
        for i, ns in enumerate(lan.namespaces):
            args = [*lan.node_args(i), "--cluster", lan.tag]
            nodes.append(
                start_node(*args, data_dir=tmp_path / f"n{i}", model=None, netns=ns, prefix=lan.pinned(i))
            )
        wait_until(lambda: agreed_leader(nodes), 60, "found each other by mDNS and agreed on a leader")
        placed = lan.request(
            0, "POST", f"{nodes[0].base_url}/v1/instances", {"model": name, "nodes": 2, "sharding": "tensor"}
        )
        assert placed["sharding"] == "tensor" and len(placed["stages"]) == 2
        second = next(i for i, n in enumerate(nodes) if n.node_id == placed["stages"][1]["node_id"])
        nodes[second].wait_for_log("tensor rank 1 of 2 of", timeout=120)
        for i, node in enumerate(nodes):
            answer = lan.request(
                i, "POST", f"{node.base_url}/v1/chat/completions", {"model": name, **QUESTION}
            )
            assert answer["choices"][0]["message"]["content"] == reference
    finally:
        for node in nodes:
            node.stop()


def _answer(base_url: str, model: str) -> Any:
    import httpx

    body = {"model": model, **QUESTION}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0][
        "message"
    ]["content"]
