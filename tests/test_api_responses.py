"""`POST /v1/responses` on a real node, through the openai SDK and as raw SSE.

Plain and streamed answers agree at temperature 0, a length stop ends "incomplete", bad bodies get
a 4xx in OpenAI's error shape naming the field, a stream the client drops cancels its generation,
and a long prompt's progress comments leave the SDK's parsing untouched. (Tool calls and reasoning,
which the random-weight model never produces, are in tests/test_responses_encode.py.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.responses import Response

from tests.nodes import RunningNode
from tests.waiting import wait_until

RESPONSES = "/v1/responses"
QUESTION = "Name three colours."
INSTRUCTIONS = "Be brief."
PREFILL = re.compile(r'^: prefill_progress \{"processed_tokens":(\d+),"total_tokens":(\d+)\}$')
TEXT_ANSWER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def model(random_node: RunningNode) -> str:
    assert random_node.model_id is not None
    return random_node.model_id


def _client(node: RunningNode, http: httpx2.Client | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{node.base_url}/v1", api_key="x", max_retries=0, timeout=120, http_client=http
    )


@pytest.fixture(scope="module")
def client(random_node: RunningNode) -> openai.OpenAI:
    return _client(random_node)


def _ask(model: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": model,
        "input": QUESTION,
        "instructions": INSTRUCTIONS,
        "temperature": 0,
        "max_output_tokens": 12,
        **fields,
    }


@pytest.fixture(scope="module")
def plain(client: openai.OpenAI, model: str) -> Response:
    return client.responses.create(**_ask(model))


def test_plain_answer(plain: Response, model: str) -> None:
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == model
    assert plain.status in ("completed", "incomplete")
    [message] = plain.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert plain.output_text and [part.type for part in message.content] == ["output_text"]
    assert (plain.instructions, plain.temperature, plain.max_output_tokens) == (INSTRUCTIONS, 0, 12)
    usage = plain.usage
    assert usage is not None and usage.input_tokens > 0 and 1 <= usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if plain.status == "incomplete":
        assert usage.output_tokens == 12


def test_streamed_answer_is_the_plain_one(client: openai.OpenAI, model: str, plain: Response) -> None:
    events = list(client.responses.create(**_ask(model), stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[: len(TEXT_ANSWER)] == TEXT_ANSWER
    assert kinds[-4:] == [*TEXT_END, f"response.{plain.status}"]
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == plain.output_text, "greedy decoding gave a different answer streamed"
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert final.output_text == plain.output_text and final.status == plain.status
    # (cached_tokens differ: the second request reuses the first one's prefix.)
    assert final.usage is not None and plain.usage is not None
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [getattr(final.usage, c) for c in counts] == [getattr(plain.usage, c) for c in counts]
    assert len({event.response.id for event in events if hasattr(event, "response")}) == 1


def test_raw_stream_is_named_events_and_comments(random_node: RunningNode, model: str) -> None:
    with httpx.stream(
        "POST", random_node.base_url + RESPONSES, json=_ask(model, stream=True), timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [event["type"] for event in data] == names and "[DONE]" not in lines
    comments = [line for line in lines if line.startswith(":")]
    assert all(PREFILL.match(line) or line == ": keep-alive" for line in comments), comments
    assert len(names) + len(data) + len(comments) == len(lines)
    # The prompt is read before any token: progress comes between `in_progress` and the first item.
    first_item = lines.index("event: response.output_item.added")
    assert all(lines.index(line) < first_item for line in comments if PREFILL.match(line))


def test_length_stop_is_incomplete(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(**_ask(model, max_output_tokens=3))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert [item.status for item in response.output] == ["incomplete"]
    with client.responses.stream(**_ask(model, max_output_tokens=3)) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == response.output_text


def test_input_items_and_token_count(client: openai.OpenAI, model: str, plain: Response) -> None:
    """The string input with instructions is the same prompt as these two message items."""
    items: Any = [
        {"role": "system", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    as_items = client.responses.create(**_ask(model, input=items, instructions=None))
    assert as_items.output_text == plain.output_text
    assert as_items.usage is not None and plain.usage is not None
    assert as_items.usage.input_tokens == plain.usage.input_tokens
    count = client.responses.input_tokens.count(model=model, input=QUESTION, instructions=INSTRUCTIONS)
    assert count.object == "response.input_tokens"
    assert plain.usage is not None and count.input_tokens == plain.usage.input_tokens


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="no-such-model", input="hi")
    assert (raised.value.code, raised.value.param) == ("model_not_found", "model")


def _small(model: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A valid small request with `fields` replacing or adding keys; a value of `...` removes the key."""
    body = {"model": model, "input": "hi", "max_output_tokens": 4, **fields}
    return {key: value for key, value in body.items() if value is not ...}


@dataclass(frozen=True)
class Bad:
    """A body (`_small` with `fields`) or raw `content`, and the error it must get."""

    name: str
    code: str | None
    param: str | None
    fields: dict[str, Any] = field(default_factory=dict)
    status: int = 400
    content: bytes | None = None

    def body(self, model: str) -> dict[str, Any] | None:
        return None if self.content is not None else _small(model, self.fields)


MISSING, TYPE, VALUE, UNSUPPORTED = (
    "missing_required_parameter",
    "invalid_type",
    "invalid_value",
    "unsupported_value",
)
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
IMAGE = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
CALL = {"type": "function_call", "name": "f", "arguments": "{}"}
CASES = [
    Bad("malformed JSON", "invalid_json", None, content=b'{"model": "x", "input": ['),
    Bad("body not an object", TYPE, None, content=b'["model", "input"]'),
    Bad("missing model", MISSING, "model", {"model": ...}),
    Bad("missing input", MISSING, "input", {"input": ...}),
    Bad("input is a number", TYPE, "input", {"input": 42}),
    Bad("empty input", VALUE, "input", {"input": []}),
    Bad("item not an object", TYPE, "input[0]", {"input": ["hi"]}),
    Bad("unknown item type", UNSUPPORTED, "input[1].type", {"input": [USER, {"type": "x"}]}),
    Bad("item_reference", UNSUPPORTED, "input[0].type", {"input": [{"type": "item_reference", "id": "m"}]}),
    Bad("unknown role", VALUE, "input[0].role", {"input": [{"role": "tool", "content": "x"}]}),
    Bad("message without role", MISSING, "input[0].role", {"input": [{"content": "x"}]}),
    Bad("message without content", MISSING, "input[0].content", {"input": [{"role": "user"}]}),
    Bad("content is a number", TYPE, "input[0].content", {"input": [{"role": "user", "content": 1}]}),
    Bad("image part", UNSUPPORTED, "input[0].content[0].type", {"input": [IMAGE]}),
    Bad("function_call without call_id", MISSING, "input[1].call_id", {"input": [USER, CALL]}),
    Bad(
        "function_call_output without output",
        MISSING,
        "input[1].output",
        {"input": [USER, {"type": "function_call_output", "call_id": "c"}]},
    ),
    Bad("hosted tool", UNSUPPORTED, "tools[1].type", {"tools": [TOOL, {"type": "web_search"}]}),
    Bad("function tool without name", MISSING, "tools[0].name", {"tools": [{"type": "function"}]}),
    Bad("tool_choice is not a mode", VALUE, "tool_choice", {"tool_choice": "sometimes"}),
    Bad("tool_choice hosted", VALUE, "tool_choice", {"tool_choice": {"type": "web_search"}}),
    Bad("tool_choice required without tools", VALUE, "tool_choice", {"tool_choice": "required"}),
    Bad(
        "tool_choice names a function not in tools",
        VALUE,
        "tool_choice",
        {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
    ),
    Bad("temperature above 2", VALUE, "temperature", {"temperature": 2.5}),
    Bad("temperature is a string", TYPE, "temperature", {"temperature": "hot"}),
    Bad("top_p of 0", VALUE, "top_p", {"top_p": 0}),
    Bad("max_output_tokens of 0", VALUE, "max_output_tokens", {"max_output_tokens": 0}),
    Bad("stream is a string", TYPE, "stream", {"stream": "yes"}),
    Bad(
        "previous_response_id", "unsupported_parameter", "previous_response_id", {"previous_response_id": "r"}
    ),
    Bad("conversation", "unsupported_parameter", "conversation", {"conversation": "conv_1"}),
    Bad("background", UNSUPPORTED, "background", {"background": True}),
    Bad("structured output", VALUE, "text.format.type", {"text": {"format": {"type": "json_object"}}}),
    Bad("unknown model", "model_not_found", "model", {"model": "no-such-model"}, status=404),
    Bad("prompt longer than the context", "context_length_exceeded", "input", {"input": "word " * 3000}),
    Bad(
        "max_output_tokens beyond the context, streamed",
        "context_length_exceeded",
        "input",
        {"max_output_tokens": 100_000, "stream": True},
    ),
    Bad(
        "body too large",
        "request_too_large",
        None,
        status=413,
        content=b"{" + b" " * (9 * 1024 * 1024) + b"}",
    ),
]


@pytest.fixture(scope="module")
def http(random_node: RunningNode) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=random_node.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("bad", CASES, ids=[case.name for case in CASES])
def test_bad_request(http: httpx.Client, model: str, bad: Bad) -> None:
    response = http.post(RESPONSES, json=bad.body(model), content=bad.content)
    assert response.status_code == bad.status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", bad.code, bad.param)
    assert error["message"]


def test_accepted_extras_still_answer(http: httpx.Client, model: str) -> None:
    """Fields Shoal accepts without acting on them (`store` is answered false: nothing is kept)."""
    accepted = {
        "store": True,
        "user": "me",
        "include": [],
        "reasoning": {"effort": "low"},
        "truncation": "auto",
    }
    fields = {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False, "metadata": {"k": "v"}}
    response = http.post(RESPONSES, json=_small(model, {**fields, **accepted}))
    assert response.status_code == 200, response.text
    answer = Response.model_validate(response.json())
    assert answer.status in ("completed", "incomplete") and answer.model_extra == {"store": False}
    assert [tool.type for tool in answer.tools] == ["function"] and answer.metadata == {"k": "v"}


def _active_requests(node: RunningNode) -> int:
    return sum(runner["active_requests"] for runner in node.health()["runners"])


def test_dropped_stream_cancels_its_generation(
    random_node: RunningNode, client: openai.OpenAI, model: str
) -> None:
    cancelled = random_node.health()["runners"][0]["cancelled"]
    with client.responses.create(**_ask(model, max_output_tokens=1500), stream=True) as stream:
        deltas = (event for event in stream if event.type == "response.output_text.delta")
        for _ in range(20):
            next(deltas)
        assert _active_requests(random_node) == 1
    wait_until(lambda: _active_requests(random_node) == 0, 10, "the dropped generation ended")
    assert random_node.health()["runners"][0]["cancelled"] == cancelled + 1


def test_cancel_by_response_id(random_node: RunningNode, http: httpx.Client, model: str) -> None:
    with http.stream("POST", RESPONSES, json=_ask(model, max_output_tokens=1500, stream=True)) as response:
        lines = response.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        response_id = created["response"]["id"]
        assert http.post(f"/v1/cancel/{response_id}").json() == {"id": response_id, "cancelled": True}
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: ")][-1]
    assert last["type"] == "response.completed" and last["response"]["id"] == response_id
    wait_until(lambda: _active_requests(random_node) == 0, 10, "the cancelled generation ended")


class _Recording(httpx2.BaseTransport):
    """The SDK's real transport, keeping a copy of every response byte the SDK reads."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        return httpx2.Response(
            response.status_code, headers=response.headers, stream=_Tee(response.stream, self.raw)
        )


class _Tee(httpx2.SyncByteStream):
    def __init__(self, inner: Any, sink: bytearray) -> None:
        self._inner, self._sink = inner, sink

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._sink += chunk
            yield chunk

    def close(self) -> None:
        self._inner.close()


def test_long_prompt_streams_progress_the_sdk_skips(random_node: RunningNode, model: str) -> None:
    recording = _Recording()
    client = _client(random_node, httpx2.Client(transport=recording, timeout=120))
    long_input = "lighthouse " * 1200
    with client.responses.stream(**_ask(model, input=long_input, max_output_tokens=4)) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:4] == TEXT_ANSWER[:4] and kinds[-1] == "response.incomplete"
    lines = recording.raw.decode().splitlines()
    progress = [(int(m[1]), int(m[2])) for line in lines if (m := PREFILL.match(line))]
    assert len(progress) >= 3, "a prompt of several prefill chunks reports each"
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)
    assert progress[-1][0] == progress[-1][1] > 1200
