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


ErrorCode = Literal[
    "runner_unavailable",
    "pipeline_failed",
    "node_unavailable",
    "model_files_unavailable",
    "model_loading",
    "model_not_found",
    "too_many_requests",
    "request_too_large",
    "context_length_exceeded",
    "token_out_of_vocabulary",
]
"""Every `GenerationError.code`, one closed set: producers name the constants below and the failover
decision (`node.serving.failover`) tests the same ones, so a retry never rests on two spellings agreeing.
Clients see the plain strings (the OpenAI-style `code` of an error)."""
RUNNER_UNAVAILABLE: ErrorCode = "runner_unavailable"
"""The runner died, was stopped, or is not ready (failover retries it)."""
PIPELINE_FAILED: ErrorCode = "pipeline_failed"
"""A link or a later stage of a pipeline broke off mid-request (failover retries it)."""
NODE_UNAVAILABLE: ErrorCode = "node_unavailable"
"""The entry node could not be reached or broke off (`node.serving.routing`; failover retries it)."""
MODEL_FILES_UNAVAILABLE: ErrorCode = "model_files_unavailable"
"""No node can get the model's files (`protocol.model_files.files_unavailable`): failover does not
wait for it, and the client learns why at once."""
MODEL_LOADING: ErrorCode = "model_loading"
"""The model's runner is still loading past the load wait (failover waits and retries)."""
MODEL_NOT_FOUND: ErrorCode = "model_not_found"
"""No instance serves the model here (while failing over: being re-placed, so it waits)."""
TOO_MANY_REQUESTS: ErrorCode = "too_many_requests"
"""The model's request queue is full (HTTP 429; failover waits and retries)."""
REQUEST_TOO_LARGE: ErrorCode = "request_too_large"
"""The request is over what one node may send another."""
CONTEXT_LENGTH_EXCEEDED: ErrorCode = "context_length_exceeded"
"""The prompt and the tokens asked for exceed the model's context."""
TOKEN_OUT_OF_VOCABULARY: ErrorCode = "token_out_of_vocabulary"
"""The prompt holds a token id past the model's vocabulary (a tokenizer that does not match)."""


class GenerationError(_Event):
    """The generation could not run or broke off.

    `invalid_request` errors come before any output (prompt too long, template rejects the messages)
    and the API answers them with a 4xx; `server_error` is a fault on our side (runner died);
    `overloaded` comes first too, when the model's request queue is full (the API answers 429).
    """

    kind: Literal["error"] = "error"
    error_kind: ErrorKind
    message: str
    code: ErrorCode | None = None
    param: str | None = None


ChunkEvent = Annotated[
    TextDelta | ReasoningDelta | ToolCall | PrefillProgress | Finish | GenerationError,
    Field(discriminator="kind"),
]
TerminalEvent = Finish | GenerationError
OutputEvent = TextDelta | ReasoningDelta | ToolCall
"""What a generation's tokens turn into (the events that carry `tokens`)."""


UNFINISHED = GenerationError(error_kind="server_error", message="the generation ended without finishing")
"""What a stream that ended without a terminal event ends with (an encoder's, or the failover's)."""


def is_terminal(event: ChunkEvent) -> bool:
    return isinstance(event, Finish | GenerationError)
