"""A chat generation request as the node and the runner see it (already validated by the API)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.ids import ModelId, RequestId

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ToolCallRef(BaseModel):
    """A tool call made earlier by the assistant, replayed in the conversation."""

    model_config = ConfigDict(frozen=True)
    id: str
    name: str
    arguments: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: Role
    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallRef, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


class ToolSpec(BaseModel):
    """A function the model may call: OpenAI's `{"type": "function", "function": {...}}`, unwrapped."""

    model_config = ConfigDict(frozen=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    """None: up to the end of the model's context."""
    stop: tuple[str, ...] = ()


class GenerateRequest(BaseModel):
    model_config = ConfigDict(frozen=True)
    request_id: RequestId
    model: ModelId
    messages: tuple[ChatMessage, ...]
    params: SamplingParams = SamplingParams()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: Literal["auto", "none", "required"] | str = "auto"
    """A bare function name forces that function."""
