"""OpenAI Responses requests (`POST /v1/responses`) as pydantic models.

Strict about types, lenient about presence: fields we do not know are ignored (clients send many).
An input item is one flat model for every item type, as `api.schemas.Message` is for chat roles: a
bad field then reports its own path (`input[2].call_id`), and the fields each type needs are checked
when the items become chat messages (`api.responses_input`). What Shoal cannot honour (stored
conversations, hosted tools, structured output, images) is a 400 naming the field, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from api.errors import parse_body

TEXT_PARTS = ("input_text", "output_text", "reasoning_text", "summary_text")
"""Content parts that are plain text; whichever an item carries, only the text is kept."""

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _In(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


def _unsupported(what: str, value: Any, supported: tuple[str, ...]) -> PydanticCustomError:
    return PydanticCustomError(
        "unsupported_value",
        "{what} of type '{value}' are not supported here (supported: {supported})",
        {"what": what, "value": value, "supported": ", ".join(supported)},
    )


def _text_parts(value: Any) -> Any:
    """A plain string is one text part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class TextPart(_In):
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value not in TEXT_PARTS:
            raise _unsupported("content parts", value, TEXT_PARTS)
        return value


def join_text(parts: list[TextPart] | None) -> str | None:
    return None if parts is None else "".join(part.text for part in parts)


class InputItem(_In):
    """Any input item: a message, a function call and its output, or reasoning to replay."""

    type: str = "message"
    """Messages may leave it out (OpenAI's "easy input message")."""
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[TextPart] | None = None
    """A message's text, or a reasoning item's `reasoning_text` parts; a string is one part."""
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[TextPart] | None = None
    """A function call's result; a string is one part."""
    summary: list[TextPart] | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ITEM_TYPES:
            raise _unsupported("input items", value, ITEM_TYPES)
        return value

    @field_validator("content", "output", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: Any) -> Any:
        return _text_parts(value)


class FunctionTool(_In):
    type: str
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _functions_only(cls, value: str) -> str:
        if value != "function":
            raise _unsupported("tools", value, ("function",))
        return value


class FunctionChoice(_In):
    type: Literal["function"]
    name: str


ToolChoiceMode = Literal["none", "auto", "required"]


class TextFormat(_In):
    type: Literal["text"]
    """Structured output (`json_schema`, `json_object`) is not supported: a 400, not ignored."""


class TextConfig(_In):
    format: TextFormat | None = None


class ReasoningConfig(_In):
    """Accepted and echoed; a model reasons as its chat format makes it (no effort levels)."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_In):
    model: str
    input: list[InputItem] = Field(min_length=1)
    """A plain string arrives here as one user message."""
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoiceMode | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    """Accepted; nothing is stored (the response says `"store": false`)."""
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_is_one_message(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        # Checked by hand so that a bad value reports `tool_choice`, not one error per union member.
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
            return value
        raise PydanticCustomError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        )

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported_value", "background responses are not supported")
        return value

    def echo(self) -> dict[str, Any]:
        """The request fields a response object repeats, with the defaults that applied (`null`
        temperature or top_p: the model's default, else the server's, as `/v1/models` shows)."""
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": (self.reasoning or ReasoningConfig()).model_dump(),
            "text": {"format": {"type": "text"}},
            "truncation": self.truncation or "disabled",
            "metadata": self.metadata or {},
            "user": self.user,
            "store": False,
            "background": False,
        }


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """The request body as a model; any problem becomes a 400 `ApiError` naming the field."""
    return parse_body(ResponsesRequest, body)
