"""The runner under stress: SIGKILL mid-stream, cancel, prefill progress, Ctrl-C.

(A client disconnect is tested in test_api_stream_shape.py.)
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.nodes import RunningNode, start_node
from tests.test_failover_nodes import assert_seamless, stream
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    node = start_node(
        "--prefill-step-size", "64", data_dir=tmp_path_factory.mktemp("data"), model=str(random_model_dir)
    )
    yield node
    node.stop()


def _body(node: RunningNode, content: str = "Tell me a long story.", **extra: object) -> dict[str, object]:
    return {
        "model": node.model_id,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }


def _data(line: str) -> dict[str, Any] | None:
    return json.loads(line[6:]) if line.startswith("data: {") else None


def _has_content(line: str) -> bool:
    chunk = _data(line)
    return bool(chunk and any(c["delta"].get("content") for c in chunk.get("choices", [])))


def _idle_runner(node: RunningNode) -> dict[str, Any]:
    """The runner's health once it reports no active request (its own terminal event), else {}."""
    health: dict[str, Any] = node.health()["runners"][0]
    return health if health["active_requests"] == 0 else {}


def _finish_reasons(lines: list[str]) -> list[str]:
    return [
        choice["finish_reason"]
        for line in lines
        if (chunk := _data(line))
        for choice in chunk.get("choices", [])
        if choice.get("finish_reason")
    ]


def test_sigkill_of_runner_mid_stream_is_failed_over_to_its_restart(node: RunningNode) -> None:
    """The node restarts the runner, and failover resumes the stream there: the client gets the text
    of an uninterrupted run and no error (`node.serving.failover`)."""
    before = node.health()["runners"][0]
    pid = before["pid"]
    body = _body(node, stream=True, max_tokens=300)
    whole = stream(node, str(node.model_id), body)
    broken = stream(node, str(node.model_id), body, lambda: os.kill(pid, signal.SIGKILL))
    assert_seamless(broken, whole)
    node.wait_for_log(r"request \S+ taken over by \S+ after \d+ tokens", timeout=10)
    health = node.health()["runners"][0]
    assert (
        health["pid"] != pid and health["restarts"] == before["restarts"] + 1 and health["state"] == "ready"
    )


def test_cancel_endpoint_stops_generation(node: RunningNode) -> None:
    """No max_tokens: only the cancel ends the stream before the context is full ("length")."""
    cancelled = node.health()["runners"][0]["cancelled"]
    with httpx.stream(
        "POST", f"{node.base_url}/v1/chat/completions", json=_body(node, stream=True), timeout=10
    ) as r:
        lines = r.iter_lines()
        first = next(chunk for line in lines if (chunk := _data(line)))
        cancel = httpx.post(f"{node.base_url}/v1/cancel/{first['id']}", timeout=5)
        assert cancel.status_code == 200, cancel.text
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert _finish_reasons(rest) == ["stop"]  # OpenAI has no "cancelled"
    runner = wait_until(lambda: _idle_runner(node), 60, "the runner idle after the cancel")
    assert runner["cancelled"] == cancelled + 1  # the runner's generation ended as cancelled
    unknown = httpx.post(f"{node.base_url}/v1/cancel/{first['id']}", timeout=5)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"


def test_long_prompt_streams_prefill_progress_before_first_token(node: RunningNode) -> None:
    prompt = " ".join(f"word{i}" for i in range(300))
    body = _body(node, prompt, stream=True, max_tokens=3, stream_options={"include_usage": True})
    progress: list[tuple[int, int]] = []
    usage = None
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(": prefill_progress "):
                figures = json.loads(line.removeprefix(": prefill_progress "))
                progress.append((figures["processed_tokens"], figures["total_tokens"]))
            elif _has_content(line):
                assert progress and progress[-1][0] == progress[-1][1], "a token came before prefill ended"
            elif (chunk := _data(line)) and chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None
    total = usage["prompt_tokens"]
    assert total > 600 and len(progress) >= total // 64
    assert all(t == total for _, t in progress)
    processed = [p for p, _ in progress]
    assert processed == sorted(set(processed)) and processed[0] == 0 and processed[-1] == total

    # The openai SDK ignores the comment lines.
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(**body))  # type: ignore[call-overload]
    assert chunks[-1].usage.prompt_tokens == total


def test_ctrl_c_stops_node_and_its_runner(random_model_dir: Path, tmp_path: Path) -> None:
    """SIGINT: the node exits 0 by itself (`stop` kills it only after the timeout), its runner gone."""
    other = start_node(data_dir=tmp_path, model=str(random_model_dir))
    runner_pid = other.runner_pid()
    assert other.stop(timeout=60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(runner_pid, 0)


def test_a_runner_whose_node_was_killed_mid_stream_exits_quietly(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of the node while its runner streams: the runner ends at once (on Linux the kernel
    kills it, `node.children`; elsewhere it notices its pipes close and exits with one log line),
    without a traceback, instead of computing for nobody."""
    other = start_node(data_dir=tmp_path, model=str(random_model_dir))
    runner = psutil.Process(other.runner_pid())
    body = _body(other, max_tokens=1500, stream=True)
    with httpx.stream("POST", f"{other.base_url}/v1/chat/completions", json=body, timeout=30) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += _has_content(line)
            if chunks == 3:
                before = len(other.log)
                other.process.kill()
                break
    gone, _ = psutil.wait_procs([runner], timeout=10)
    assert gone, "the runner outlived its node"
    other.process.wait(5)
    other.wait_output_closed(5)
    after = "".join(other.log[before:])
    assert "Traceback" not in after, after[-2000:]
