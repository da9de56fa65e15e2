"""A chat generation request as the node and the runner see it (already validated by the API)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

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
    """How a request asks for its tokens to be picked, and when it ends.

    A sampling field left None was not given: the runner fills it with the model's default or the
    server's (`protocol.sampling.resolve_sampling`), so that an omitted `temperature` means "what this
    model is meant to run at", not 1.0. The resolved settings are what a runner samples with in one
    process and what the last stage of an N-stage instance gets in its first frame, both through
    `node.pipeline.shard.request_sampler`, so a seeded request gets the same tokens on either.
    """

    model_config = ConfigDict(frozen=True)
    temperature: float | None = None
    """0: greedy (argmax)."""
    top_p: float | None = None
    top_k: int | None = None
    """Sample only among the k most likely tokens; 0: no limit (Anthropic's and Ollama's `top_k`)."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one; 0: no cut."""
    repetition_penalty: float | None = None
    """Divide the logits of recently generated tokens by this; 1: off (Ollama's `repeat_penalty`)."""
    seed: int | None = None
    """Set: the request draws from its own PRNG key, so its tokens depend only on seed and model."""
    max_tokens: int | None = None
    """None: up to the end of the model's context."""
    stop: tuple[str, ...] = ()


class Resume(BaseModel):
    """Where a generation broke off, so that another instance continues it (`node.serving.failover`).

    `tokens` are the generated ids whose events the client already has (the `tokens` of the output
    events it received, in order): the runner prefills them after the prompt, feeds them through its
    detokenizer and parser without emitting, and starts its sampler `len(tokens)` draws in, so a
    greedy or seeded request goes on exactly as if it had never stopped. `events` counts the output
    events the client already has of the last token's group (the events emitted after that token and
    before the next), which the runner leaves out once more.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: tuple[NonNegativeInt, ...]
    events: NonNegativeInt = 0

    @property
    def sampler_steps(self) -> int:
        """Draws the request's sampler made before it broke off: one per generated token."""
        return len(self.tokens)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(frozen=True)
    request_id: RequestId
    model: ModelId
    messages: tuple[ChatMessage, ...]
    params: SamplingParams = SamplingParams()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: Literal["auto", "none", "required"] | str = "auto"
    """A bare function name forces that function."""
    count_only: bool = False
    """Only count the prompt's tokens: the runner answers `Finish` with the usage, generating nothing
    (Anthropic's `count_tokens`). The same path as a generation, so it counts what would run."""
    resume: Resume | None = None
    """Set by failover only (never by the API): continue a generation that broke off elsewhere."""
