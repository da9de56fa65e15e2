"""`POST /v1/messages` and `/v1/messages/count_tokens` against a real node, with the `anthropic` SDK.

Plain and streamed answers agree at temperature 0 (the SDK has no `temperature` argument any more:
it goes in `extra_body`); stops, usage and counts are Anthropic's; every bad request is a 4xx in
Anthropic's error shape; an abandoned stream cancels its generation; a long prompt streams prefill
progress comments that the SDK skips. Tool calls and thinking, which the random model never
produces, are in tests/test_messages_encode.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import Message, MessageParam

from tests.nodes import RunningNode
from tests.waiting import wait_until

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
SYSTEM = "Be brief."
QUESTION: list[MessageParam] = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}
HEADERS = {"x-api-key": "x", "anthropic-version": "2023-06-01", "anthropic-beta": "none"}
PREFILL = re.compile(r'^: prefill_progress \{"processed_tokens":(\d+),"total_tokens":(\d+)\}$')


@pytest.fixture(scope="module")
def model(random_node: RunningNode) -> str:
    assert random_node.model_id is not None
    return random_node.model_id


@pytest.fixture(scope="module")
def client(random_node: RunningNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=random_node.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(client: anthropic.Anthropic, model: str) -> Message:
    return client.messages.create(
        model=model, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY
    )


def _text(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_plain_answer(plain: Message, model: str) -> None:
    assert plain.id.startswith("msg_") and plain.type == "message" and plain.role == "assistant"
    assert plain.model == model
    assert [block.type for block in plain.content] == ["text"] and _text(plain)
    # Twelve tokens of random weights never end the turn: the cut says so.
    assert (plain.stop_reason, plain.stop_sequence) == ("max_tokens", None)
    usage = plain.usage
    assert usage.output_tokens == 12
    assert usage.input_tokens >= 1 and usage.cache_creation_input_tokens == 0


def test_streams_give_the_plain_answer(client: anthropic.Anthropic, model: str, plain: Message) -> None:
    request: dict[str, Any] = {
        "model": model,
        "max_tokens": 12,
        "system": SYSTEM,
        "messages": QUESTION,
        "extra_body": GREEDY,
    }
    with client.messages.stream(**request) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == _text(final) == _text(plain), "greedy decoding gave a different answer streamed"
    assert final.id.startswith("msg_") and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12

    events = list(client.messages.create(stream=True, **request))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == [
        "content_block_start",
        *["content_block_delta"] * (len(kinds) - 5),
        "content_block_stop",
    ]
    deltas = [
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ]
    assert "".join(deltas) == _text(plain)
    end = events[-2]
    assert (
        end.type == "message_delta"
        and end.delta.stop_reason == "max_tokens"
        and end.usage.output_tokens == 12
    )
    # The prompt is counted at the end (message_start says 0), whole though the prefix cache had it.
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == 0
    assert (end.usage.input_tokens, end.usage.cache_read_input_tokens) == (plain.usage.input_tokens, 0)


def test_stop_sequence(client: anthropic.Anthropic, model: str, plain: Message) -> None:
    text = _text(plain)
    words = text.split()
    stop = words[len(words) // 2]
    answer = client.messages.create(
        model=model, max_tokens=12, system=SYSTEM, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY
    )
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
    assert _text(answer) == text[: text.index(stop)]
    assert answer.usage.output_tokens < 12


def test_count_tokens_is_the_prompt_of_a_real_answer(
    client: anthropic.Anthropic, model: str, plain: Message
) -> None:
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == plain.usage.input_tokens
    # A tool round trip goes through the runner's template too (SmolLM2's shows no tool list).
    round_trip: list[MessageParam] = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "colours", "input": {"n": 3}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "red"}]},
    ]
    longer = client.messages.count_tokens(
        model=model,
        system=SYSTEM,
        messages=round_trip,
        tools=[{"name": "colours", "input_schema": {"type": "object"}}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert longer.input_tokens > counted.input_tokens


def test_unknown_model_is_the_sdks_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert raised.value.status_code == 404
    assert isinstance(raised.value.body, dict) and raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=QUESTION)


Body = Callable[[str], dict[str, Any]]


def body(**fields: Any) -> Body:
    """A valid request with `fields` replacing or adding keys; a value of `...` removes the key."""

    def build(model: str) -> dict[str, Any]:
        request = {"model": model, "max_tokens": 4, "messages": QUESTION, **fields}
        return {key: value for key, value in request.items() if value is not ...}

    return build


TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


@dataclass(frozen=True)
class Bad:
    name: str
    status: int
    type: str
    mentions: str
    """A word the message must contain: the field or the problem."""
    json: Body | None = None
    content: bytes | None = None
    path: str = MESSAGES


CASES = [
    Bad("malformed JSON", 400, "invalid_request_error", "JSON", content=b'{"model": "x", "messages": ['),
    Bad("body not an object", 400, "invalid_request_error", "object", content=b'["model"]'),
    Bad("missing max_tokens", 400, "invalid_request_error", "max_tokens", json=body(max_tokens=...)),
    Bad("max_tokens of 0", 400, "invalid_request_error", "max_tokens", json=body(max_tokens=0)),
    Bad("max_tokens a string", 400, "invalid_request_error", "max_tokens", json=body(max_tokens="4")),
    Bad("missing messages", 400, "invalid_request_error", "messages", json=body(messages=...)),
    Bad("empty messages", 400, "invalid_request_error", "messages", json=body(messages=[])),
    Bad(
        "system role in messages",
        400,
        "invalid_request_error",
        "messages[0].role",
        json=body(messages=[{"role": "system", "content": "hi"}]),
    ),
    Bad(
        "content a number",
        400,
        "invalid_request_error",
        "messages[0].content",
        json=body(messages=[{"role": "user", "content": 42}]),
    ),
    Bad(
        "image block",
        400,
        "invalid_request_error",
        "image",
        json=body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
    ),
    Bad(
        "tool_use in a user turn",
        400,
        "invalid_request_error",
        "messages[0].content[0]",
        json=body(
            messages=[
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        ),
    ),
    Bad(
        "final assistant turn (prefill)",
        400,
        "invalid_request_error",
        "prefill",
        json=body(messages=[*QUESTION, {"role": "assistant", "content": "Red,"}]),
    ),
    Bad("system a number", 400, "invalid_request_error", "system", json=body(system=7)),
    Bad("temperature a string", 400, "invalid_request_error", "temperature", json=body(temperature="hot")),
    Bad("temperature above 1", 400, "invalid_request_error", "temperature", json=body(temperature=1.5)),
    Bad("top_k negative", 400, "invalid_request_error", "top_k", json=body(top_k=-1)),
    Bad(
        "stop_sequences a string",
        400,
        "invalid_request_error",
        "stop_sequences",
        json=body(stop_sequences="x"),
    ),
    Bad("stream a string", 400, "invalid_request_error", "stream", json=body(stream="yes")),
    Bad(
        "tool without input_schema",
        400,
        "invalid_request_error",
        "input_schema",
        json=body(tools=[{"name": "f"}]),
    ),
    Bad(
        "server tool",
        400,
        "invalid_request_error",
        "tools[0].type",
        json=body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    ),
    Bad(
        "tool_choice of unknown type",
        400,
        "invalid_request_error",
        "tool_choice",
        json=body(tool_choice={"type": "x"}),
    ),
    Bad("tool_choice a string", 400, "invalid_request_error", "tool_choice", json=body(tool_choice="auto")),
    Bad(
        "tool_choice any without tools",
        400,
        "invalid_request_error",
        "tool_choice",
        json=body(tool_choice={"type": "any"}),
    ),
    Bad(
        "tool_choice names no tool",
        400,
        "invalid_request_error",
        "tool_choice.name",
        json=body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}),
    ),
    Bad(
        "thinking budget below 1024",
        400,
        "invalid_request_error",
        "budget_tokens",
        json=body(thinking={"type": "enabled", "budget_tokens": 100}),
    ),
    Bad(
        "thinking of unknown type",
        400,
        "invalid_request_error",
        "thinking.type",
        json=body(thinking={"type": "on"}),
    ),
    Bad("unknown model", 404, "not_found_error", "no-such-model", json=body(model="no-such-model")),
    Bad(
        "prompt longer than the context",
        400,
        "invalid_request_error",
        "context",
        json=body(messages=[{"role": "user", "content": "word " * 3000}]),
    ),
    Bad(
        "max_tokens beyond the context, streamed",
        400,
        "invalid_request_error",
        "max_tokens",
        json=body(max_tokens=100_000, stream=True),
    ),
    Bad("body too large", 413, "request_too_large", "bytes", content=b"{" + b" " * (9 * 1024 * 1024) + b"}"),
    Bad(
        "count: missing messages",
        400,
        "invalid_request_error",
        "messages",
        json=body(messages=...),
        path=COUNT,
    ),
    Bad("count: unknown model", 404, "not_found_error", "model", json=body(model="nope"), path=COUNT),
]


@pytest.fixture(scope="module")
def http(random_node: RunningNode) -> httpx.Client:
    return httpx.Client(base_url=random_node.base_url, timeout=60, headers=HEADERS)


@pytest.mark.parametrize("bad", CASES, ids=[case.name for case in CASES])
def test_bad_request(http: httpx.Client, model: str, bad: Bad) -> None:
    request = bad.json(model) if bad.json is not None else None
    response = http.post(bad.path, json=request, content=bad.content)
    assert response.status_code == bad.status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == bad.type
    assert bad.mentions in error["error"]["message"], error


def _active_requests(node: RunningNode) -> int:
    return sum(runner["active_requests"] for runner in node.health()["runners"])


def test_abandoned_stream_cancels_its_generation(
    http: httpx.Client, random_node: RunningNode, model: str
) -> None:
    cancelled = random_node.health()["runners"][0]["cancelled"]
    request = body(max_tokens=1500, stream=True, **GREEDY)(model)
    with http.stream("POST", MESSAGES, json=request) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped line iterator would close the response early
        deltas = (line for line in lines if line == "event: content_block_delta")
        for _ in range(20):
            next(deltas)
        assert _active_requests(random_node) == 1
    wait_until(lambda: _active_requests(random_node) == 0, 10, "the abandoned generation ended")
    assert random_node.health()["runners"][0]["cancelled"] == cancelled + 1


def test_long_prompt_streams_progress_the_sdk_skips(http: httpx.Client, model: str) -> None:
    long_prompt = [{"role": "user", "content": "harbour " * 1500}]
    with http.stream("POST", MESSAGES, json=body(messages=long_prompt, stream=True)(model)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    lines = [line for line in raw.decode().splitlines() if line]
    progress = [(int(m[1]), int(m[2])) for line in lines if (m := PREFILL.match(line))]
    assert len(progress) >= 3, lines[:8]  # 1,500 tokens read 512 at a time
    assert progress[-1][0] == progress[-1][1] and sorted(progress) == progress
    # Between message_start and the first block: the prompt is read before any token.
    first_block = lines.index("event: content_block_start")
    assert all(2 <= i < first_block for i, line in enumerate(lines) if PREFILL.match(line))

    # The SDK parses the very bytes the node sent, comments and all.
    replay = httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)
    transport = httpx2.Client(transport=httpx2.MockTransport(lambda request: replay))
    sdk = anthropic.Anthropic(base_url="http://node", api_key="x", max_retries=0, http_client=transport)
    with sdk.messages.stream(model=model, max_tokens=4, messages=QUESTION) as stream:
        message = stream.get_final_message()
    sent = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    texts = [e["delta"]["text"] for e in sent if e["type"] == "content_block_delta"]
    assert _text(message) == "".join(texts) and message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens == sent[-2]["usage"]["output_tokens"]
