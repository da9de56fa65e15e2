"""The Ollama encoder and collector, sans-I/O: scripted events in, and the `ollama` client parses what
comes out (its own stream reader, over `httpx.MockTransport`), so these prove the client accepts it.

Covers what the random-weight model on a real node cannot show: tool calls, reasoning, a mid-stream
error, exact durations on a scripted clock, and the keep-alive lines of a quiet stream (EventStream
on trio's mock clock). The real-node checks are in tests/test_api_ollama.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn, cast

import httpx
import ollama
import pytest
import trio
import trio.testing

from api.backend import Backend
from api.errors import parse_body
from api.ollama_encode import OLLAMA, Clock, Kind, OllamaCollector, OllamaEncoder
from api.ollama_request import chat_messages
from api.ollama_schema import ChatBody
from api.streaming import EventStream
from protocol.chat import ChatMessage, GenerateRequest
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
from protocol.ids import ModelId, RequestId

MODEL = "m"
USAGE = Usage(prompt_tokens=7, completion_tokens=3)
WEATHER = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris", "days": 2}')


def scripted_clock(step_ns: int = 10) -> Clock:
    """Each reading is `step_ns` later than the one before; the wall clock stands still."""
    ticks = itertools.count(0, step_ns)
    return Clock(monotonic_ns=lambda: next(ticks), wall=lambda: 1_700_000_000.25)


def finish(reason: FinishReason = "stop") -> Finish:
    return Finish(reason=reason, usage=USAGE)


def encode(events: Sequence[ChunkEvent], kind: Kind = "chat", *, show_thinking: bool = True) -> bytes:
    encoder = OllamaEncoder(kind, MODEL, scripted_clock(), started_ns=-10, show_thinking=show_thinking)
    out = encoder.start()
    for event in events:
        out += encoder.feed(event)
    assert encoder.done
    return out


def collected(events: Sequence[ChunkEvent], kind: Kind = "chat", *, show_thinking: bool = True) -> bytes:
    collector = OllamaCollector(kind, MODEL, scripted_clock(), started_ns=-10, show_thinking=show_thinking)
    for event in events:
        collector.feed(event)
    return json.dumps(collector.result()).encode()


def client_over(body: bytes) -> ollama.Client:
    """An `ollama.Client` whose every request answers `body`."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})

    return ollama.Client(host="http://shoal.test", transport=httpx.MockTransport(answer))


def chat_stream(body: bytes) -> list[ollama.ChatResponse]:
    return list(
        client_over(body).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    )


def test_tool_call_streams_as_ollama_tool_calls() -> None:
    events: list[ChunkEvent] = [
        PrefillProgress(processed_tokens=0, total_tokens=7),
        TextDelta(text="Checking."),
        WEATHER,
    ]
    chunks = chat_stream(encode([*events, finish("tool_calls")]))
    calls = [call for chunk in chunks for call in chunk.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert "".join(chunk.message.content or "" for chunk in chunks) == "Checking."
    assert chunks[-1].done and chunks[-1].done_reason == "stop"
    assert all(not chunk.done for chunk in chunks[:-1])


def test_tool_call_collected_into_one_message() -> None:
    second = ToolCall(id="call_2", name="get_time", arguments="")
    body = collected([WEATHER, second, finish("tool_calls")])
    response = client_over(body).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    calls = response.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    raw = json.loads(body)["message"]["tool_calls"]
    assert [(call["id"], call["function"]["index"]) for call in raw] == [("call_1", 0), ("call_2", 1)]
    assert response.done_reason == "stop" and response.message.content == ""


def test_malformed_tool_call_arrives_as_text() -> None:
    """Cut by num_predict, the arguments are no object; Ollama's clients require one."""
    cut = ToolCall(id="call_3", name="get_weather", arguments='{"city": "Par')
    chunks = chat_stream(encode([cut, finish("length")]))
    assert not any(chunk.message.tool_calls for chunk in chunks)
    text = "".join(chunk.message.content or "" for chunk in chunks)
    assert json.loads(text) == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert chunks[-1].done_reason == "length"


def test_generate_has_no_tool_calls_but_keeps_their_text() -> None:
    body = collected([TextDelta(text="a"), WEATHER, finish()], kind="generate")
    response = client_over(body).generate(model=MODEL, prompt="hi")
    assert response.response == 'a{"name":"get_weather","arguments":{"city":"Paris","days":2}}'


@pytest.mark.parametrize("kind", ["chat", "generate"])
def test_thinking_shown_or_left_out(kind: Kind) -> None:
    events: list[ChunkEvent] = [
        ReasoningDelta(text="hm, "),
        ReasoningDelta(text="colours"),
        TextDelta(text="Red."),
        finish(),
    ]
    shown, hidden = encode(events, kind), encode(events, kind, show_thinking=False)
    if kind == "chat":
        chunks = chat_stream(shown)
        assert "".join(c.message.thinking or "" for c in chunks) == "hm, colours"
        assert "".join(c.message.content or "" for c in chunks) == "Red."
        assert not any(c.message.thinking for c in chat_stream(hidden))
        whole = client_over(collected(events, kind)).chat(model=MODEL, messages=[])
        assert (whole.message.thinking, whole.message.content) == ("hm, colours", "Red.")
    else:
        parts = list(client_over(shown).generate(model=MODEL, prompt="hi", stream=True))
        assert "".join(p.thinking or "" for p in parts) == "hm, colours"
        assert "".join(p.response or "" for p in parts) == "Red."
        assert b"thinking" not in hidden and b"thinking" not in collected(events, kind, show_thinking=False)


def test_mid_stream_error_is_a_last_error_line_the_client_raises() -> None:
    failed = GenerationError(error_kind="server_error", message="the model runner stopped unexpectedly")
    body = encode([TextDelta(text="Red"), failed])
    assert body.splitlines()[-1] == b'{"error":"the model runner stopped unexpectedly"}'
    received: list[ollama.ChatResponse] = []
    with pytest.raises(ollama.ResponseError, match="runner stopped unexpectedly"):
        for chunk in client_over(body).chat(model=MODEL, messages=[], stream=True):
            received.append(chunk)
    assert [chunk.message.content for chunk in received] == ["Red"]


def test_broken_off_stream_ends_with_an_error_line() -> None:
    encoder = OllamaEncoder("chat", MODEL, scripted_clock(), started_ns=0, show_thinking=True)
    encoder.feed(TextDelta(text="Red"))
    assert json.loads(encoder.broken_off()) == {"error": "the generation ended without finishing"}
    assert encoder.done


def test_durations_from_the_event_times() -> None:
    """Readings 10 ns apart: started at -10; progress at 0 and 10, tokens at 20 and 30, finish at 40."""
    events: list[ChunkEvent] = [
        PrefillProgress(processed_tokens=0, total_tokens=7),
        PrefillProgress(processed_tokens=7, total_tokens=7),
        TextDelta(text="Red"),
        TextDelta(text="."),
        finish("length"),
    ]
    last = json.loads(encode(events).splitlines()[-1])
    assert last == {
        "model": MODEL,
        "created_at": "2023-11-14T22:13:20.250000Z",
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "length",
        "total_duration": 50,
        "load_duration": 10,
        "prompt_eval_count": 7,
        "prompt_eval_duration": 20,
        "eval_count": 3,
        "eval_duration": 20,
    }
    whole = json.loads(collected(events))
    assert {k: v for k, v in whole.items() if k != "message"} == {
        k: v for k, v in last.items() if k != "message"
    }


def test_prefill_progress_lines_parse_as_empty_chunks() -> None:
    events = [PrefillProgress(processed_tokens=n, total_tokens=1024) for n in (0, 512, 1024)]
    body = encode([*events, TextDelta(text="Red"), finish()])
    lines = [json.loads(line) for line in body.splitlines()]
    assert [line.get("prefill_progress") for line in lines[:3]] == [
        {"processed_tokens": n, "total_tokens": 1024} for n in (0, 512, 1024)
    ]
    chunks = chat_stream(body)
    assert [chunk.message.content for chunk in chunks] == ["", "", "", "Red", ""]


class QuietBackend:
    """Prefill progress at once, then `quiet_s` (trio's clock) without an event, or with reasoning
    every second (which `think: false` leaves out), then the answer."""

    def __init__(self, quiet_s: float, *, reasoning: bool) -> None:
        self.quiet_s = quiet_s
        self.reasoning = reasoning

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        async def events() -> AsyncIterator[ChunkEvent]:
            yield PrefillProgress(processed_tokens=0, total_tokens=7)
            if self.reasoning:
                for _ in range(int(self.quiet_s)):
                    await trio.sleep(1.0)
                    yield ReasoningDelta(text="hm")
            else:
                await trio.sleep(self.quiet_s)
            yield TextDelta(text="Red")
            yield finish()

        yield events()


def quiet_stream(
    kind: Kind, quiet_s: float, keepalive_s: float, *, hidden_reasoning: bool = False
) -> list[bytes]:
    """The body frames of an Ollama stream over `QuietBackend`, as `api.ollama` sets it up."""
    sent: list[bytes] = []
    request = GenerateRequest(
        request_id=RequestId("ollama-test"), model=ModelId(MODEL), messages=(ChatMessage(role="user"),)
    )

    async def receive() -> NoReturn:  # the client never hangs up
        await trio.sleep_forever()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            sent.append(message["body"])

    async def main() -> None:
        encoder = OllamaEncoder(kind, MODEL, Clock(), started_ns=0, show_thinking=not hidden_reasoning)
        backend = cast(Backend, QuietBackend(quiet_s, reasoning=hidden_reasoning))
        await EventStream(backend, request, encoder, surface=OLLAMA, keepalive_s=keepalive_s)(
            {"type": "http"}, receive, send
        )

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return sent


@pytest.mark.parametrize("kind", ["chat", "generate"])
@pytest.mark.parametrize("hidden_reasoning", [False, True], ids=["no events", "hidden reasoning"])
def test_keep_alive_lines_of_a_quiet_stream_parse(kind: Kind, hidden_reasoning: bool) -> None:
    """A stream that sends nothing for `keepalive_s` gets a line: while the prompt is read (no
    events), and while reasoning that `think: false` leaves out arrives (events, nothing sent)."""
    frames = quiet_stream(kind, quiet_s=25.0, keepalive_s=10.0, hidden_reasoning=hidden_reasoning)
    keep_alive = [frame for frame in frames if b"prefill_progress" not in frame and b'"done":false' in frame]
    assert len(keep_alive) == 3  # two while quiet (at 10 s and 20 s), and the "Red" line
    assert all(json.loads(quiet)["model"] == MODEL and quiet.endswith(b"}\n") for quiet in keep_alive[:2])
    body = b"".join(frames)
    if kind == "chat":
        chunks = chat_stream(body)
        assert [c.message.content for c in chunks] == ["", "", "", "Red", ""] and chunks[-1].done
    else:
        parts = list(client_over(body).generate(model=MODEL, prompt="hi", stream=True))
        assert [p.response for p in parts] == ["", "", "", "Red", ""] and parts[-1].done


def conversation(messages: list[dict[str, Any]]) -> Iterator[ChatMessage]:
    yield from chat_messages(
        parse_body(ChatBody, json.dumps({"model": MODEL, "messages": messages}).encode()).messages
    )


def test_tool_results_pair_with_the_calls_they_answer() -> None:
    """Ollama pairs a result with a call by order and `tool_name`; chat templates want ids."""
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_x", "function": {"name": "get_time", "arguments": {}}},
    ]
    messages = list(
        conversation(
            [
                {"role": "user", "content": "Weather and time in Paris?"},
                {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_name": "get_time", "content": "noon"},
                {"role": "tool", "content": "sunny"},
            ]
        )
    )
    assistant, time_result, weather_result = messages[1:]
    assert assistant.content == ""
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("call_1_0", "get_weather", {"city": "Paris"}),
        ("call_x", "get_time", {}),
    ]
    assert (time_result.tool_call_id, time_result.name) == ("call_x", "get_time")
    assert (weather_result.tool_call_id, weather_result.name) == ("call_1_0", None)
