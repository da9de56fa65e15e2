"""Failover on real nodes: the node running a request's 1-stage instance is killed mid-stream, and
the client's stream goes on from the re-placed instance with the text an uninterrupted run gives;
with a bound shorter than any re-placement, it ends with the error instead.

(Stages killed or frozen mid-stream: tests/test_pipeline_instances.py; a killed runner on one node:
tests/test_runner_lifecycle.py; the same below the nodes: tests/test_failover.py.)
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.net.identity import load_or_create_identity, peer_id_of
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_instances import _instances
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

LONG = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 600}
"""Long enough that the kill lands mid-stream on any machine (the random model writes ~100 tok/s)."""


@dataclass
class Streamed:
    text: str = ""
    errors: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    done: bool = False


def stream(
    node: RunningNode,
    model: str,
    body: dict[str, Any],
    fail: Callable[[], None] | None = None,
    after: int = 3,
) -> Streamed:
    """Stream a chat completion from `node`, calling `fail` once `after` content chunks arrived.

    The read timeout only keeps a hang from lasting: failover's own bound (60 s by default, less in
    these tests) ends a stream that nobody takes over much sooner."""
    out = Streamed()
    chunks = 0
    request = {"model": model, "stream": True, **body}
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=request, timeout=90) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.errors.append(chunk["error"])
                continue
            for choice in chunk["choices"]:
                out.text += choice["delta"].get("content") or ""
                out.finish = choice.get("finish_reason") or out.finish
            chunks += 1
            if fail is not None and chunks == after:
                fail()
    return out


def assert_seamless(broken: Streamed, whole: Streamed) -> None:
    """The client saw no sign of the failure: the same text and end as an uninterrupted run."""
    assert not broken.errors, broken.errors
    assert broken.done and broken.finish == whole.finish
    assert broken.text == whole.text


def test_failover_within_its_bound_then_to_the_re_placed_instance(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """B holds the random model's 1-stage instance, A (the leader: the smaller id) holds none.

    1. A request entering at B runs on B's own runner, which is killed. B's bound (1 s) is shorter
       than a runner's restart (0.5 s of backoff, then a Python process with MLX starting), and B is
       the only entry: the stream ends with the runner's error, which names the bound.
    2. A request entering at A runs on B, and B is killed (kill -9): the leader re-places the
       instance on A, whose new runner takes the request over; the client's text is an
       uninterrupted run's, with no error.
    """
    name = random_model_dir.name
    dirs = sorted((tmp_path / "a", tmp_path / "b"), key=lambda d: peer_id_of(load_or_create_identity(d)))
    holder = start_node("--failover-timeout", "1", data_dir=dirs[1], model=str(random_model_dir))
    nodes = [holder]
    try:
        leader = start_node("--peer", holder.p2p_addr, data_dir=dirs[0], model=None)
        nodes.append(leader)
        wait_until(lambda: agreed_leader(nodes) == leader.node_id, 20, "A leading")
        wait_until(lambda: len(_instances(leader)) == 1, 30, "the instance known to A")

        runner = holder.runner_pid()
        seeded = {**LONG, "temperature": 0.8, "seed": 7}
        cut = stream(holder, name, seeded, lambda: os.kill(runner, signal.SIGKILL))
        assert cut.done and len(cut.errors) == 1, cut.errors
        assert cut.errors[0]["type"] == "server_error"
        assert "no instance took the request over within 1 s" in cut.errors[0]["message"]

        greedy = {**LONG, "temperature": 0}
        whole = stream(leader, name, greedy)  # waits for B's restarted runner
        assert not whole.errors and whole.finish == "length"
        broken = stream(leader, name, greedy, lambda: holder.process.send_signal(signal.SIGKILL))
        assert_seamless(broken, whole)
        leader.wait_for_log(rf"taken over by {leader.node_id} after \d+ tokens", timeout=5)
        assert [s["node_id"] for s in _instances(leader)[0]["stages"]] == [leader.node_id]
    finally:
        for node in nodes:
            node.stop()
