"""The Responses encoder, collector and input mapping, sans-I/O, checked against the openai SDK's own types.

Scripted event sequences (the random-weight model never calls a tool or reasons) go through
`ResponsesEncoder` into bytes that the SDK then parses as an HTTP response (`httpx2.MockTransport`,
the transport library the SDK is built on), and every event and response object is validated
strictly by the SDK's pydantic models, so the test proves the official client accepts our shapes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from api.errors import ApiError
from api.responses_encode import ResponsesCollector, ResponsesEncoder
from api.responses_input import to_generate_request
from api.responses_output import ResponseAssembler
from api.responses_schema import ResponsesRequest
from protocol.chat import ChatMessage, ToolCallRef
from protocol.events import (
    ChunkEvent,
    Finish,
    GenerationError,
    PrefillProgress,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    Usage,
)
from protocol.ids import RequestId

RESPONSE_ID = "resp_0123456789abcdef01234567"
MODEL = "tiny"
USAGE = Usage(prompt_tokens=20, completion_tokens=9, cached_tokens=4)
WEATHER = ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')
TIME = ToolCall(id="call_2", name="get_time", arguments='{"zone":"CET"}')
TOOL_TURN: list[ChunkEvent] = [
    PrefillProgress(processed_tokens=0, total_tokens=20),
    ReasoningDelta(text="They want"),
    ReasoningDelta(text=" the weather."),
    TextDelta(text="Let me "),
    TextDelta(text="check."),
    WEATHER,
    TIME,
    Finish(reason="tool_calls", usage=USAGE),
]
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
    {"type": "function", "name": "get_time", "description": "Now", "parameters": None, "strict": True},
]
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": "hi", **fields})


def _assembler(**fields: Any) -> ResponseAssembler:
    return ResponseAssembler(RESPONSE_ID, MODEL, 1_700_000_000, _request(**fields).echo())


def _stream(events: list[ChunkEvent], **fields: Any) -> bytes:
    encoder = ResponsesEncoder(_assembler(**fields))
    frames = encoder.start()
    for event in events:
        assert not encoder.done
        frames += encoder.feed(event)
    assert encoder.done
    return frames


def _collect(events: list[ChunkEvent], **fields: Any) -> dict[str, Any]:
    collector = ResponsesCollector(_assembler(**fields))
    for event in events:
        collector.feed(event)
    return collector.result()


def _sse_events(frames: bytes) -> list[dict[str, Any]]:
    """Each data frame's JSON, checked against its `event:` line."""
    events = []
    for block in frames.decode().split("\n\n"):
        lines = block.splitlines()
        if not lines or lines[0].startswith(":"):
            continue
        name, data = lines
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def _client(body: bytes, content_type: str) -> openai.OpenAI:
    def answer(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/responses"
        return httpx2.Response(200, content=body, headers={"content-type": content_type})

    http = httpx2.Client(transport=httpx2.MockTransport(answer))
    return openai.OpenAI(base_url="http://shoal.test/v1", api_key="x", max_retries=0, http_client=http)


def test_tool_turn_stream_in_order_with_sequence_numbers() -> None:
    frames = _stream(TOOL_TURN, tools=TOOLS)
    assert frames.count(b": prefill_progress ") == 1
    events = _sse_events(frames)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:
        STREAM_EVENT.validate_python(event, strict=False)
    assert [(event["type"], event.get("output_index")) for event in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
        ("response.completed", None),
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_sdk_streams_a_tool_turn() -> None:
    client = _client(_stream(TOOL_TURN, tools=TOOLS), "text/event-stream")
    with client.responses.stream(model=MODEL, input="weather?", tools=[]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    Response.model_validate(final.model_dump(exclude_none=True))
    _check_tool_turn(final)


def test_collected_tool_turn_is_the_streamed_one() -> None:
    collected = _collect(TOOL_TURN, tools=TOOLS)
    streamed = _sse_events(_stream(TOOL_TURN, tools=TOOLS))[-1]["response"]
    assert collected == streamed
    _check_tool_turn(Response.model_validate(collected))
    sdk_parsed = _client(json.dumps(collected).encode(), "application/json").responses.create(
        model=MODEL, input="weather?"
    )
    _check_tool_turn(sdk_parsed)


def _check_tool_turn(response: Response) -> None:
    assert response.id == RESPONSE_ID and response.status == "completed" and response.model == MODEL
    assert [item.type for item in response.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    reasoning, message, weather, time = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [part.text for part in reasoning.content or ()] == ["They want the weather."]
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert response.output_text == "Let me check."
    for item, call in ((weather, WEATHER), (time, TIME)):
        assert item.type == "function_call" and item.id is not None and item.id.startswith("fc_")
        assert (item.call_id, item.name, item.arguments) == (call.id, call.name, call.arguments)
    assert len({item.id for item in response.output}) == 4
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (20, 9, 29)
    assert usage.input_tokens_details.cached_tokens == 4
    assert usage.output_tokens_details.reasoning_tokens == 2
    assert [tool.type for tool in response.tools] == ["function", "function"]


def test_output_replayed_as_input_is_one_assistant_turn() -> None:
    """The client's loop: send `response.output` back with the tools' results appended."""
    output = Response.model_validate(_collect(TOOL_TURN, tools=TOOLS)).output
    replay = [item.model_dump(exclude_none=True) for item in output]
    results = [
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "9:00"}],
        },
    ]
    request = _request(
        instructions="Be brief.",
        input=[{"role": "user", "content": "weather?"}, *replay, *results],
        tools=TOOLS,
    )
    messages = to_generate_request(request, RequestId(RESPONSE_ID)).messages
    calls = (
        ToolCallRef(id="call_1", name="get_weather", arguments='{"city":"Paris"}'),
        ToolCallRef(id="call_2", name="get_time", arguments='{"zone":"CET"}'),
    )
    assert messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="weather?"),
        ChatMessage(
            role="assistant", content="Let me check.", reasoning="They want the weather.", tool_calls=calls
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
        ChatMessage(role="tool", content="9:00", tool_call_id="call_2"),
    )


def test_input_messages_and_tool_choice() -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{}"},
    ]
    choice = {"type": "function", "name": "get_time"}
    request = to_generate_request(_request(input=items, tools=TOOLS, tool_choice=choice), RequestId("r"))
    assert [(m.role, m.content, m.reasoning, len(m.tool_calls)) for m in request.messages] == [
        ("developer", "Rules.", None, 0),
        ("user", "a", None, 0),
        ("assistant", "b", "hm", 1),  # the call joins the assistant turn before it, reasoning too
    ]
    assert request.tool_choice == "get_time"
    assert [tool.name for tool in request.tools] == ["get_weather", "get_time"]
    assert request.tools[1].parameters == {}


def test_length_ends_incomplete() -> None:
    events: list[ChunkEvent] = [TextDelta(text="one two"), Finish(reason="length", usage=USAGE)]
    frames = _stream(events, max_output_tokens=9)
    last = _sse_events(frames)[-1]
    assert last["type"] == "response.incomplete"
    response = Response.model_validate(last["response"])
    assert response.status == "incomplete" and response.max_output_tokens == 9
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output if item.type == "message"] == ["incomplete"]
    assert response.output_text == "one two"
    assert last["response"] == _collect(events, max_output_tokens=9)


def test_no_output_still_answers_one_empty_message() -> None:
    response = Response.model_validate(_collect([Finish(reason="stop", usage=USAGE)]))
    assert [item.type for item in response.output] == ["message"] and response.output_text == ""


def test_error_after_start_is_response_failed_the_sdk_reads() -> None:
    error = GenerationError(error_kind="server_error", message="runner died", code="runner_unavailable")
    frames = _stream([TextDelta(text="par"), error])
    events = _sse_events(frames)
    assert [event["type"] for event in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    with _client(frames, "text/event-stream").responses.stream(model=MODEL, input="x") as stream:
        last = list(stream)[-1]
    assert last.type == "response.failed"
    assert last.response.status == "failed" and last.response.error is not None
    assert (last.response.error.code, last.response.error.message) == ("server_error", "runner died")
    with pytest.raises(ApiError) as raised:
        _collect([TextDelta(text="par"), error])
    assert raised.value.status == 503


def test_broken_off_stream_fails_and_collector_answers_503() -> None:
    encoder = ResponsesEncoder(_assembler())
    encoder.start()
    encoder.feed(TextDelta(text="x"))
    last = _sse_events(encoder.broken_off())[-1]
    assert encoder.done and last["type"] == "response.failed"
    collector = ResponsesCollector(_assembler())
    collector.feed(TextDelta(text="x"))
    with pytest.raises(ApiError) as raised:
        collector.result()
    assert raised.value.status == 503


def test_echo_fits_the_sdk_response() -> None:
    fields = {
        "temperature": 0,
        "top_p": 0.5,
        "tool_choice": "required",
        "store": True,
        "metadata": {"k": "v"},
    }
    response = Response.model_validate(
        _collect([TextDelta(text="x"), Finish(reason="stop", usage=USAGE)], **fields)
    )
    assert (response.temperature, response.top_p, response.tool_choice) == (0, 0.5, "required")
    assert response.metadata == {"k": "v"} and response.model_extra == {"store": False}
    assert response.previous_response_id is None and response.parallel_tool_calls is True
