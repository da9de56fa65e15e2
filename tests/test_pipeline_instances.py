"""Multi-stage instances across real nodes: a model split over two or three nodes answers like one
node does, and a stage that dies or freezes mid-stream is failed over (`node.serving.failover`): the instance
serves again (the stage restarted in place, or the instance re-placed) and takes the request over,
and the client's stream goes on with the text of an uninterrupted run, without an error."""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.model_factory import make_random_model
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_api_stream_shape import PREFILL
from tests.test_failover_nodes import assert_seamless, stream
from tests.test_instances import _instances, _tokens
from tests.waiting import wait_until


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
            if node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)  # a frozen node must be able to stop
            node.stop()


def _stage_processes(node: RunningNode) -> list[psutil.Process]:
    """The pipeline stage processes a node started (children running `node.pipeline.stage`)."""
    children = psutil.Process(node.process.pid).children()
    return [c for c in children if "node.pipeline.stage" in " ".join(c.cmdline())]


def _freeze(node: RunningNode) -> None:
    """What a hung machine looks like: the node and its stage process stop running, sockets stay open."""
    for process in _stage_processes(node):
        process.send_signal(signal.SIGSTOP)
    node.process.send_signal(signal.SIGSTOP)


LONG = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400}
"""Long enough that the failure lands mid-stream; the read timeout of `stream` only keeps a hang
from lasting (the hop timeout, 3 s, notices the failure; how soon is bench/pipeline.py's figure)."""
GREEDY = {**LONG, "temperature": 0}
SEEDED = {**LONG, "temperature": 0.8, "seed": 11}


def _wait_replaced_without(survivors: list[RunningNode], gone: RunningNode) -> list[dict[str, Any]]:
    def replaced() -> list[dict[str, Any]] | None:
        found = _instances(survivors[0])
        stages: list[dict[str, Any]] = found[0]["stages"] if found else []
        return stages if stages and all(s["node_id"] != gone.node_id for s in stages) else None

    wait_until(replaced, 30, "instance re-placed on the survivors")
    stages = replaced()
    assert stages is not None
    return stages


def test_two_stage_instance_serves_like_one_node_and_survives_a_frozen_stage(
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

    # Freeze the second stage's machine mid-stream: after the hop timeout the instance is re-placed
    # on the survivors, which take the request over.
    whole = stream(outsider, name, GREEDY)
    assert_seamless(stream(outsider, name, GREEDY, lambda: _freeze(second)), whole)
    _wait_replaced_without([entry, outsider], second)
    assert _tokens(outsider, name) == reference
    second.process.kill()


@pytest.fixture(scope="module")
def four_layer_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("models") / "tiny-llama-4", num_layers=4, tokenizer_from=builtin_model_dir
    )


def _progress_then_disconnect(node: RunningNode, model: str) -> list[tuple[int, int]]:
    """Stream a long prompt, read its prefill progress and 3 chunks, then hang up (which cancels)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "lighthouse " * 1500}],
        "temperature": 0,
        "max_tokens": 400,  # with the prompt, within the model's 2048-token context
        "stream": True,
    }
    progress: list[tuple[int, int]] = []
    chunks = 0
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if match := PREFILL.match(line):
                progress.append((int(match[1]), int(match[2])))
            elif line.startswith("data: "):
                assert line != "data: [DONE]", "the generation ended before the hang-up"
                chunks += 1
                if chunks == 3:
                    break
    return progress


def test_three_stages_match_one_node_and_survive_stage_failures(
    trio_nodes: list[RunningNode], four_layer_model: Path
) -> None:
    name = four_layer_model.name
    base = trio_nodes[1].base_url
    created = httpx.post(
        f"{base}/v1/instances", json={"model": str(four_layer_model), "nodes": 3}, timeout=30
    )
    assert created.status_code == 201, created.text
    instance_id, stages = created.json()["id"], created.json()["stages"]
    assert len({s["node_id"] for s in stages}) == 3 and stages[-1]["end_layer"] == 4
    by_id = {n.node_id: n for n in trio_nodes}
    entry, middle, last = (by_id[s["node_id"]] for s in stages)
    entry.wait_for_log(f"model {name} ready", timeout=120)
    split = _tokens(last, name)
    assert split[2] == 24

    # Prefill progress crosses the stages (a chunk counts once the last stage has it); hanging up
    # cancels the request on every stage, and the next one is served as before.
    progress = _progress_then_disconnect(last, name)
    assert len(progress) >= 3 and progress[-1][0] == progress[-1][1] > 1500, progress
    assert [p for p, _ in progress] == sorted(p for p, _ in progress)
    wait_until(lambda: entry.health()["runners"][0]["active_requests"] == 0, 10, "the request cancelled")
    assert _tokens(middle, name) == split

    # kill -9 the middle stage process only: its node restarts it on the same port, the entry
    # reconnects, takes the (seeded) request over, and the instance stays where it is.
    listens = rf"stage \[{stages[1]['start_layer']}, {stages[1]['end_layer']}\) listens on (\S+)"
    (victim,) = _stage_processes(middle)
    seeded = stream(entry, name, SEEDED)
    assert_seamless(stream(entry, name, SEEDED, victim.kill), seeded)
    wait_until(lambda: len(re.findall(listens, "".join(middle.log))) == 2, 60, "the stage restarted")
    assert len(set(re.findall(listens, "".join(middle.log)))) == 1, "the stage moved to another port"
    assert _tokens(trio_nodes[0], name) == split
    assert [i["stages"] for i in _instances(entry) if i["id"] == instance_id] == [stages]

    # Again, but another program takes the port meanwhile: the stage restarts elsewhere, and the
    # entry follows it to the new port.
    (victim,) = _stage_processes(middle)
    host, port = re.findall(listens, "".join(middle.log))[-1].rsplit(":", 1)
    victim.kill()
    victim.wait(10)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((host, int(port)))
        squatter.listen()
        entry.wait_for_log(rf"moved from {host}:{port} to ", timeout=60)
        wait_until(lambda: _tokens(trio_nodes[0], name) == split, 60, "served through the moved stage")

    # kill -9 the middle node: the leader re-places the instance on the survivors, which take over.
    whole = stream(last, name, GREEDY)
    assert_seamless(stream(last, name, GREEDY, lambda: middle.process.send_signal(signal.SIGKILL)), whole)
    replaced = _wait_replaced_without([entry, last], middle)
    wait_until(lambda: _tokens(last, name) == split, 90, "the re-placed instance answering the same")
    assert len(replaced) == 1, replaced  # as few nodes as fit: the same tokens as from one node

    deleted = httpx.delete(f"{entry.base_url}/v1/instances/{instance_id}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    wait_until(lambda: all(n.health()["runners"] == [] for n in (entry, last)), 20, "runners stopped")
    wait_until(lambda: not _stage_processes(entry) and not _stage_processes(last), 20, "stages stopped")
