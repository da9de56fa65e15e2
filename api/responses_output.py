"""Backend events as one OpenAI Responses object and the stream events that build it (sans-I/O).

`ResponseAssembler` turns each backend event into the Responses stream events it causes (dicts
without `sequence_number`, which the encoder adds) and keeps the output items, so a streamed and a
non-streamed answer are the same object. The rules:

- Output items, in the order the model produced them: `reasoning` (raw reasoning as one
  `reasoning_text` content part, `summary` empty: there is no summarizer), `message` (one
  `output_text` part) and `function_call` (`call_id` is the runner's tool call id). A change of
  kind (text after reasoning or after a tool call, reasoning after text) opens a new item. A
  generation that produced no item at all still answers one empty message, so `output[0]` exists.
- A message or reasoning item streams `output_item.added`, `content_part.added`, its deltas,
  `.done`, `content_part.done`, `output_item.done`; a function call (complete when the runner sends
  it) streams `output_item.added`, one `function_call_arguments.delta`, `.done`, `output_item.done`.
- The end: `response.completed` (status "completed"; a cancelled generation simply stopped, as in
  chat completions), `response.incomplete` (Finish "length": status "incomplete", reason
  "max_output_tokens", the open item "incomplete"), or `response.failed` (an error after the stream
  started: status "failed" and `error`).
- Item ids are `msg_`, `rs_` and `fc_` + the response id's hex + `_` + the output index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, assert_never

from api.errors import error_type
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

Json = dict[str, Any]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
TextKind = Literal["message", "reasoning"]

_EVENT_STEM = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}

_FAILURE_CODES = {"invalid_request": "invalid_prompt", "overloaded": "rate_limit_exceeded"}
"""GenerationError kinds as the codes a Responses `error` object may carry (else "server_error")."""

_PARAMS = {"messages": "input"}
"""Backend error params in this surface's words (the runner names the chat field)."""


def surface_param(param: str | None) -> str | None:
    return None if param is None else _PARAMS.get(param, param)


def usage_json(usage: Usage, reasoning_tokens: int) -> Json:
    """The Responses usage object; `cached_tokens` counts prompt tokens served from the prefix cache.

    The cache is filled as a side effect, never as a billed write: `cache_write_tokens` is 0.
    """
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.total_tokens,
    }


def _part(kind: TextKind, text: str) -> Json:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


@dataclass
class _OpenItem:
    """The message or reasoning item whose text is still streaming."""

    kind: TextKind
    id: str
    index: int
    text: list[str] = field(default_factory=list)

    def json(self, status: ItemStatus, parts: list[Json]) -> Json:
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": parts}
        return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": parts}

    def where(self) -> Json:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}


class ResponseAssembler:
    """One response: `opening()`, then `feed()` each backend event until `end` is set."""

    def __init__(self, response_id: str, model: str, created_at: int, echo: Json) -> None:
        self._head: Json = {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "model": model,
            **echo,
        }
        self._hex = response_id.removeprefix("resp_")
        self._output: list[Json] = []
        self._open: _OpenItem | None = None
        self._reasoning_deltas = 0
        """Reasoning tokens, approximately: the runner sends about one delta per token."""
        self.end: Finish | GenerationError | None = None
        self.final: Json | None = None
        """The finished response object, once `end` is set."""

    def opening(self) -> list[Json]:
        snapshot = self._snapshot("in_progress")
        return [
            {"type": "response.created", "response": snapshot},
            {"type": "response.in_progress", "response": snapshot},
        ]

    def feed(self, event: ChunkEvent) -> list[Json]:
        assert self.end is None, "event after the end of the response"
        match event:
            case TextDelta(text=text):
                return self._delta("message", text)
            case ReasoningDelta(text=text):
                self._reasoning_deltas += 1
                return self._delta("reasoning", text)
            case ToolCall():
                return self._close("completed") + self._function_call(event)
            case PrefillProgress():
                return []
            case Finish():
                return self._finish(event)
            case GenerationError():
                return self._fail(event)
            case _:
                assert_never(event)

    def _item_id(self, kind: str, index: int) -> str:
        return f"{_ID_PREFIX[kind]}_{self._hex}_{index}"

    def _delta(self, kind: TextKind, text: str) -> list[Json]:
        events = [] if self._open is not None and self._open.kind == kind else self._close("completed")
        if self._open is None:
            events += self._start(kind)
        assert self._open is not None
        self._open.text.append(text)
        delta = {"type": f"{_EVENT_STEM[kind]}.delta", **self._open.where(), "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return [*events, delta]

    def _start(self, kind: TextKind) -> list[Json]:
        index = len(self._output)
        item = self._open = _OpenItem(kind, self._item_id(kind, index), index)
        added = {
            "type": "response.output_item.added",
            "output_index": index,
            "item": item.json("in_progress", []),
        }
        part = {"type": "response.content_part.added", **item.where(), "part": _part(kind, "")}
        return [added, part]

    def _close(self, status: ItemStatus) -> list[Json]:
        """Finish the streaming item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.text)
        done = {"type": f"{_EVENT_STEM[item.kind]}.done", **item.where(), "text": text}
        if item.kind == "message":
            done["logprobs"] = []
        part = _part(item.kind, text)
        finished = item.json(status, [part])
        self._output.append(finished)
        return [
            done,
            {"type": "response.content_part.done", **item.where(), "part": part},
            {"type": "response.output_item.done", "output_index": item.index, "item": finished},
        ]

    def _function_call(self, call: ToolCall) -> list[Json]:
        index = len(self._output)
        item_id = self._item_id("function_call", index)
        item = {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name}
        where = {"item_id": item_id, "output_index": index}
        finished = {**item, "arguments": call.arguments, "status": "completed"}
        self._output.append(finished)
        return [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**item, "arguments": "", "status": "in_progress"},
            },
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": index, "item": finished},
        ]

    def _finish(self, finish: Finish) -> list[Json]:
        incomplete = finish.reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        if not self._output:
            events += self._start("message") + self._close("incomplete" if incomplete else "completed")
        self.end = finish
        usage = usage_json(finish.usage, self._reasoning_deltas)
        if incomplete:
            details = {"reason": "max_output_tokens"}
            self.final = self._snapshot("incomplete", usage=usage, incomplete_details=details)
            return [*events, {"type": "response.incomplete", "response": self.final}]
        self.final = self._snapshot("completed", usage=usage)
        return [*events, {"type": "response.completed", "response": self.final}]

    def _fail(self, error: GenerationError) -> list[Json]:
        events = self._close("incomplete")
        self.end = error
        failure = {
            "code": _FAILURE_CODES.get(error.error_kind, "server_error"),
            "message": error.message,
            "param": surface_param(error.param),
            "type": error_type(error),
        }
        self.final = self._snapshot("failed", error=failure)
        return [*events, {"type": "response.failed", "response": self.final}]

    def _snapshot(self, status: str, **fields: Any) -> Json:
        return {
            **self._head,
            "status": status,
            "output": list(self._output),
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **fields,
        }
