"""OpenAI chat-completion requests as pydantic models, and their translation into a `GenerateRequest`.

Parsing is strict about types (a string is not a number) and lenient about presence: fields we do not
know are ignored, because OpenAI clients send many. Shape and range checks live on the models; checks
that relate fields to each other (a tool message needs `tool_call_id`, `tool_choice` must name a tool)
live in `to_generate_request`, which raises `ApiError` with the exact `param`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from api.errors import ApiError, parse_body
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams, ToolCallRef, ToolSpec
from protocol.ids import ModelId, RequestId

MAX_STOP_SEQUENCES = 4
"""OpenAI's limit; each stop string costs a suffix check per generated token."""


class _In(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


class TextPart(_In):
    type: Literal["text"]
    text: str


class FunctionCall(_In):
    name: str
    arguments: str


class AssistantToolCall(_In):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_In):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None
    """A plain string arrives here as one text part."""
    reasoning_content: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if value is None or isinstance(value, list):
            return value
        raise PydanticCustomError("content_type", "content must be a string or an array of text parts")

    def text(self) -> str | None:
        return None if self.content is None else "".join(part.text for part in self.content)


class FunctionDefinition(_In):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(_In):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_In):
    include_usage: bool = False


ToolChoiceMode = Literal["none", "auto", "required"]


class ChatCompletionRequest(_In):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Wins over `max_tokens` when both are given."""
    temperature: float | None = Field(None, ge=0, le=2)
    """Omitted: the model's default, else the server's (`protocol.sampling`); so for the others."""
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    """An extension (vLLM's, llama.cpp's): 0 turns the limit off."""
    min_p: float | None = Field(None, ge=0, le=1)
    """An extension (vLLM's and llama.cpp's server have it too): 0 turns the cut off."""
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    """An extension (vLLM's): 1 turns it off."""
    seed: int | None = None
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    """A plain string arrives here as a one-element list."""
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _string_is_one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        # Checked by hand so that a bad value reports `tool_choice`, not one error per union member.
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            function = value.get("function")
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                return value
        raise PydanticCustomError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise PydanticCustomError("unsupported_value", "only n=1 is supported")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """The request body as a model; any problem becomes a 400 `ApiError` naming the field."""
    return parse_body(ChatCompletionRequest, body)


def _to_message(index: int, message: Message) -> ChatMessage:
    where = f"messages[{index}]"
    if message.role == "tool" and message.tool_call_id is None:
        raise ApiError(
            400,
            f"'{where}.tool_call_id' is required for messages with role 'tool'",
            param=f"{where}.tool_call_id",
            code="missing_required_parameter",
        )
    if message.role != "assistant" and message.content is None:
        raise ApiError(
            400,
            f"'{where}.content' is required for messages with role '{message.role}'",
            param=f"{where}.content",
            code="missing_required_parameter",
        )
    if message.role != "assistant" and message.tool_calls:
        raise ApiError(
            400,
            f"'{where}.tool_calls' is only allowed on messages with role 'assistant'",
            param=f"{where}.tool_calls",
            code="invalid_value",
        )
    calls = tuple(
        ToolCallRef(id=call.id, name=call.function.name, arguments=call.function.arguments)
        for call in message.tool_calls or ()
    )
    return ChatMessage(
        role=message.role,
        content=message.text(),
        reasoning=message.reasoning_content,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def tool_specs(tools: Sequence[Tool] | None) -> tuple[ToolSpec, ...]:
    """OpenAI-style function tools (chat completions, Ollama) as the runner takes them."""
    return tuple(
        ToolSpec(
            name=tool.function.name,
            description=tool.function.description,
            parameters=tool.function.parameters,
        )
        for tool in tools or ()
    )


def resolve_tool_choice(
    choice: ToolChoiceMode | None, function: str | None, tools: Sequence[ToolSpec]
) -> str:
    """`GenerateRequest.tool_choice` from an OpenAI-style choice: a mode, or a `function` to force.

    Chat completions and Responses share these rules: forcing needs tools, and a forced function
    must be one of them; both are a 400 on `tool_choice`.
    """
    if function is None and choice in (None, "none", "auto"):
        return choice or "auto"
    if not tools:
        raise ApiError(
            400, "tool_choice requires a non-empty 'tools' list", param="tool_choice", code="invalid_value"
        )
    if function is None:  # "required"
        return "required"
    if function not in {tool.name for tool in tools}:
        raise ApiError(
            400,
            f"tool_choice names function '{function}', which is not in 'tools'",
            param="tool_choice",
            code="invalid_value",
        )
    return function


def to_generate_request(request: ChatCompletionRequest, request_id: RequestId) -> GenerateRequest:
    """What the backend runs for this request; raises a 400 `ApiError` for inconsistent fields."""
    messages = tuple(_to_message(index, message) for index, message in enumerate(request.messages))
    tools = tool_specs(request.tools)
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        tool_choice = resolve_tool_choice(None, choice.function.name, tools)
    else:
        tool_choice = resolve_tool_choice(choice, None, tools)
    params = SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        seed=request.seed,
        max_tokens=request.max_completion_tokens or request.max_tokens,
        stop=tuple(request.stop or ()),
    )
    return GenerateRequest(
        request_id=request_id,
        model=ModelId(request.model),
        messages=messages,
        params=params,
        tools=tools,
        tool_choice=tool_choice,
    )
