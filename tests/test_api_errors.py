"""Every bad request gets a 4xx in OpenAI's error shape that names the problem; the node keeps serving.

Runs against a real node (`random_node`): the table goes over HTTP, through hypercorn, Starlette, the
API's validation and, for the context-length rows, the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.nodes import RunningNode

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

Body = Callable[[str], dict[str, Any]]
"""A request body built from the node's model id."""


def chat(**fields: Any) -> Body:
    """A valid chat body with `fields` replacing or adding keys; a value of `...` removes the key."""

    def build(model: str) -> dict[str, Any]:
        body = {"model": model, "messages": HELLO, "max_tokens": 4, **fields}
        return {key: value for key, value in body.items() if value is not ...}

    return build


@dataclass(frozen=True)
class Bad:
    name: str
    status: int
    code: str | None
    param: str | None
    json: Body | None = None
    content: bytes | None = None
    method: str = "POST"
    path: str = CHAT
    type: str = "invalid_request_error"


CASES = [
    Bad("malformed JSON", 400, "invalid_json", None, content=b'{"model": "x", "messages": ['),
    Bad("body not an object", 400, "invalid_type", None, content=b'["model", "messages"]'),
    Bad("missing model", 400, "missing_required_parameter", "model", json=chat(model=...)),
    Bad("missing messages", 400, "missing_required_parameter", "messages", json=chat(messages=...)),
    Bad("unknown model", 404, "model_not_found", "model", json=chat(model="no-such-model")),
    Bad("empty messages", 400, "invalid_value", "messages", json=chat(messages=[])),
    Bad(
        "unknown role",
        400,
        "invalid_value",
        "messages[0].role",
        json=chat(messages=[{"role": "robot", "content": "hi"}]),
    ),
    Bad(
        "content is a number",
        400,
        "invalid_type",
        "messages[0].content",
        json=chat(messages=[{"role": "user", "content": 42}]),
    ),
    Bad(
        "image content part",
        400,
        "invalid_value",
        "messages[0].content[0].type",
        json=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ),
    Bad(
        "user message without content",
        400,
        "missing_required_parameter",
        "messages[0].content",
        json=chat(messages=[{"role": "user"}]),
    ),
    Bad(
        "tool message without tool_call_id",
        400,
        "missing_required_parameter",
        "messages[1].tool_call_id",
        json=chat(messages=[*HELLO, {"role": "tool", "content": "sunny"}]),
    ),
    Bad("temperature is a string", 400, "invalid_type", "temperature", json=chat(temperature="hot")),
    Bad("temperature above 2", 400, "invalid_value", "temperature", json=chat(temperature=2.5)),
    Bad("top_p of 0", 400, "invalid_value", "top_p", json=chat(top_p=0)),
    Bad("min_p above 1", 400, "invalid_value", "min_p", json=chat(min_p=1.5)),
    Bad("min_p is a string", 400, "invalid_type", "min_p", json=chat(min_p="low")),
    Bad("top_k below 0", 400, "invalid_value", "top_k", json=chat(top_k=-1)),
    Bad("repetition_penalty 0", 400, "invalid_value", "repetition_penalty", json=chat(repetition_penalty=0)),
    Bad("max_tokens of 0", 400, "invalid_value", "max_tokens", json=chat(max_tokens=0)),
    Bad(
        "max_completion_tokens of 0",
        400,
        "invalid_value",
        "max_completion_tokens",
        json=chat(max_completion_tokens=0),
    ),
    Bad("max_tokens is a float", 400, "invalid_type", "max_tokens", json=chat(max_tokens=4.5)),
    Bad("n of 2", 400, "unsupported_value", "n", json=chat(n=2)),
    Bad("five stop sequences", 400, "invalid_value", "stop", json=chat(stop=["a", "b", "c", "d", "e"])),
    Bad("stream is a string", 400, "invalid_type", "stream", json=chat(stream="yes")),
    Bad("tool_choice is not a mode", 400, "invalid_value", "tool_choice", json=chat(tool_choice="sometimes")),
    Bad(
        "tool_choice required without tools",
        400,
        "invalid_value",
        "tool_choice",
        json=chat(tool_choice="required"),
    ),
    Bad(
        "tool_choice names a function not in tools",
        400,
        "invalid_value",
        "tool_choice",
        json=chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
    ),
    Bad(
        "prompt longer than the context",
        400,
        "context_length_exceeded",
        "messages",
        json=chat(messages=[{"role": "user", "content": "word " * 3000}]),
    ),
    Bad(
        "max_tokens beyond the context, streamed",
        400,
        "context_length_exceeded",
        "messages",
        json=chat(max_tokens=100_000, stream=True),
    ),
    Bad("unknown route", 404, "not_found", None, method="GET", path="/v1/no-such-route"),
    Bad("wrong method", 405, "method_not_allowed", None, method="GET", path=CHAT),
    Bad("body too large", 413, "request_too_large", None, content=b"{" + b" " * (9 * 1024 * 1024) + b"}"),
    Bad("cancel an unknown request", 404, "request_not_found", "request_id", path="/v1/cancel/chatcmpl-nope"),
    Bad(
        "unknown model by id", 404, "model_not_found", "model", method="GET", path="/v1/models/no-such-model"
    ),
]


@pytest.fixture(scope="module")
def http(random_node: RunningNode) -> httpx.Client:
    return httpx.Client(base_url=random_node.base_url, timeout=60)


@pytest.mark.parametrize("bad", CASES, ids=[case.name for case in CASES])
def test_bad_request(http: httpx.Client, random_node: RunningNode, bad: Bad) -> None:
    assert random_node.model_id is not None
    body = bad.json(random_node.model_id) if bad.json is not None else None
    response = http.request(bad.method, bad.path, json=body, content=bad.content)

    assert response.status_code == bad.status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (bad.type, bad.code, bad.param)
    assert error["message"]


def test_sampling_extensions_are_accepted(http: httpx.Client, random_node: RunningNode) -> None:
    """min_p, top_k and repetition_penalty (vLLM's and llama.cpp's extensions of chat completions)."""
    body = chat(min_p=0.1, top_k=5, repetition_penalty=1.1, seed=3)(random_node.model_id or "")
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_node_still_serves_after_bad_requests(http: httpx.Client, random_node: RunningNode) -> None:
    assert http.post(CHAT, content=b"{").status_code == 400
    unknown_fields = {"frequency_penalty": 0, "logit_bias": {}, "user": "me", "metadata": {"a": "b"}}
    body = chat(temperature=0, stop="\n\n\n", seed=1, n=1, **unknown_fields)(random_node.model_id or "")
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get("/health").json()["status"] == "ok"
