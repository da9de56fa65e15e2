"""Ollama request bodies (`api.ollama_schema`) as the one `GenerateRequest` every surface builds.

Two things Ollama leaves implicit are made explicit here: a tool call replayed without an `id` gets
one (`call_<message>_<call>`), and a tool message without `tool_call_id` answers the earliest call
of the latest assistant turn that is still unanswered, the one with its `tool_name` first (Ollama
pairs results with calls by order and name; chat templates and harmony want the id).
"""

from __future__ import annotations

import json

from api.errors import ApiError
from api.ollama_schema import ChatBody, GenerateBody, Message, Options
from api.schemas import tool_specs
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams, ToolCallRef
from protocol.ids import ModelId, RequestId


def sampling_params(options: Options) -> SamplingParams:
    """Ollama's `options` as sampling parameters; unset ones take the model's defaults (as a
    Modelfile's `PARAMETER`s would), else the server's."""
    return SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        repetition_penalty=options.repeat_penalty,
        seed=options.sampling_seed,
        max_tokens=options.max_tokens,
        stop=tuple(options.stop or ()),
    )


class _Calls:
    """The latest assistant turn's tool calls not yet answered by a tool message."""

    def __init__(self) -> None:
        self._open: list[ToolCallRef] = []

    def made(self, calls: tuple[ToolCallRef, ...]) -> None:
        self._open = list(calls)

    def answer(self, name: str | None) -> str | None:
        """The id of the call a tool result answers (None when no call is open)."""
        match = next((call for call in self._open if call.name == name), None)
        match = match or (self._open[0] if self._open else None)
        if match is None:
            return None
        self._open.remove(match)
        return match.id


def _replayed_calls(index: int, message: Message) -> tuple[ToolCallRef, ...]:
    return tuple(
        ToolCallRef(
            id=call.id or f"call_{index}_{j}",
            name=call.function.name,
            arguments=json.dumps(call.function.arguments, ensure_ascii=False),
        )
        for j, call in enumerate(message.tool_calls or ())
    )


def chat_messages(messages: list[Message]) -> tuple[ChatMessage, ...]:
    """The conversation; raises a 400 `ApiError` for tool calls on a turn that is not the assistant's."""
    out: list[ChatMessage] = []
    calls = _Calls()
    for index, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise ApiError(
                400,
                f"'messages[{index}].tool_calls' is only allowed on messages with role 'assistant'",
                param=f"messages[{index}].tool_calls",
                code="invalid_value",
            )
        replayed = _replayed_calls(index, message)
        if message.role == "assistant":
            calls.made(replayed)
        tool_call_id = message.tool_call_id
        if message.role == "tool" and tool_call_id is None:
            tool_call_id = calls.answer(message.tool_name)
        out.append(
            ChatMessage(
                role=message.role,
                content=message.content or "",
                reasoning=message.thinking if message.role == "assistant" else None,
                tool_calls=replayed,
                tool_call_id=tool_call_id if message.role == "tool" else None,
                name=message.tool_name if message.role == "tool" else None,
            )
        )
    return tuple(out)


def chat_request(body: ChatBody, request_id: RequestId, model: ModelId) -> GenerateRequest:
    """What the backend runs for an `/api/chat` body (with at least one message)."""
    tools = tool_specs(body.tools)
    return GenerateRequest(
        request_id=request_id,
        model=model,
        messages=chat_messages(body.messages),
        params=sampling_params(body.sampling),
        tools=tools,
    )


def generate_request(body: GenerateBody, request_id: RequestId, model: ModelId) -> GenerateRequest:
    """An `/api/generate` body as a conversation: `system` (if any), then `prompt` as the user's turn,
    through the model's chat template as Ollama does without `raw`."""
    messages = []
    if body.system:
        messages.append(ChatMessage(role="system", content=body.system))
    messages.append(ChatMessage(role="user", content=body.prompt or ""))
    return GenerateRequest(
        request_id=request_id, model=model, messages=tuple(messages), params=sampling_params(body.sampling)
    )
