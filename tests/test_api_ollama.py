"""Ollama's API on a real node (`random_node`), through the official `ollama` client.

Answers plain and streamed (the same text at temperature 0), the options that end a generation
(num_predict, stop), counts and durations, the model listings parsed by the client's own types,
errors in Ollama's `{"error": ...}` shape, a client that hangs up cancelling the runner, and a long
prompt whose prefill-progress lines the client streams through. Tool calls, reasoning and the
keep-alive lines are scripted in tests/test_ollama_encode.py.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import ollama
import pytest

from tests.nodes import RunningNode
from tests.waiting import wait_until

SYSTEM = "Be brief."
QUESTION = "Name three colours."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 12}
LONG_PROMPT = "lighthouse " * 1500
"""About 1,500 tokens: three prefill chunks of 512, so several progress lines."""


@pytest.fixture(scope="module")
def model(random_node: RunningNode) -> str:
    assert random_node.model_id is not None
    return random_node.model_id


@pytest.fixture(scope="module")
def client(random_node: RunningNode) -> ollama.Client:
    return ollama.Client(host=random_node.base_url, timeout=120)


@pytest.fixture(scope="module")
def http(random_node: RunningNode) -> httpx.Client:
    return httpx.Client(base_url=random_node.base_url, timeout=120)


def _check_final(response: ollama.ChatResponse | ollama.GenerateResponse, max_tokens: int = 12) -> None:
    assert response.done is True
    assert response.done_reason in ("stop", "length")
    assert response.prompt_eval_count is not None and response.prompt_eval_count > 5
    assert response.eval_count is not None and 1 <= response.eval_count <= max_tokens
    if response.done_reason == "length":
        assert response.eval_count == max_tokens
    durations = [
        response.total_duration,
        response.load_duration,
        response.prompt_eval_duration,
        response.eval_duration,
    ]
    assert all(d is not None and d > 0 for d in durations), durations
    assert response.total_duration == sum(d or 0 for d in durations[1:])
    assert response.created_at is not None and datetime.fromisoformat(response.created_at).tzinfo is not None


def test_chat_plain_and_streamed_agree(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=MESSAGES, options=GREEDY)
    assert whole.model == model and whole.message.role == "assistant"
    assert whole.message.content and not whole.message.tool_calls
    _check_final(whole)

    chunks = list(client.chat(model=model, messages=MESSAGES, options=GREEDY, stream=True))
    assert all(chunk.model == model and chunk.message.role == "assistant" for chunk in chunks)
    assert all(not chunk.done for chunk in chunks[:-1])
    streamed = "".join(chunk.message.content or "" for chunk in chunks)
    assert streamed == whole.message.content, "greedy decoding gave a different answer streamed"
    last = chunks[-1]
    _check_final(last)
    assert (last.done_reason, last.prompt_eval_count, last.eval_count) == (
        whole.done_reason,
        whole.prompt_eval_count,
        whole.eval_count,
    )


def test_generate_plain_and_streamed_agree(client: ollama.Client, model: str) -> None:
    whole = client.generate(model=model, system=SYSTEM, prompt=QUESTION, options=GREEDY)
    assert whole.model == model and whole.response
    _check_final(whole)
    parts = list(client.generate(model=model, system=SYSTEM, prompt=QUESTION, options=GREEDY, stream=True))
    assert "".join(part.response or "" for part in parts) == whole.response
    _check_final(parts[-1])
    # The same conversation as the chat above: one generation path.
    chat = client.chat(model=model, messages=MESSAGES, options=GREEDY)
    assert chat.message.content == whole.response


def test_num_predict_ends_with_length(client: ollama.Client, model: str) -> None:
    response = client.generate(model=model, prompt=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert (response.done_reason, response.eval_count) == ("length", 3)


def test_stop_option_cuts_the_text(client: ollama.Client, model: str) -> None:
    text = client.chat(model=model, messages=MESSAGES, options=GREEDY).message.content or ""
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = client.chat(model=model, messages=MESSAGES, options={**GREEDY, "stop": [stop]})
    assert cut.message.content == text[: text.index(stop)]
    assert cut.done_reason == "stop"
    streamed = client.chat(model=model, messages=MESSAGES, options={**GREEDY, "stop": [stop]}, stream=True)
    assert "".join(chunk.message.content or "" for chunk in streamed) == cut.message.content


def test_unmapped_options_and_fields_are_ignored(client: ollama.Client, model: str) -> None:
    options = {
        **GREEDY,
        "num_ctx": 999_999,
        "repeat_last_n": 32,
        "num_thread": 2,
        "mirostat": 0,
        "seed": -1,
    }
    response = client.chat(model=model, messages=MESSAGES, options=options, keep_alive="5m", think=False)
    _check_final(response)


def test_sampling_options_are_accepted(client: ollama.Client, model: str) -> None:
    options = {"num_predict": 12, "min_p": 0.1, "top_k": 5, "repeat_penalty": 1.1, "seed": 3}
    _check_final(client.chat(model=model, messages=MESSAGES, options=options))


def test_model_named_with_the_latest_tag(client: ollama.Client, model: str) -> None:
    response = client.generate(model=f"{model}:latest", prompt=QUESTION, options={"num_predict": 1})
    assert response.model == f"{model}:latest" and response.done


def test_nothing_to_generate_is_a_load_request(client: ollama.Client, model: str) -> None:
    assert client.chat(model=model, messages=[]).done_reason == "load"
    assert client.generate(model=model).done_reason == "load"
    loaded = list(client.generate(model=model, stream=True))
    assert [(part.done, part.done_reason) for part in loaded] == [(True, "load")]


def test_listings_parse_as_the_client_types(client: ollama.Client, http: httpx.Client, model: str) -> None:
    listed = client.list().models
    assert [entry.model for entry in listed] == [model]
    entry = listed[0]
    assert entry.size and entry.size > 0 and entry.digest and entry.modified_at is not None
    assert entry.details is not None
    assert (entry.details.family, entry.details.format) == ("llama", "safetensors")
    assert entry.details.parameter_size and entry.details.quantization_level == "F32"

    shown = client.show(model)
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.details is not None and shown.details.family == "llama"
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] > 0
    assert shown.modelinfo["general.parameter_count"] > 0

    loaded = client.ps().models
    assert [entry.model for entry in loaded] == [model]
    assert loaded[0].context_length == shown.modelinfo["llama.context_length"]
    assert loaded[0].expires_at is not None and loaded[0].size_vram == 0

    version = http.get("/api/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    assert http.head("/").status_code == 200


def test_unknown_model_is_a_404(client: ollama.Client) -> None:
    for call in (
        lambda: client.chat(model="no-such-model", messages=MESSAGES),
        lambda: list(client.chat(model="no-such-model", messages=MESSAGES, stream=True)),
        lambda: client.show("no-such-model"),
    ):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404 and "no-such-model" in caught.value.error


Body = Callable[[str], dict[str, Any]]


def body(**fields: Any) -> Body:
    """A valid chat body with `fields` replacing or adding keys; a value of `...` removes the key."""

    def build(model: str) -> dict[str, Any]:
        whole = {
            "model": model,
            "messages": MESSAGES,
            "options": {"num_predict": 2},
            "stream": False,
            **fields,
        }
        return {key: value for key, value in whole.items() if value is not ...}

    return build


@dataclass(frozen=True)
class Bad:
    name: str
    status: int
    names: str
    """A word the error message must contain (the field or the problem)."""
    json: Body | None = None
    content: bytes | None = None
    method: str = "POST"
    path: str = "/api/chat"


USER_WITH = [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
CASES = [
    Bad("malformed JSON", 400, "JSON", content=b'{"model": "x", "messages": ['),
    Bad("body not an object", 400, "object", content=b'["model"]'),
    Bad("missing model", 400, "model", json=body(model=...)),
    Bad("unknown model", 404, "no-such-model", json=body(model="no-such-model")),
    Bad("messages not a list", 400, "messages", json=body(messages="hi")),
    Bad("unknown role", 400, "messages[0].role", json=body(messages=[{"role": "robot", "content": "hi"}])),
    Bad(
        "content is a number",
        400,
        "messages[0].content",
        json=body(messages=[{"role": "user", "content": 4}]),
    ),
    Bad("images", 400, "images", json=body(messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])),
    Bad("tool_calls on a user message", 400, "messages[0].tool_calls", json=body(messages=USER_WITH)),
    Bad(
        "tool call arguments a string",
        400,
        "arguments",
        json=body(
            messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
        ),
    ),
    Bad("temperature is a string", 400, "options.temperature", json=body(options={"temperature": "hot"})),
    Bad("temperature below 0", 400, "options.temperature", json=body(options={"temperature": -1})),
    Bad("top_p of 0", 400, "options.top_p", json=body(options={"top_p": 0})),
    Bad("top_k below 0", 400, "options.top_k", json=body(options={"top_k": -1})),
    Bad("min_p above 1", 400, "options.min_p", json=body(options={"min_p": 1.5})),
    Bad("repeat_penalty of 0", 400, "options.repeat_penalty", json=body(options={"repeat_penalty": 0})),
    Bad("num_predict of 0", 400, "num_predict", json=body(options={"num_predict": 0})),
    Bad("num_predict is a float", 400, "options.num_predict", json=body(options={"num_predict": 2.5})),
    Bad(
        "seventeen stop strings", 400, "options.stop", json=body(options={"stop": list("abcdefghijklmnopq")})
    ),
    Bad("options not an object", 400, "options", json=body(options=[1])),
    Bad("think of max", 400, "think", json=body(think="max")),
    Bad("format json", 400, "format", json=body(format="json")),
    Bad("format schema", 400, "format", json=body(format={"type": "object"})),
    Bad("logprobs", 400, "logprobs", json=body(logprobs=True)),
    Bad("stream is a string", 400, "stream", json=body(stream="yes")),
    Bad("tools not a list", 400, "tools", json=body(tools={"type": "function"})),
    Bad(
        "prompt longer than the context",
        400,
        "context",
        json=body(messages=[{"role": "user", "content": "word " * 3000}]),
    ),
    Bad(
        "prompt longer than the context, streamed",
        400,
        "context",
        json=body(messages=[{"role": "user", "content": "word " * 3000}], stream=True),
    ),
    Bad(
        "generate raw",
        400,
        "raw",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": "hi", "raw": True},
    ),
    Bad(
        "generate images",
        400,
        "images",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": "hi", "images": ["aGk="]},
    ),
    Bad(
        "generate suffix",
        400,
        "suffix",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": "hi", "suffix": "x"},
    ),
    Bad(
        "generate template",
        400,
        "template",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": "hi", "template": "x"},
    ),
    Bad(
        "generate context",
        400,
        "context",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": "hi", "context": [1, 2]},
    ),
    Bad(
        "generate prompt a list",
        400,
        "prompt",
        path="/api/generate",
        json=lambda m: {"model": m, "prompt": ["hi"]},
    ),
    Bad("show without model", 400, "model", path="/api/show", json=lambda m: {}),
    Bad(
        "show unknown model",
        404,
        "no-such-model",
        path="/api/show",
        json=lambda m: {"model": "no-such-model"},
    ),
    Bad("body too large", 413, "exceeds", content=b"{" + b" " * (9 * 1024 * 1024) + b"}"),
    Bad("unknown route", 404, "/api/pull", path="/api/pull", json=lambda m: {"model": m}),
    Bad("wrong method", 405, "GET", method="GET"),
    Bad("wrong method on a listing", 405, "POST", path="/api/tags", json=lambda m: {}),
]


@pytest.mark.parametrize("bad", CASES, ids=[case.name for case in CASES])
def test_bad_request(http: httpx.Client, model: str, bad: Bad) -> None:
    response = http.request(
        bad.method, bad.path, json=bad.json(model) if bad.json else None, content=bad.content
    )
    assert response.status_code == bad.status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()
    assert list(error) == ["error"] and isinstance(error["error"], str)
    assert bad.names in error["error"], error


def _active_requests(node: RunningNode) -> int:
    return sum(runner["active_requests"] for runner in node.health()["runners"])


def test_client_hanging_up_cancels_the_generation(random_node: RunningNode, model: str) -> None:
    client = ollama.Client(host=random_node.base_url, timeout=120)
    cancelled = random_node.health()["runners"][0]["cancelled"]
    stream = client.chat(
        model=model, messages=MESSAGES, options={"temperature": 0, "num_predict": 1500}, stream=True
    )
    assert isinstance(stream, types.GeneratorType)
    texts = (chunk for chunk in stream if chunk.message.content)
    for _ in range(20):
        next(texts)
    assert _active_requests(random_node) == 1
    stream.close()  # leaves the client's `with` block mid-stream: the connection drops
    client.close()
    wait_until(lambda: _active_requests(random_node) == 0, 10, "the abandoned generation ended")
    assert random_node.health()["runners"][0]["cancelled"] == cancelled + 1


def test_long_prompt_streams_progress_the_client_parses(
    client: ollama.Client, http: httpx.Client, model: str
) -> None:
    options = {"temperature": 0, "num_predict": 4}
    request = {"model": model, "prompt": LONG_PROMPT, "options": options}
    with http.stream("POST", "/api/generate", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines()]
    progress = [line["prefill_progress"] for line in lines if "prefill_progress" in line]
    assert len(progress) >= 3, lines[:5]
    assert [p["processed_tokens"] for p in progress] == sorted(p["processed_tokens"] for p in progress)
    assert progress[-1]["processed_tokens"] == progress[-1]["total_tokens"] > 1000
    first_text = next(i for i, line in enumerate(lines) if line.get("response"))
    assert all("prefill_progress" not in line for line in lines[first_text:])
    assert all(line["response"] == "" for line in lines if "prefill_progress" in line)

    # The client reads every line, progress included, as an ordinary (empty) chunk.
    parts = list(client.generate(model=model, prompt=LONG_PROMPT, options=options, stream=True))
    assert "".join(p.response or "" for p in parts) == "".join(line.get("response", "") for line in lines)
    assert sum(1 for p in parts if not p.response and not p.done) >= 2
    assert parts[-1].done and parts[-1].prompt_eval_count == progress[-1]["total_tokens"]
