"""Claude Messages requests as pydantic models (`POST /v1/messages` and its `count_tokens`).

Strict about types (a string is not a number), lenient about presence: fields we do not know
(`metadata`, `cache_control`, `service_tier`, ...) are ignored, because Anthropic clients send many.
A string `system` or `content` arrives as one text block. Shape and range checks live here; checks
that relate fields to each other (a block in the wrong role, `tool_choice` naming a tool) live in
`api.messages_request`, which builds the `GenerateRequest`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from api.errors import parse_body

MAX_STOP_SEQUENCES = 16
"""More than chat completions' 4 (Anthropic sets no small limit); each costs a suffix check per token."""

MIN_THINKING_BUDGET = 1024
"""Anthropic's minimum `budget_tokens`; kept so that a request valid here is valid there too."""

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
"""Anthropic's pattern for tool names."""

BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
"""The content blocks Shoal reads; images, documents and server tools are refused by name."""


class _In(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


def _text_blocks(value: Any) -> Any:
    """A plain string is one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(_In):
    type: Literal["text"]
    text: str


class ThinkingBlock(_In):
    """Reasoning replayed from an earlier turn; its signature is not checked (Shoal signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_In):
    """Encrypted reasoning from Anthropic's own API: accepted so such conversations load, then dropped."""

    type: Literal["redacted_thinking"]
    data: str = ""


class ToolUseBlock(_In):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_In):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False
    """Accepted and not shown to the model: the result's text is expected to say what went wrong."""

    _string_is_one_block = field_validator("content", mode="before")(_text_blocks)


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(_In):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        value = _text_blocks(value)
        if not isinstance(value, list):
            raise PydanticCustomError(
                "content_type", "content must be a string or an array of content blocks"
            )
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise PydanticCustomError(
                    "unsupported_value",
                    "content block {index} has type '{kind}', which this server does not support "
                    "(supported: {supported})",
                    {"index": index, "kind": kind, "supported": ", ".join(BLOCK_TYPES)},
                )
        return value


class Tool(_In):
    """A client tool; Anthropic's server tools (`web_search_...`, `bash_...`) cannot run here."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """Required for type "tool"."""
    disable_parallel_tool_use: bool = False
    """Accepted; the runner's parsers emit every call the model makes."""


class Thinking(_In):
    """Whether the answer shows the model's reasoning as `thinking` blocks.

    `adaptive` counts as enabled. The budget is checked as Anthropic checks it, but not enforced:
    reasoning and answer share `max_tokens`.
    """

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)

    @property
    def shown(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(_In):
    """What `count_tokens` reads: everything that shapes the prompt."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    _string_is_one_block = field_validator("system", mode="before")(_text_blocks)

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.shown


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_STOP_SEQUENCES
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    """0: no limit."""
    stream: bool = False


def parse_messages_request(body: bytes) -> MessagesRequest:
    """The body of `POST /v1/messages`; any problem becomes a 400 `ApiError` naming the field."""
    return parse_body(MessagesRequest, body)


def parse_count_request(body: bytes) -> CountTokensRequest:
    """The body of `POST /v1/messages/count_tokens` (no `max_tokens`, sampling or stream fields)."""
    return parse_body(CountTokensRequest, body)
