"""The Claude Messages encoder, collector and request translation, sans I/O.

Scripted event sequences (the random test model never calls tools or reasons) go through the
encoder, and the `anthropic` SDK parses the bytes through `httpx2.MockTransport`: what it accepts
here is what it accepts from a node, which sends the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import MessageParam

from api.errors import ApiError
from api.messages_encode import MessagesCollector, MessagesEncoder, TokenCounter, error_body
from api.messages_request import to_generate_request
from api.messages_schema import parse_count_request, parse_messages_request
from protocol.chat import ChatMessage, ToolCallRef
from protocol.events import (
    ChunkEvent,
    Finish,
    FinishReason,
    GenerationError,
    PrefillProgress,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    Usage,
)
from protocol.ids import RequestId

USAGE = Usage(prompt_tokens=30, completion_tokens=9, cached_tokens=12)
TOOL_TURN: list[ChunkEvent] = [
    PrefillProgress(processed_tokens=0, total_tokens=30),
    ReasoningDelta(text="The user wants "),
    ReasoningDelta(text="the weather."),
    TextDelta(text="Let me "),
    TextDelta(text="check."),
    ToolCall(id="call_1f2e", name="get_weather", arguments='{"city": "Paris", "days": [1, 2]}'),
    Finish(reason="tool_calls", usage=USAGE),
]
HELLO: list[MessageParam] = [{"role": "user", "content": "hi"}]


def _stream(events: Sequence[ChunkEvent], *, show_thinking: bool = True) -> bytes:
    encoder = MessagesEncoder("msg_test", "tiny", show_thinking=show_thinking)
    frames = encoder.start()
    for event in events:
        frames += encoder.feed(event)
    assert encoder.done
    return frames


def _collected(events: Sequence[ChunkEvent], *, show_thinking: bool = True) -> dict[str, Any]:
    collector = MessagesCollector("msg_test", "tiny", show_thinking=show_thinking)
    for event in events:
        collector.feed(event)
    return collector.result()


def _sdk(response: httpx2.Response) -> anthropic.Anthropic:
    """An SDK client whose every request gets `response` (the encoder's bytes)."""
    transport = httpx2.MockTransport(lambda request: response)
    client = httpx2.Client(transport=transport)
    return anthropic.Anthropic(base_url="http://node", api_key="x", max_retries=0, http_client=client)


def _sse(frames: bytes) -> httpx2.Response:
    return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=frames)


def _event_names(frames: bytes) -> list[str]:
    return [
        line.removeprefix("event: ") for line in frames.decode().splitlines() if line.startswith("event: ")
    ]


def test_tool_use_stream_parsed_by_the_sdk_helper() -> None:
    client = _sdk(_sse(_stream(TOOL_TURN)))
    with client.messages.stream(model="tiny", max_tokens=50, messages=HELLO) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
    assert thinking.signature == ""
    assert text.type == "text" and text.text == "Let me check."
    assert tool_use.type == "tool_use" and tool_use.name == "get_weather"
    assert tool_use.input == {"city": "Paris", "days": [1, 2]}
    assert tool_use.id == "toolu_1f2e"
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    # message_start said 0; message_delta's usage, merged by the SDK, has the real counts.
    # Prefix-cache hits are not Anthropic cache reads: the input is the whole prompt.
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (30, 0)
    assert message.usage.output_tokens == 9


def test_raw_events_come_in_anthropics_order() -> None:
    frames = _stream(TOOL_TURN)
    block = ["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"]
    tool = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert _event_names(frames) == ["message_start", *block, *block, *tool, "message_delta", "message_stop"]
    client = _sdk(_sse(frames))
    events = list(client.messages.create(model="tiny", max_tokens=50, messages=HELLO, stream=True))
    assert [event.type for event in events] == _event_names(frames)
    start = events[0]
    assert start.type == "message_start"
    assert start.message.id == "msg_test" and start.message.content == []
    assert start.message.usage.input_tokens == 0
    indexes = [
        event.index
        for event in events
        if event.type in ("content_block_start", "content_block_delta", "content_block_stop")
    ]
    assert indexes == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]


def test_ping_keep_alive_is_skipped_by_the_sdk() -> None:
    ping = MessagesEncoder("msg_1", "tiny", show_thinking=False).keep_alive()
    assert ping == b'event: ping\ndata: {"type":"ping"}\n\n'
    start, rest = _stream(TOOL_TURN).split(b"\n\n", 1)
    frames = start + b"\n\n" + ping * 2 + rest
    events = list(
        _sdk(_sse(frames)).messages.create(model="tiny", max_tokens=50, messages=HELLO, stream=True)
    )
    assert [event.type for event in events] == _event_names(_stream(TOOL_TURN))


def test_collected_message_parsed_by_the_sdk_matches_the_stream() -> None:
    body = _collected(TOOL_TURN)
    message = _sdk(httpx2.Response(200, json=body)).messages.create(
        model="tiny",
        max_tokens=50,
        messages=HELLO,
    )
    with _sdk(_sse(_stream(TOOL_TURN))).messages.stream(
        model="tiny", max_tokens=50, messages=HELLO
    ) as stream:
        streamed = stream.get_final_message()
    assert message.id == "msg_test" and message.role == "assistant" and message.type == "message"
    assert [b.to_dict() for b in message.content] == [b.to_dict() for b in streamed.content]
    assert message.stop_reason == "tool_use"
    assert message.usage.to_dict() == streamed.usage.to_dict()


def test_reasoning_is_dropped_unless_thinking_is_enabled() -> None:
    frames = _stream(TOOL_TURN, show_thinking=False)
    assert b"thinking" not in frames
    content = _collected(TOOL_TURN, show_thinking=False)["content"]
    assert [block["type"] for block in content] == ["text", "tool_use"]


@pytest.mark.parametrize(
    ("reason", "stop_sequence", "tool", "expected"),
    [
        ("stop", None, False, "end_turn"),
        ("stop", "\n\n", False, "stop_sequence"),
        ("length", None, False, "max_tokens"),
        ("length", None, True, "max_tokens"),
        ("tool_calls", None, True, "tool_use"),
        ("stop", None, True, "tool_use"),
        ("cancelled", None, False, "end_turn"),
    ],
)
def test_stop_reason(reason: FinishReason, stop_sequence: str | None, tool: bool, expected: str) -> None:
    events: list[ChunkEvent] = [TextDelta(text="x")]
    if tool:
        events.append(ToolCall(id="call_9", name="f", arguments="{}"))
    events.append(Finish(reason=reason, usage=USAGE, stop_sequence=stop_sequence))
    collected = _collected(events)
    assert (collected["stop_reason"], collected["stop_sequence"]) == (expected, stop_sequence)
    delta = json.loads(_stream(events).decode().split("event: message_delta\ndata: ")[1].split("\n")[0])
    assert delta["delta"] == {"stop_reason": expected, "stop_sequence": stop_sequence}


def test_tool_arguments_that_are_not_an_object_become_empty_input() -> None:
    for arguments in ('{"city": "Par', "[1, 2]", ""):
        events: list[ChunkEvent] = [
            ToolCall(id="call_2", name="f", arguments=arguments),
            Finish(reason="tool_calls", usage=USAGE),
        ]
        assert _collected(events)["content"][0]["input"] == {}
        with _sdk(_sse(_stream(events))).messages.stream(model="t", max_tokens=5, messages=HELLO) as stream:
            assert stream.get_final_message().content[0].to_dict()["input"] == {}


def test_error_mid_stream_is_an_error_event_the_sdk_raises() -> None:
    failed = GenerationError(error_kind="server_error", message="runner died")
    frames = _stream([TextDelta(text="Hel"), failed])
    assert _event_names(frames)[-1] == "error"
    with pytest.raises(anthropic.APIStatusError) as raised:
        list(_sdk(_sse(frames)).messages.create(model="t", max_tokens=5, messages=HELLO, stream=True))
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "runner died"},
    }
    encoder = MessagesEncoder("msg_x", "t", show_thinking=False)
    encoder.start()
    assert _event_names(encoder.broken_off()) == ["error"] and encoder.done


def test_collector_and_counter_raise_the_generation_error() -> None:
    full = GenerationError(error_kind="overloaded", message="queue full")
    for sink in (MessagesCollector("msg_x", "t", show_thinking=False), TokenCounter()):
        sink.feed(full)
        with pytest.raises(ApiError) as raised:
            sink.result()
        assert raised.value.status == 429
        assert error_body(raised.value)["error"]["type"] == "rate_limit_error"
    counter = TokenCounter()
    counter.feed(Finish(reason="stop", usage=Usage(prompt_tokens=41, completion_tokens=0)))
    assert counter.result() == {"input_tokens": 41}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_body_type_follows_the_status(status: int, kind: str) -> None:
    assert error_body(ApiError(status, "no")) == {"type": "error", "error": {"type": kind, "message": "no"}}


def _request(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 64, "messages": HELLO, **fields}).encode()


def test_conversation_with_blocks_tool_use_and_tool_result() -> None:
    body = _request(
        system=[
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": "Use tools.", "cache_control": {}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need a tool.", "signature": "abc"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_7", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_8",
                        "content": [{"type": "text", "text": "a"}],
                    },
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        tools=[{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
        stop_sequences=["END"],
        temperature=0,
        top_k=5,
    )
    generate = to_generate_request(parse_messages_request(body), RequestId("msg_1"))
    assert generate.messages == (
        ChatMessage(role="system", content="Be brief.\n\nUse tools."),
        ChatMessage(role="user", content="Weather?"),
        ChatMessage(
            role="assistant",
            content="Checking.",
            reasoning="Need a tool.",
            tool_calls=(ToolCallRef(id="toolu_7", name="get_weather", arguments='{"city": "Paris"}'),),
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="toolu_7"),
        ChatMessage(role="tool", content="a", tool_call_id="toolu_8"),
        ChatMessage(role="user", content="Thanks."),
    )
    assert generate.tool_choice == "required" and generate.tools[0].parameters == {"type": "object"}
    params = generate.params
    assert (params.temperature, params.top_k, params.max_tokens, params.stop) == (0, 5, 64, ("END",))
    assert not generate.count_only


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, "auto"),
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, "f"),
    ],
)
def test_tool_choice(choice: dict[str, str] | None, expected: str) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    body = parse_count_request(_request(tools=tools, **({"tool_choice": choice} if choice else {})))
    generate = to_generate_request(body, RequestId("msg_2"), count_only=True)
    assert generate.tool_choice == expected and generate.count_only


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "messages[1]"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "g"}, "tools": [{"name": "f", "input_schema": {}}]},
            "tool_choice.name",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled"}, "max_tokens": 4096}, "thinking.budget_tokens"),
    ],
)
def test_inconsistent_fields_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        to_generate_request(parse_messages_request(_request(**fields)), RequestId("msg_3"))
    assert (raised.value.status, raised.value.param) == (400, param)
    assert f"'{param}'" in raised.value.message
