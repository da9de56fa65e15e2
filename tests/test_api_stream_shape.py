"""The streamed chat completion, read as raw SSE lines from a real node, follows OpenAI's rules exactly.

And the openai SDK parses both shapes; and a stream the client abandons or cancels ends its generation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.nodes import RunningNode, start_node
from tests.waiting import wait_until

CHAT = "/v1/chat/completions"
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colours."},
]
PREFILL = re.compile(r'^: prefill_progress \{"processed_tokens":(\d+),"total_tokens":(\d+)\}$')


def _body(model: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 12,
        "stream": True,
        **fields,
    }


@pytest.fixture(scope="module")
def model(random_node: RunningNode) -> str:
    assert random_node.model_id is not None
    return random_node.model_id


def _stream_lines(node: RunningNode, body: dict[str, Any]) -> list[str]:
    """Every non-blank line of one streamed completion."""
    with httpx.stream("POST", node.base_url + CHAT, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line]


@pytest.fixture(scope="module")
def sse_lines(random_node: RunningNode, model: str) -> list[str]:
    return _stream_lines(random_node, _body(model, stream_options={"include_usage": True}))


def _chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


def test_every_line_is_data_or_a_known_comment(sse_lines: list[str]) -> None:
    for line in sse_lines:
        assert line.startswith("data: ") or PREFILL.match(line) or line == ": keep-alive", line
    assert sse_lines[-1] == "data: [DONE]"
    assert sse_lines.count("data: [DONE]") == 1


def test_one_id_and_chunk_header(sse_lines: list[str], model: str) -> None:
    chunks = _chunks(sse_lines)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert len({chunk["created"] for chunk in chunks}) == 1
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert {chunk["model"] for chunk in chunks} == {model}


def test_role_first_and_finish_reason_only_last(sse_lines: list[str]) -> None:
    choices = [chunk["choices"][0] for chunk in _chunks(sse_lines) if chunk["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    assert all("role" not in choice["delta"] for choice in choices[1:])
    assert all(choice["finish_reason"] is None for choice in choices[:-1])
    assert choices[-1]["finish_reason"] in ("stop", "length")
    assert all(choice["index"] == 0 for choice in choices)


def test_usage_chunk_comes_last(sse_lines: list[str]) -> None:
    chunks = _chunks(sse_lines)
    assert sse_lines[-2].startswith("data: {")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 12
    assert all("usage" not in chunk for chunk in chunks[:-1])
    if chunks[-2]["choices"][0]["finish_reason"] == "length":
        assert usage["completion_tokens"] == 12


def test_prefill_progress_comments(sse_lines: list[str]) -> None:
    progress = [(int(m[1]), int(m[2])) for line in sse_lines if (m := PREFILL.match(line))]
    assert progress, "no prefill progress comment"
    assert [processed for processed, _ in progress] == sorted(processed for processed, _ in progress)
    assert all(0 <= processed <= total for processed, total in progress)
    # The prompt is processed before any token: the comments sit between the role chunk and the next one.
    data = [i for i, line in enumerate(sse_lines) if line.startswith("data: ")]
    assert all(data[0] < i < data[1] for i, line in enumerate(sse_lines) if PREFILL.match(line))


def test_no_usage_chunk_without_include_usage(random_node: RunningNode, model: str) -> None:
    with httpx.stream("POST", random_node.base_url + CHAT, json=_body(model), timeout=120) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(chunk["choices"] and "usage" not in chunk for chunk in _chunks(lines))


def test_openai_sdk_parses_stream_and_completion(random_node: RunningNode, model: str) -> None:
    client = openai.OpenAI(base_url=f"{random_node.base_url}/v1", api_key="x", timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
    )
    assert completion.object == "chat.completion"
    message = completion.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens >= 1

    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed_usage, whole = chunks[-1].usage, completion.usage
    assert chunks[-1].choices == [] and streamed_usage is not None and whole is not None
    # (cached_tokens differ: the second request reuses the first one's prefix.)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(streamed_usage, c) for c in counts] == [getattr(whole, c) for c in counts]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == message.content, "greedy decoding gave a different answer streamed"
    assert chunks[-2].choices[0].finish_reason == completion.choices[0].finish_reason


def _active_requests(node: RunningNode) -> int:
    return sum(runner["active_requests"] for runner in node.health()["runners"])


def _wait_idle(node: RunningNode, what: str) -> None:
    wait_until(lambda: _active_requests(node) == 0, 10, what)


def test_abandoned_stream_ends_its_generation(random_node: RunningNode, model: str) -> None:
    body = _body(model, max_tokens=1500)
    cancelled = random_node.health()["runners"][0]["cancelled"]
    with httpx.stream("POST", random_node.base_url + CHAT, json=body, timeout=120) as response:
        lines = response.iter_lines()  # held: a dropped line iterator would close the response early
        content = (line for line in lines if '"content":"' in line and '"role"' not in line)
        for _ in range(20):
            next(content)
        assert _active_requests(random_node) == 1
    # Leaving the block mid-stream drops the connection: the runner stops the generation and says it
    # was cancelled (rather than finishing the remaining ~1,480 tokens).
    _wait_idle(random_node, "the abandoned generation ended")
    assert random_node.health()["runners"][0]["cancelled"] == cancelled + 1


def test_cancel_endpoint_ends_the_stream(random_node: RunningNode, model: str) -> None:
    body = _body(model, max_tokens=1500)
    with (
        httpx.Client(base_url=random_node.base_url, timeout=120) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        lines = response.iter_lines()
        completion_id = next(json.loads(line[6:])["id"] for line in lines if line.startswith("data: {"))
        cancelled = http.post(f"/v1/cancel/{completion_id}")
        assert cancelled.status_code == 200
        assert cancelled.json() == {"id": completion_id, "cancelled": True}
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2][6:])["choices"][0]
    assert finish["finish_reason"] == "stop"
    _wait_idle(random_node, "the cancelled generation ended")


def test_plain_mlx_node_keeps_a_quiet_stream_alive(
    random_model_dir: Path, model: str, tmp_path: Path
) -> None:
    """`--no-fast-path` runs plain MLX (tests/test_fastpath.py shows it answers the same);
    `--sse-keepalive` fills the quiet while a long prompt is read with comments that SDKs ignore
    (how many, on trio's mock clock: tests/test_api_keepalive.py)."""
    flags = ("--no-fast-path", "--sse-keepalive", "0.01", "--prefill-step-size", "4096")
    long_prompt = [{"role": "user", "content": "lighthouse " * 1500}]
    body = _body(model, messages=long_prompt, stream_options={"include_usage": True})
    node = start_node(*flags, data_dir=tmp_path, model=str(random_model_dir))
    try:
        node.wait_for_log("fast CPU path off: disabled by configuration", timeout=5)
        lines = _stream_lines(node, body)
    finally:
        node.stop()
    # The role chunk goes out first; reading 1,500 tokens in one chunk is quiet for far over 10 ms.
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert any(line == ": keep-alive" for line in lines[data[0] : data[1]]), lines[:12]
    assert lines[-1] == "data: [DONE]" and len(_chunks(lines)) >= 12
