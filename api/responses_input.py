"""A Responses request as the `GenerateRequest` every surface builds.

Input items become chat messages in order: `instructions` first, as a system message; a message
item keeps its role; a `function_call` item joins the assistant message just before it (so a replayed
output `[message, function_call, function_call]` is one assistant turn with two tool calls) or
starts one; a `function_call_output` is a tool message answering `call_id`; a `reasoning` item's
text (its `reasoning_text` content, else its summary) becomes the `reasoning` of the next assistant
turn, and is dropped when none follows. Checks that relate fields to each other raise `ApiError`
with the exact `param`.
"""

from __future__ import annotations

from api.errors import ApiError
from api.responses_schema import FunctionChoice, InputItem, ResponsesRequest, join_text
from api.schemas import resolve_tool_choice
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams, ToolCallRef, ToolSpec
from protocol.ids import ModelId, RequestId

REQUIRED = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "reasoning": (),
}
"""The fields each input item type needs (the model leaves them all optional)."""

STATEFUL = ("previous_response_id", "conversation")
"""Fields that need responses kept on the server, which Shoal does not keep."""


def _require(index: int, item: InputItem) -> None:
    for field in REQUIRED[item.type]:
        if getattr(item, field) is None:
            raise ApiError(
                400,
                f"'input[{index}].{field}' is required for input items of type '{item.type}'",
                param=f"input[{index}].{field}",
                code="missing_required_parameter",
            )


class _Conversation:
    """The chat messages of an input list, built item by item (the rules are in the module doc)."""

    def __init__(self, instructions: str | None) -> None:
        self.messages: list[ChatMessage] = []
        if instructions is not None:
            self.messages.append(ChatMessage(role="system", content=instructions))
        self._reasoning: str | None = None

    def add(self, item: InputItem) -> None:
        if item.type == "reasoning":
            self._reasoning = _joined(self._reasoning, join_text(item.content) or join_text(item.summary))
        elif item.type == "function_call":
            self._add_call(item)
        elif item.type == "function_call_output":
            output = join_text(item.output)
            self.messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        else:
            assert item.role is not None
            reasoning = self._take_reasoning() if item.role == "assistant" else None
            content = join_text(item.content)
            self.messages.append(ChatMessage(role=item.role, content=content, reasoning=reasoning))

    def _add_call(self, item: InputItem) -> None:
        assert item.call_id is not None and item.name is not None and item.arguments is not None
        call = ToolCallRef(id=item.call_id, name=item.name, arguments=item.arguments)
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant":
            self.messages.append(
                ChatMessage(role="assistant", reasoning=self._take_reasoning(), tool_calls=(call,))
            )
            return
        reasoning = _joined(last.reasoning, self._take_reasoning())
        self.messages[-1] = last.model_copy(
            update={"tool_calls": (*last.tool_calls, call), "reasoning": reasoning}
        )

    def _take_reasoning(self) -> str | None:
        reasoning, self._reasoning = self._reasoning, None
        return reasoning


def _joined(first: str | None, second: str | None) -> str | None:
    """Two pieces of reasoning as one, a line apart."""
    return "\n".join(text for text in (first, second) if text) or None


def to_messages(request: ResponsesRequest) -> tuple[ChatMessage, ...]:
    conversation = _Conversation(request.instructions)
    for index, item in enumerate(request.input):
        _require(index, item)
        conversation.add(item)
    return tuple(conversation.messages)


def _tool_choice(request: ResponsesRequest, tools: tuple[ToolSpec, ...]) -> str:
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        return resolve_tool_choice(None, choice.name, tools)
    return resolve_tool_choice(choice, None, tools)


def _refuse_stateful(request: ResponsesRequest) -> None:
    for field in STATEFUL:
        if getattr(request, field) is not None:
            raise ApiError(
                400,
                f"'{field}' is not supported: this server keeps no responses or conversations "
                "(store is accepted but nothing is stored); send the whole conversation in 'input'",
                param=field,
                code="unsupported_parameter",
            )


def to_generate_request(
    request: ResponsesRequest, request_id: RequestId, *, count_only: bool = False
) -> GenerateRequest:
    """What the backend runs for this request; raises a 400 `ApiError` for inconsistent fields."""
    _refuse_stateful(request)
    tools = tuple(
        ToolSpec(name=tool.name, description=tool.description, parameters=tool.parameters or {})
        for tool in request.tools or ()
    )
    params = SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        max_tokens=request.max_output_tokens,
    )
    return GenerateRequest(
        request_id=request_id,
        model=ModelId(request.model),
        messages=to_messages(request),
        params=params,
        tools=tools,
        tool_choice=_tool_choice(request, tools),
        count_only=count_only,
    )
