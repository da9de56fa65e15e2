"""A Claude Messages request as the `GenerateRequest` every surface hands the backend.

Anthropic's conversation is turns of content blocks; Shoal's is OpenAI-like messages. A `system`
becomes the first message; an assistant turn becomes one assistant message (its text, its
`thinking` as reasoning, its `tool_use` blocks as tool calls); a user turn becomes one tool
message per `tool_result` block (with `tool_call_id`) and one user message for its text, in the
order the blocks come. Text blocks of one turn are joined with a blank line. Problems raise a 400
`ApiError` whose message names the field, as `api.errors.from_validation` does (`messages[1].content[0]`).
"""

from __future__ import annotations

import json

from api.errors import ApiError
from api.messages_schema import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams, ToolCallRef, ToolSpec
from protocol.ids import ModelId, RequestId

BLOCK_SEPARATOR = "\n\n"
"""Between the text blocks of one turn (Claude Code sends reminders and the prompt as separate blocks)."""


def _invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param, code=code)


def _joined(blocks: list[TextBlock]) -> str:
    return BLOCK_SEPARATOR.join(block.text for block in blocks)


def _user_turn(where: str, message: Message) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    texts: list[TextBlock] = []
    for index, block in enumerate(message.content):
        match block:
            case TextBlock():
                texts.append(block)
            case ToolResultBlock():
                if texts:  # Text before a result keeps its place in the conversation.
                    out.append(ChatMessage(role="user", content=_joined(texts)))
                    texts = []
                out.append(
                    ChatMessage(role="tool", content=_joined(block.content), tool_call_id=block.tool_use_id)
                )
            case _:
                raise _invalid(
                    f"{where}.content[{index}]",
                    f"'{block.type}' blocks are only allowed in assistant messages",
                )
    if texts:
        out.append(ChatMessage(role="user", content=_joined(texts)))
    return out


def _assistant_turn(where: str, message: Message) -> ChatMessage:
    texts: list[TextBlock] = []
    reasoning: list[str] = []
    calls: list[ToolCallRef] = []
    for index, block in enumerate(message.content):
        match block:
            case TextBlock():
                texts.append(block)
            case ThinkingBlock():
                reasoning.append(block.thinking)
            case RedactedThinkingBlock():
                pass  # Encrypted by another server: nothing a model here can read.
            case ToolUseBlock():
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCallRef(id=block.id, name=block.name, arguments=arguments))
            case ToolResultBlock():
                raise _invalid(
                    f"{where}.content[{index}]", "'tool_result' blocks are only allowed in user messages"
                )
    return ChatMessage(
        role="assistant",
        content=_joined(texts) if texts else None,
        reasoning=BLOCK_SEPARATOR.join(reasoning) if reasoning else None,
        tool_calls=tuple(calls),
    )


def _conversation(request: CountTokensRequest) -> tuple[ChatMessage, ...]:
    last = len(request.messages) - 1
    if request.messages[last].role == "assistant":
        # Anthropic continues a final assistant turn ("prefill"); the chat templates here always
        # open a new one, so the answer would silently ignore the prefix.
        raise _invalid(
            f"messages[{last}]",
            "a final assistant message (prefill) is not supported here: end with a user message",
            code="unsupported_value",
        )
    out: list[ChatMessage] = []
    if request.system:
        out.append(ChatMessage(role="system", content=_joined(request.system)))
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        if message.role == "user":
            out += _user_turn(where, message)
        else:
            out.append(_assistant_turn(where, message))
    return tuple(out)


def _tool_choice(request: CountTokensRequest, tools: tuple[ToolSpec, ...]) -> str:
    choice = request.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return "auto" if choice is None else choice.type
    if not tools:
        raise _invalid("tool_choice", f"type '{choice.type}' requires a non-empty 'tools' list")
    if choice.type == "any":
        return "required"
    if choice.name is None:
        raise _invalid(
            "tool_choice.name", "required when tool_choice.type is 'tool'", "missing_required_parameter"
        )
    if choice.name not in {tool.name for tool in tools}:
        raise _invalid("tool_choice.name", f"names tool '{choice.name}', which is not in 'tools'")
    return choice.name


def _sampling(request: CountTokensRequest) -> SamplingParams:
    """The request's sampling fields; unset ones take the model's defaults, else the server's (not
    Anthropic's temperature 1: a small local model needs its own); a count samples nothing."""
    if not isinstance(request, MessagesRequest):
        return SamplingParams()
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise _invalid(
                "thinking.budget_tokens",
                "required when thinking.type is 'enabled'",
                "missing_required_parameter",
            )
        if thinking.budget_tokens >= request.max_tokens:
            raise _invalid("thinking.budget_tokens", "must be less than max_tokens")
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        stop=tuple(request.stop_sequences or ()),
    )


def to_generate_request(
    request: CountTokensRequest, request_id: RequestId, *, count_only: bool = False
) -> GenerateRequest:
    """What the backend runs (or, with `count_only`, counts) for this request; 400 for inconsistent
    fields."""
    tools = tuple(
        ToolSpec(name=tool.name, description=tool.description, parameters=tool.input_schema)
        for tool in request.tools or ()
    )
    return GenerateRequest(
        request_id=request_id,
        model=ModelId(request.model),
        messages=_conversation(request),
        params=_sampling(request),
        tools=tools,
        tool_choice=_tool_choice(request, tools),
        count_only=count_only,
    )
