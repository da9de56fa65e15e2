"""Backend chunk events as Ollama answers: NDJSON lines streamed (`OllamaEncoder`) or one object
(`OllamaCollector`). Sans-I/O: events in, bytes or dicts out; the clock is an argument.

Every line is one JSON object that the `ollama` client parses into its response type (it reads the
stream with `json.loads` per line, raises on an `error` key, and builds `ChatResponse` (which needs
`message.role`) or `GenerateResponse` from the rest, ignoring unknown keys). So each line carries
`model`, `created_at` (RFC 3339) and `done`, plus `message` {role, content, thinking?, tool_calls?}
(`/api/chat`) or `response` and `thinking?` (`/api/generate`); the last one has `done: true`,
`done_reason` ("stop" or "length") and the counts and durations. Lines with nothing to say are
ordinary lines with empty content, which clients append as nothing:
- prefill progress: an empty line with `"prefill_progress": {"processed_tokens", "total_tokens"}`;
- keep-alive (a stream quiet while a long prompt is read): the same empty line without it, dated at
  the request's start (the frame is fixed when the stream opens); reasoning left out (`think:
  false`) gets one such line per keep-alive interval too, since its events reset EventStream's timer;
- an error after the stream began: a last line `{"error": "..."}`, which the client raises as
  `ollama.ResponseError`.

Durations are nanoseconds on the API side's monotonic clock, from the request's arrival:
`load_duration` until the backend's first event (routing and queueing: a placed model is always
loaded), `prompt_eval_duration` from then until the first generated token (the prompt's
processing), `eval_duration` from then until the end; `total_duration` is their sum.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, assert_never

from api import sse
from api.errors import ApiError, from_generation_error
from api.surface import Surface
from protocol.events import (
    UNFINISHED,
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

NDJSON = "application/x-ndjson"

Kind = Literal["chat", "generate"]
"""Which endpoint the answer is for: the text goes in `message.content` or in `response`."""


def ndjson_line(value: Any) -> bytes:
    return (sse.compact_json(value) + "\n").encode()


def error_body(error: ApiError) -> dict[str, Any]:
    """Ollama's error shape, for every status."""
    return {"error": error.message}


OLLAMA = Surface("ollama", media_type=NDJSON, error_body=error_body, paths=("/api/",))


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Clock:
    """Where an answer's times come from: passed in, so that tests can script them."""

    monotonic_ns: Callable[[], int] = time.monotonic_ns
    """For durations."""
    wall: Callable[[], float] = time.time
    """For `created_at` and `modified_at`: seconds since the epoch."""


SYSTEM_CLOCK = Clock()


class Timings:
    """Ollama's counts and durations of one generation, from the times its events arrived."""

    def __init__(self, started_ns: int) -> None:
        self._started = started_ns
        self._first_event: int | None = None
        self._first_token: int | None = None

    def see(self, event: ChunkEvent, now_ns: int) -> None:
        if self._first_event is None:
            self._first_event = now_ns
        if self._first_token is None and isinstance(event, TextDelta | ReasoningDelta | ToolCall):
            self._first_token = now_ns

    def json(self, usage: Usage, now_ns: int) -> dict[str, int]:
        """`prompt_eval_count` is the whole prompt, cached prefix included (Ollama: "number of tokens
        in the prompt"), so it is the same whether or not the prefix cache served part of it."""
        first_event = now_ns if self._first_event is None else self._first_event
        first_token = now_ns if self._first_token is None else self._first_token
        return {
            "total_duration": now_ns - self._started,
            "load_duration": first_event - self._started,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": first_token - first_event,
            "eval_count": usage.completion_tokens,
            "eval_duration": now_ns - first_token,
        }


def done_reason(reason: FinishReason) -> str:
    """Ollama knows "stop" and "length": a tool call or a cancel on request simply stopped."""
    return "length" if reason == "length" else "stop"


def _arguments(call: ToolCall) -> Any:
    """The call's arguments as JSON (an object when well formed); "" is no arguments."""
    if not call.arguments.strip():
        return {}
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def tool_call_json(call: ToolCall, index: int) -> dict[str, Any] | None:
    """Ollama's tool call, arguments as an object; None when they are not one (a call cut short by
    `num_predict`), since Ollama's clients require an object."""
    arguments = _arguments(call)
    if not isinstance(arguments, dict):
        return None
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def tool_call_text(call: ToolCall) -> str:
    """A call Ollama cannot carry as `tool_calls`, as the text the model meant: where it is malformed,
    or on `/api/generate`, which has no tools."""
    return sse.compact_json({"name": call.name, "arguments": _arguments(call)})


class _Answer:
    """What an Ollama answer's objects share, streamed or not."""

    def __init__(self, kind: Kind, model: str, clock: Clock, *, started_ns: int, show_thinking: bool) -> None:
        self._kind = kind
        self._model = model
        self._clock = clock
        self._show_thinking = show_thinking
        self._timings = Timings(started_ns)
        self._calls = 0

    def _header(self, at: float | None = None) -> dict[str, Any]:
        return {"model": self._model, "created_at": rfc3339(self._clock.wall() if at is None else at)}

    def _content(
        self, text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        extra: dict[str, Any] = {"thinking": thinking} if thinking else {}
        if self._kind == "generate":
            return {"response": text, **extra}
        if calls:
            extra["tool_calls"] = calls
        return {"message": {"role": "assistant", "content": text, **extra}}

    def _call(self, call: ToolCall) -> tuple[str, dict[str, Any] | None]:
        """A tool call as (text, tool call): one of them empty."""
        shown = tool_call_json(call, self._calls) if self._kind == "chat" else None
        if shown is None:
            return tool_call_text(call), None
        self._calls += 1
        return "", shown

    def loaded(self) -> dict[str, Any]:
        return {**self._header(), **self._content(), "done": True, "done_reason": "load"}

    def _see(self, event: ChunkEvent) -> int:
        """Note when `event` arrived (now); returns the time."""
        now = self._clock.monotonic_ns()
        self._timings.see(event, now)
        return now

    def _end(self, finish: Finish, content: dict[str, Any], now_ns: int) -> dict[str, Any]:
        timings = self._timings.json(finish.usage, now_ns)
        return {
            **self._header(),
            **content,
            "done": True,
            "done_reason": done_reason(finish.reason),
            **timings,
        }


class OllamaEncoder(_Answer):
    """One streamed answer: `start()`, then `feed()` each event until `done`."""

    def __init__(
        self,
        kind: Kind,
        model: str,
        clock: Clock,
        *,
        started_ns: int,
        show_thinking: bool,
    ) -> None:
        super().__init__(kind, model, clock, started_ns=started_ns, show_thinking=show_thinking)
        self.done = False
        """True once the last line was returned; feed nothing more."""

    def feed(self, event: ChunkEvent) -> bytes:
        assert not self.done, "event after the end of the stream"
        now = self._see(event)
        if isinstance(event, ReasoningDelta) and not self._show_thinking:
            return b""  # hidden reasoning: `EventStream` keeps the quiet stream alive
        return self._render(event, now)

    def keep_alive(self) -> bytes:
        """An empty line, as the client appends: nothing (for chat and generate alike)."""
        return self._line(self._content())

    def _line(self, content: dict[str, Any], **extra: Any) -> bytes:
        return ndjson_line({**self._header(), **content, "done": False, **extra})

    def start(self) -> bytes:
        return b""

    def _render(self, event: ChunkEvent, now: int) -> bytes:
        match event:
            case TextDelta(text=text):
                return self._line(self._content(text))
            case ReasoningDelta(text=text):
                return self._line(self._content(thinking=text))
            case ToolCall():
                text, call = self._call(event)
                return self._line(self._content(text, calls=[call] if call else None))
            case PrefillProgress(processed_tokens=processed, total_tokens=total):
                progress = {"processed_tokens": processed, "total_tokens": total}
                return self._line(self._content(), prefill_progress=progress)
            case Finish():
                self.done = True
                return ndjson_line(self._end(event, self._content(), now))
            case GenerationError(message=message):
                self.done = True
                return ndjson_line({"error": message})
            case _:
                assert_never(event)

    def broken_off(self) -> bytes:
        return self.feed(UNFINISHED)


class OllamaCollector(_Answer):
    """One answer as a single object: `feed()` every event, then `result()`."""

    def __init__(self, kind: Kind, model: str, clock: Clock, *, started_ns: int, show_thinking: bool) -> None:
        super().__init__(kind, model, clock, started_ns=started_ns, show_thinking=show_thinking)
        self._text: list[str] = []
        self._thinking: list[str] = []
        self._tool_calls: list[dict[str, Any]] = []
        self._end_event: Finish | GenerationError | None = None
        self._end_ns = 0

    def feed(self, event: ChunkEvent) -> None:
        now = self._see(event)
        match event:
            case TextDelta(text=text):
                self._text.append(text)
            case ReasoningDelta(text=text):
                if self._show_thinking:
                    self._thinking.append(text)
            case ToolCall():
                text, call = self._call(event)
                self._text.append(text)
                if call:
                    self._tool_calls.append(call)
            case PrefillProgress():
                pass
            case Finish() | GenerationError():
                self._end_event, self._end_ns = event, now
            case _:
                assert_never(event)

    def result(self) -> dict[str, Any]:
        """The answer; raises `ApiError` if the generation failed or broke off."""
        end = self._end_event
        if isinstance(end, GenerationError):
            raise from_generation_error(end)
        if end is None:
            raise from_generation_error(UNFINISHED)
        content = self._content("".join(self._text), "".join(self._thinking), self._tool_calls)
        return self._end(end, content, self._end_ns)


def load_answer(kind: Kind, model: str, clock: Clock) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate (no messages, no prompt): it loads the
    model. A placed model is loaded already, so this is immediate."""
    return _Answer(kind, model, clock, started_ns=0, show_thinking=False).loaded()
