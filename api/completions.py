"""Backend chunk events as OpenAI chat-completion objects, streamed (SSE frames) or collected (one object).

Sans-I/O: both classes take events and return bytes or dicts; `api/chat.py` moves them. The stream
rules (`ChatEncoder`): every chunk carries the same id, `created` and `model`; the first chunk's delta carries
`role: "assistant"`; `finish_reason` appears only on the last choice chunk (`tool_calls` whenever a
tool call was emitted); with `include_usage` a final chunk with `choices: []` carries the usage; the
stream ends with `data: [DONE]`, also after an error.
"""

from __future__ import annotations

from typing import Any, Literal, assert_never

from api import sse
from api.errors import ApiError, error_type, from_generation_error
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

OpenAIFinishReason = Literal["stop", "length", "tool_calls"]


def finish_reason(reason: FinishReason, saw_tool_call: bool) -> OpenAIFinishReason:
    """OpenAI has no "cancelled": a generation cancelled on request simply stopped."""
    if saw_tool_call:
        return "tool_calls"
    return "stop" if reason == "cancelled" else reason


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` counts prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def error_json(event: GenerationError) -> dict[str, Any]:
    error = {"message": event.message, "type": error_type(event), "param": event.param, "code": event.code}
    return {"error": error}


def _tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ChatEncoder:
    """One streamed completion: `start()`, then `feed()` each event until `done`."""

    def __init__(self, completion_id: str, model: str, created: int, *, include_usage: bool) -> None:
        self._id = completion_id
        self._model = model
        self._created = created
        self._include_usage = include_usage
        self._tool_calls = 0
        self.done = False
        """True once the stream's last frame (`[DONE]`) was returned; feed nothing more."""

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": choices,
            **extra,
        }
        return sse.data(chunk)

    def _delta(self, delta: dict[str, Any], finish: OpenAIFinishReason | None = None) -> bytes:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])

    def start(self) -> bytes:
        return self._delta({"role": "assistant", "content": ""})

    def feed(self, event: ChunkEvent) -> bytes:
        assert not self.done, "event after the end of the stream"
        match event:
            case TextDelta(text=text):
                return self._delta({"content": text})
            case ReasoningDelta(text=text):
                return self._delta({"reasoning_content": text})
            case ToolCall():
                self._tool_calls += 1
                return self._delta({"tool_calls": [_tool_call_json(event, self._tool_calls - 1)]})
            case PrefillProgress():
                return sse.prefill_progress(event)
            case Finish(reason=reason, usage=usage):
                self.done = True
                frames = self._delta({}, finish_reason(reason, self._tool_calls > 0))
                if self._include_usage:
                    frames += self._chunk([], usage=usage_json(usage))
                return frames + sse.DONE
            case GenerationError():
                self.done = True
                return sse.data(error_json(event)) + sse.DONE
            case _:
                assert_never(event)

    def broken_off(self) -> bytes:
        return self.feed(UNFINISHED)

    def keep_alive(self) -> bytes:
        return sse.KEEP_ALIVE


class ChatCollector:
    """One non-streamed completion: `feed()` every event, then `result()`."""

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self._id = completion_id
        self._model = model
        self._created = created
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[dict[str, Any]] = []
        self._end: Finish | GenerationError | None = None

    def feed(self, event: ChunkEvent) -> None:
        match event:
            case TextDelta(text=text):
                self._text.append(text)
            case ReasoningDelta(text=text):
                self._reasoning.append(text)
            case ToolCall():
                call = _tool_call_json(event, len(self._tool_calls))
                del call["index"]
                self._tool_calls.append(call)
            case PrefillProgress():
                pass
            case Finish() | GenerationError():
                self._end = event
            case _:
                assert_never(event)

    def result(self) -> dict[str, Any]:
        """The `chat.completion` object; raises `ApiError` if the generation failed or broke off."""
        end = self._end
        if isinstance(end, GenerationError):
            raise from_generation_error(end)
        if end is None:
            raise ApiError(503, "the generation ended without finishing")
        text = "".join(self._text)
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if self._tool_calls else "")}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tool_calls:
            message["tool_calls"] = self._tool_calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason(end.reason, bool(self._tool_calls)),
        }
        return {
            "id": self._id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "usage": usage_json(end.usage),
        }
