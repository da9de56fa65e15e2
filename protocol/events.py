"""Chunk events: what a generation produces, in the order it produces them.

A runner turns tokens into these; the API turns them into OpenAI chunks. Every stream ends with
exactly one terminal event: `Finish` or `GenerationError`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Usage(_Event):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV cache came from an earlier request (the prefix cache): not recomputed."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Output(_Event):
    tokens: tuple[NonNegativeInt, ...] = ()
    """The generated token ids the runner consumed since its previous output event (empty for a
    second event from the same token). Encoders ignore them; failover collects them, so that
    another instance can continue exactly here (`protocol.chat.Resume`)."""


class TextDelta(_Output):
    """A piece of the answer's visible content."""

    kind: Literal["text"] = "text"
    text: str


class ReasoningDelta(_Output):
    """A piece of the model's reasoning (harmony analysis channel, `<think>` blocks)."""

    kind: Literal["reasoning"] = "reasoning"
    text: str


class ToolCall(_Output):
    """One complete tool call; `arguments` is a JSON document as a string, as OpenAI sends it."""

    kind: Literal["tool_call"] = "tool_call"
    id: str
    name: str
    arguments: str


class PrefillProgress(_Event):
    """Sent while the prompt is processed, before the first token; the first one has processed=0.

    With a prefix-cache hit the second one jumps to the cached token count; the last one has
    processed == total.
    """

    kind: Literal["prefill_progress"] = "prefill_progress"
    processed_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class Finish(_Event):
    """The generation ended normally (or was cancelled on request)."""

    kind: Literal["finish"] = "finish"
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    """The client's stop string that ended the text (reason "stop"); None for end-of-sequence."""


ErrorKind = Literal["invalid_request", "server_error", "overloaded"]


RUNNER_UNAVAILABLE = "runner_unavailable"
"""`GenerationError.code`: the runner died, was stopped, or is not ready (failover retries it)."""
PIPELINE_FAILED = "pipeline_failed"
"""`GenerationError.code`: a link or a later stage of a pipeline broke off mid-request (failover
retries it)."""


class GenerationError(_Event):
    """The generation could not run or broke off.

    `invalid_request` errors come before any output (prompt too long, template rejects the messages)
    and the API answers them with a 4xx; `server_error` is a fault on our side (runner died);
    `overloaded` comes first too, when the model's request queue is full (the API answers 429).
    """

    kind: Literal["error"] = "error"
    error_kind: ErrorKind
    message: str
    code: str | None = None
    param: str | None = None


ChunkEvent = Annotated[
    TextDelta | ReasoningDelta | ToolCall | PrefillProgress | Finish | GenerationError,
    Field(discriminator="kind"),
]
TerminalEvent = Finish | GenerationError
OutputEvent = TextDelta | ReasoningDelta | ToolCall
"""What a generation's tokens turn into (the events that carry `tokens`)."""


def is_terminal(event: ChunkEvent) -> bool:
    return isinstance(event, Finish | GenerationError)
