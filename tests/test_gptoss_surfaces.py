"""GPT-OSS end to end: a real gpt_oss model with the real o200k tokenizer, through every surface.

One node serves the scripted model (tests/gptoss_model.py), whose output is a known harmony
sequence: analysis then final for a plain question, analysis then a commentary tool call when asked
about the weather. Each surface, asked through its official client, streamed and not, shows the
analysis as its reasoning (`reasoning_content`, thinking blocks, Responses reasoning items, Ollama
`thinking`), the final message as the answer, and the tool call as its tool call. A second model,
whose vocabulary is smaller than the harmony ids its prompts hold, is refused with a 4xx in each
surface's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from openai.types.responses import Response

from tests.gptoss_model import (
    ANSWER,
    ANSWER_SCRIPT,
    ARGUMENTS,
    REASONING,
    TOOL,
    TOOL_REASONING,
    make_scripted_gptoss,
    script_ids,
)
from tests.nodes import RunningNode, start_node

QUESTION = "Say hello."
WEATHER = "What is the weather in Paris?"
DESCRIPTION = "Current weather in a city"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": TOOL, "description": DESCRIPTION, "parameters": PARAMETERS}}
]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def node(scripted_gptoss_node: RunningNode) -> RunningNode:
    return scripted_gptoss_node


@pytest.fixture(scope="module")
def model(node: RunningNode) -> str:
    assert node.model_id is not None
    return node.model_id


@pytest.fixture(scope="module")
def openai_client(node: RunningNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(node: RunningNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.base_url, api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def ollama_client(node: RunningNode) -> ollama.Client:
    return ollama.Client(host=node.base_url, timeout=120)


# --- chat completions ------------------------------------------------------------------------------


def test_chat_completions_reasoning_and_answer(openai_client: openai.OpenAI, model: str) -> None:
    completion = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0
    )
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    assert (choice.message.model_extra or {}).get("reasoning_content") == REASONING
    assert not choice.message.tool_calls
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(script_ids(ANSWER_SCRIPT))  # <|return|> counted


def test_chat_completions_streamed(openai_client: openai.OpenAI, model: str) -> None:
    content, reasoning, finish = "", "", None
    for chunk in openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0, stream=True
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat_completions_tool_call(openai_client: openai.OpenAI, model: str, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": WEATHER}],
        "tools": CHAT_TOOLS,
        "temperature": 0,
    }
    if not stream:
        choice = openai_client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert (choice.message.model_extra or {}).get("reasoning_content") == TOOL_REASONING
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert calls == [(TOOL, ARGUMENTS)]
        return
    names, arguments, finish, content, reasoning = "", "", None, "", ""
    for chunk in openai_client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for call in choice.delta.tool_calls or []:
                assert call.function is not None
                names += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (names, arguments, finish, content) == (TOOL, ARGUMENTS, "tool_calls", "")
    assert reasoning == TOOL_REASONING


# --- Responses -------------------------------------------------------------------------------------


def _reasoning_and_text(output: list[Any]) -> list[tuple[str, str]]:
    """(item type, its text) per output item."""
    items: list[tuple[str, str]] = []
    for item in output:
        if item.type == "reasoning":
            items.append(("reasoning", "".join(part.text for part in item.content or [])))
        elif item.type == "message":
            items.append(("message", "".join(part.text for part in item.content)))
        else:
            items.append((item.type, f"{item.name} {item.arguments}"))
    return items


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_reasoning_item_then_message(
    openai_client: openai.OpenAI, model: str, stream: bool
) -> None:
    response: Response
    if stream:
        with openai_client.responses.stream(model=model, input=QUESTION, temperature=0) as events:
            deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
            response = events.get_final_response()
        assert "".join(deltas) == REASONING
    else:
        response = openai_client.responses.create(model=model, input=QUESTION, temperature=0)
    assert response.status == "completed"
    assert _reasoning_and_text(response.output) == [("reasoning", REASONING), ("message", ANSWER)]
    assert response.output_text == ANSWER
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_function_call(openai_client: openai.OpenAI, model: str, stream: bool) -> None:
    tools: list[Any] = [
        {"type": "function", "name": TOOL, "description": DESCRIPTION, "parameters": PARAMETERS}
    ]
    response: Response
    if stream:
        with openai_client.responses.stream(model=model, input=WEATHER, tools=tools, temperature=0) as events:
            response = events.get_final_response()
    else:
        response = openai_client.responses.create(model=model, input=WEATHER, tools=tools, temperature=0)
    assert _reasoning_and_text(response.output) == [
        ("reasoning", TOOL_REASONING),
        ("function_call", f"{TOOL} {ARGUMENTS}"),
    ]
    call = response.output[1]
    assert call.type == "function_call" and call.call_id and call.id and call.id.startswith("fc_")


# --- Claude Messages -------------------------------------------------------------------------------


def _blocks(content: list[Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for block in content:
        if block.type == "thinking":
            out.append(("thinking", block.thinking))
        elif block.type == "text":
            out.append(("text", block.text))
        else:
            out.append((block.type, (block.name, block.input)))
    return out


def _message(
    client: anthropic.Anthropic, request: dict[str, Any], *, stream: bool
) -> anthropic.types.Message:
    """The Messages API's answer to `request`, streamed (the SDK assembles it) or not."""
    if stream:
        with client.messages.stream(**request) as events:
            return events.get_final_message()
    return client.messages.create(**request)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_messages_thinking_block_then_text(
    anthropic_client: anthropic.Anthropic, model: str, stream: bool
) -> None:
    request: dict[str, Any] = {
        "model": model,
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": QUESTION}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    message = _message(anthropic_client, request, stream=stream)
    assert _blocks(message.content) == [("thinking", REASONING), ("text", ANSWER)]
    assert message.stop_reason == "end_turn"
    # Without `thinking` the reasoning is left out.
    request.pop("thinking")
    plain = anthropic_client.messages.create(**request)
    assert _blocks(plain.content) == [("text", ANSWER)]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_messages_tool_use(anthropic_client: anthropic.Anthropic, model: str, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": model,
        "max_tokens": 2048,
        "messages": [{"role": "user", "content": WEATHER}],
        "tools": [{"name": TOOL, "description": DESCRIPTION, "input_schema": PARAMETERS}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    message = _message(anthropic_client, request, stream=stream)
    assert _blocks(message.content) == [
        ("thinking", TOOL_REASONING),
        ("tool_use", (TOOL, json.loads(ARGUMENTS))),
    ]
    assert message.stop_reason == "tool_use"


# --- Ollama ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_ollama_thinking_and_content(ollama_client: ollama.Client, model: str, stream: bool) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    if stream:
        thinking, content = "", ""
        for part in ollama_client.chat(
            model=model, messages=messages, think=True, options=GREEDY, stream=True
        ):
            thinking += part.message.thinking or ""
            content += part.message.content or ""
    else:
        response = ollama_client.chat(model=model, messages=messages, think=True, options=GREEDY)
        thinking, content = response.message.thinking or "", response.message.content or ""
    assert (thinking, content) == (REASONING, ANSWER)
    hidden = ollama_client.chat(model=model, messages=messages, think=False, options=GREEDY)
    assert (hidden.message.thinking, hidden.message.content) == (None, ANSWER)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_ollama_tool_call(ollama_client: ollama.Client, model: str, stream: bool) -> None:
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": WEATHER}],
        "tools": CHAT_TOOLS,
        "think": True,
        "options": GREEDY,
    }
    parts = list(ollama_client.chat(**request, stream=True)) if stream else [ollama_client.chat(**request)]
    thinking = "".join(part.message.thinking or "" for part in parts)
    content = "".join(part.message.content or "" for part in parts)
    calls = [(c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or []]
    assert (thinking, content, calls) == (TOOL_REASONING, "", [(TOOL, json.loads(ARGUMENTS))])


def test_ollama_generate_thinking_and_response(ollama_client: ollama.Client, model: str) -> None:
    response = ollama_client.generate(model=model, prompt=QUESTION, think=True, options=GREEDY)
    assert (response.thinking, response.response) == (REASONING, ANSWER)


# --- a vocabulary that lacks the harmony ids --------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """The same model with a 1024-token embedding: every harmony prompt holds ids past it."""
    folder = make_scripted_gptoss(
        tmp_path_factory.mktemp("gptoss-small") / "small-vocab-gpt-oss", vocab_size=1024
    )
    running = start_node(data_dir=tmp_path_factory.mktemp("data-small"), model=str(folder))
    yield running
    running.stop()


def test_a_prompt_past_the_vocabulary_is_refused_on_every_surface(small_vocab_node: RunningNode) -> None:
    model = small_vocab_node.model_id
    user = [{"role": "user", "content": QUESTION}]
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"model": model, "messages": user},
        "/v1/responses": {"model": model, "input": QUESTION},
        "/v1/messages": {"model": model, "max_tokens": 20, "messages": user},
        "/api/chat": {"model": model, "messages": user, "stream": False},
    }
    for path, body in bodies.items():
        for stream in (False, True):
            reply = httpx.post(
                f"{small_vocab_node.base_url}{path}", json={**body, "stream": stream}, timeout=60
            )
            assert reply.status_code == 400, (path, stream, reply.text)
            error = reply.json()
            message = error["error"] if path == "/api/chat" else error["error"]["message"]
            assert "vocabulary has 1024 tokens" in message, (path, error)
            if path == "/v1/messages":
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            elif path != "/api/chat":
                assert error["error"]["code"] == "token_out_of_vocabulary", (path, error)
    # Counting the prompt's tokens is still the tokenizer's business: no refusal.
    count = httpx.post(
        f"{small_vocab_node.base_url}/v1/messages/count_tokens",
        json={"model": model, "messages": user},
        timeout=60,
    )
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
