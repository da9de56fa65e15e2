"""Backend chunk events as Claude Messages, streamed (Anthropic's named SSE events) or collected.

Sans-I/O: the classes take events and return bytes or dicts; `api/messages.py` moves them. Both
build the answer's content blocks with one `_Blocks`, so a stream and a collected answer hold the
same blocks: consecutive text deltas grow one `text` block, reasoning one `thinking` block (only
when the request enabled thinking: otherwise reasoning is dropped, as Anthropic's API shows none,
though its tokens still count in `output_tokens`), and each tool call is one `tool_use` block.

A stream goes `message_start` (empty content, zero usage: the prompt is counted only when the
generation ends), then per block `content_block_start`, `content_block_delta`s and
`content_block_stop`, then `message_delta` (stop reason, stop sequence and the real usage, which the
SDK merges over message_start's) and `message_stop`. A failure ends it with `event: error`. Prefill
progress travels as SSE comments, which the SDK skips; a quiet stream gets `ping` events.

Usage: `input_tokens` is the whole prompt, as `count_tokens` counts it, and the cache fields are 0.
Anthropic's cache fields describe caching a client asks for with `cache_control`, which Shoal does
not offer; its own prefix cache is automatic, and reporting its hits there would make the input of
two identical requests differ (the chat surface reports them as `cached_tokens`). `thinking` blocks
carry an empty `signature`: Shoal signs nothing, and reads any signature it is sent back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, assert_never

from api import sse
from api.errors import ApiError, from_generation_error
from api.surface import Surface
from protocol.events import (
    UNFINISHED,
    ChunkEvent,
    Finish,
    GenerationError,
    PrefillProgress,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    Usage,
)

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (other 4xx: invalid request; other 5xx: api_error)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    """One named SSE event, as Anthropic sends them: the name also appears as the data's `type`."""
    return sse.named(name, {"type": name, **payload})


ANTHROPIC = Surface("anthropic", error_body=error_body, paths=("/v1/messages",))


def stop_reason(finish: Finish, saw_tool_call: bool) -> StopReason:
    """A cut at max_tokens says so even mid tool call (the call may be incomplete); a cancelled
    generation simply ended its turn."""
    if finish.reason == "length":
        return "max_tokens"
    if finish.reason == "tool_calls" or saw_tool_call:
        return "tool_use"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def usage_json(usage: Usage) -> dict[str, int]:
    """Anthropic's usage; the prefix cache's hits are not Anthropic's cache reads (module docstring)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


NO_USAGE = usage_json(Usage(prompt_tokens=0, completion_tokens=0))


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` must be.

    The runner does not validate them (a cut generation can leave them incomplete): arguments that
    are not a JSON object become `{}`, so that clients, streamed or not, always get an object.
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` prefix on the runner's call id; the id only has to come back unchanged."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass(frozen=True)
class BlockStart:
    index: int
    block: dict[str, Any]


@dataclass(frozen=True)
class BlockDelta:
    index: int
    delta: dict[str, Any]


@dataclass(frozen=True)
class BlockStop:
    index: int


Step = BlockStart | BlockDelta | BlockStop


@dataclass
class _Blocks:
    """Content events as steps on the answer's content blocks: which one opens, grows, closes."""

    show_thinking: bool
    count: int = 0
    open: Literal["text", "thinking"] | None = None
    saw_tool_call: bool = False

    def feed(self, event: TextDelta | ReasoningDelta | ToolCall) -> list[Step]:
        match event:
            case TextDelta(text=text) if text:
                return self._grow("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text})
            case ReasoningDelta(text=text) if text and self.show_thinking:
                empty = {"type": "thinking", "thinking": "", "signature": ""}
                return self._grow("thinking", empty, {"type": "thinking_delta", "thinking": text})
            case ToolCall():
                self.saw_tool_call = True
                steps = self.close()
                block = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}}
                partial = sse.compact_json(tool_input(event.arguments))
                index, self.count = self.count, self.count + 1
                delta = {"type": "input_json_delta", "partial_json": partial}
                return [*steps, BlockStart(index, block), BlockDelta(index, delta), BlockStop(index)]
            case _:
                return []  # Empty, or reasoning the request did not ask to see.

    def close(self) -> list[Step]:
        """The step that closes the open text or thinking block, if one is open."""
        if self.open is None:
            return []
        self.open = None
        return [BlockStop(self.count - 1)]

    def _grow(
        self, kind: Literal["text", "thinking"], empty: dict[str, Any], delta: dict[str, Any]
    ) -> list[Step]:
        steps: list[Step] = []
        if self.open != kind:
            steps = [*self.close(), BlockStart(self.count, empty)]
            self.count += 1
            self.open = kind
        return [*steps, BlockDelta(self.count - 1, delta)]


def _message(message_id: str, model: str, content: list[dict[str, Any]], **end: Any) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": end.get("stop_reason"),
        "stop_sequence": end.get("stop_sequence"),
        "usage": end.get("usage", NO_USAGE),
    }


def _stream_error(event: GenerationError) -> bytes:
    return _event("error", {"error": error_body(from_generation_error(event))["error"]})


class MessagesEncoder:
    """One streamed message: `start()`, then `feed()` each event until `done`."""

    def __init__(self, message_id: str, model: str, *, show_thinking: bool) -> None:
        self._id = message_id
        self._model = model
        self._blocks = _Blocks(show_thinking)
        self.done = False
        """True once the stream's last frame (`message_stop` or `error`) was returned."""

    def start(self) -> bytes:
        return _event("message_start", {"message": _message(self._id, self._model, [])})

    def feed(self, event: ChunkEvent) -> bytes:
        assert not self.done, "event after the end of the stream"
        match event:
            case TextDelta() | ReasoningDelta() | ToolCall():
                return b"".join(_step_event(step) for step in self._blocks.feed(event))
            case PrefillProgress():
                return sse.prefill_progress(event)
            case Finish():
                self.done = True
                frames = b"".join(_step_event(step) for step in self._blocks.close())
                delta = {
                    "stop_reason": stop_reason(event, self._blocks.saw_tool_call),
                    "stop_sequence": event.stop_sequence,
                }
                frames += _event("message_delta", {"delta": delta, "usage": usage_json(event.usage)})
                return frames + _event("message_stop", {})
            case GenerationError():
                self.done = True
                return _stream_error(event)
            case _:
                assert_never(event)

    def broken_off(self) -> bytes:
        return self.feed(UNFINISHED)

    def keep_alive(self) -> bytes:
        return _event("ping", {})


def _step_event(step: Step) -> bytes:
    match step:
        case BlockStart(index=index, block=block):
            return _event("content_block_start", {"index": index, "content_block": block})
        case BlockDelta(index=index, delta=delta):
            return _event("content_block_delta", {"index": index, "delta": delta})
        case BlockStop(index=index):
            return _event("content_block_stop", {"index": index})
        case _:
            assert_never(step)


def _ended(end: Finish | GenerationError | None) -> Finish:
    """The generation's `Finish`; its error as an `ApiError` if it failed or broke off."""
    if isinstance(end, GenerationError):
        raise from_generation_error(end)
    if end is None:
        raise from_generation_error(UNFINISHED)
    return end


class MessagesCollector:
    """One non-streamed message: `feed()` every event, then `result()`."""

    def __init__(self, message_id: str, model: str, *, show_thinking: bool) -> None:
        self._id = message_id
        self._model = model
        self._blocks = _Blocks(show_thinking)
        self._content: list[dict[str, Any]] = []
        self._end: Finish | GenerationError | None = None

    def feed(self, event: ChunkEvent) -> None:
        match event:
            case TextDelta() | ReasoningDelta() | ToolCall():
                for step in self._blocks.feed(event):
                    self._apply(step)
            case PrefillProgress():
                pass
            case Finish() | GenerationError():
                self._end = event
            case _:
                assert_never(event)

    def _apply(self, step: Step) -> None:
        match step:
            case BlockStart(block=block):
                self._content.append(dict(block))
            case BlockDelta(index=index, delta=delta):
                block = self._content[index]
                if delta["type"] == "input_json_delta":
                    block["input"] = json.loads(delta["partial_json"])
                else:
                    key = block["type"]  # "text" or "thinking": the delta grows the field of that name
                    block[key] += delta[key]
            case BlockStop():
                pass
            case _:
                assert_never(step)

    def result(self) -> dict[str, Any]:
        """The `message` object; raises `ApiError` if the generation failed or broke off."""
        end = _ended(self._end)
        return _message(
            self._id,
            self._model,
            self._content,
            stop_reason=stop_reason(end, self._blocks.saw_tool_call),
            stop_sequence=end.stop_sequence,
            usage=usage_json(end.usage),
        )


class TokenCounter:
    """`count_tokens`: `feed()` the events of a `count_only` request, then `result()`."""

    def __init__(self) -> None:
        self._end: Finish | GenerationError | None = None

    def feed(self, event: ChunkEvent) -> None:
        if isinstance(event, Finish | GenerationError):
            self._end = event

    def result(self) -> dict[str, int]:
        return {"input_tokens": _ended(self._end).usage.prompt_tokens}
