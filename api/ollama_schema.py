"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/show`) as pydantic models.

Like the OpenAI models in `api.schemas`: strict about types (a string is not a number), lenient about
presence (fields we do not know are ignored, and so are `options` keys we do not map: Ollama
clients send many). What Shoal cannot do is refused with a 400 naming the field rather than
silently ignored: images, `format` (JSON mode), `raw`, `template`, `suffix`, `context`,
`logprobs`. `keep_alive` is accepted and ignored: a placed model is never unloaded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from api.schemas import Tool

MAX_STOP_SEQUENCES = 16
"""Ollama sets no limit; each stop string costs a suffix check per generated token."""
MAX_SEED = 2**64 - 1
"""A seed is a 64-bit PRNG key; a negative one means "random", as Ollama's default -1 does."""
NO_LIMIT = (-1, -2)
"""`num_predict` values meaning "until the model stops": -1 (Ollama's default) and -2 (fill the
context), which here are the same thing: the runner stops at the end of the context."""

ThinkLevel = Literal["low", "medium", "high"]


class _In(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", "Shoal does not support {what}", {"what": what})


class Options(_In):
    """The `options` Shoal maps; unknown keys (repeat_last_n, num_thread, ...) are ignored. An unset
    sampling option takes the model's default, else the server's (`protocol.sampling`)."""

    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    """0: no limit."""
    min_p: float | None = Field(None, ge=0, le=1)
    """0: no cut."""
    repeat_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    """1: off (over the last 20 tokens, not Ollama's `repeat_last_n`, which is ignored)."""
    num_predict: int | None = None
    """Generated tokens at most; -1 or absent: no limit (see `NO_LIMIT`)."""
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    """A plain string arrives here as a one-element list."""
    seed: int | None = Field(None, le=MAX_SEED)
    num_ctx: int | None = Field(None, ge=1)
    """Accepted and ignored: the context is the model's own (`/api/show` says how long); a prompt
    that does not fit is a 400 from the runner, as on every surface."""

    @field_validator("stop", mode="before")
    @classmethod
    def _string_is_one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("num_predict")
    @classmethod
    def _positive_or_no_limit(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value not in NO_LIMIT:
            raise PydanticCustomError(
                "num_predict", "num_predict must be a positive number of tokens, or -1 for no limit"
            )
        return value

    @property
    def max_tokens(self) -> int | None:
        return None if self.num_predict in (None, *NO_LIMIT) else self.num_predict

    @property
    def sampling_seed(self) -> int | None:
        return None if self.seed is None or self.seed < 0 else self.seed


class CallFunction(_In):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    """An object, as Ollama sends it (not OpenAI's JSON string)."""


class CallIn(_In):
    """A tool call the assistant made earlier, replayed in the conversation."""

    id: str | None = None
    """Newer Ollama versions send one; without it Shoal numbers the calls."""
    function: CallFunction


def _no_images(value: Any) -> Any:
    if value:
        raise _unsupported("images (this model reads text only)")
    return value


class Message(_In):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    """Absent or null is empty, as in Ollama (its client drops empty fields)."""
    thinking: str | None = None
    """An assistant turn's earlier reasoning."""
    images: list[Any] | None = None
    tool_calls: list[CallIn] | None = None
    tool_name: str | None = None
    """On a tool message: the function whose result it carries."""
    tool_call_id: str | None = None

    _check_images = field_validator("images", mode="before")(_no_images)


class GenerationBody(_In):
    """What `/api/chat` and `/api/generate` share."""

    model: str = Field(min_length=1)
    options: Options | None = None
    stream: bool = True
    think: bool | ThinkLevel | None = None
    """true, a level or absent: reasoning goes out as `thinking`; false: it is left out."""
    format: Any = None
    logprobs: bool | None = None

    @field_validator("think", mode="before")
    @classmethod
    def _check_think(cls, value: Any) -> Any:
        # By hand, so that a bad value reports one clear error rather than one per union member.
        if value is None or isinstance(value, bool) or value in ("low", "medium", "high"):
            return value
        raise PydanticCustomError("think", 'think must be true, false, "low", "medium" or "high"')

    @field_validator("format", mode="before")
    @classmethod
    def _no_format(cls, value: Any) -> Any:
        if value not in (None, ""):
            raise _unsupported("format (JSON mode and structured outputs)")
        return value

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value is True:
            raise _unsupported("logprobs")
        return value

    @property
    def show_thinking(self) -> bool:
        return self.think is not False

    @property
    def sampling(self) -> Options:
        return self.options or Options()


class ChatBody(GenerationBody):
    messages: list[Message] = Field(default_factory=list)
    """Empty: Ollama's "load the model" request, answered at once with done_reason "load"."""
    tools: list[Tool] | None = None


_REFUSED = {
    "template": "template (Shoal always uses the model's own chat template)",
    "suffix": "suffix (fill-in-the-middle)",
    "context": "context (continue a conversation with /api/chat instead)",
}
"""`/api/generate` fields refused whenever they are non-empty, with what to tell the user."""


class GenerateBody(GenerationBody):
    prompt: str | None = None
    """Empty (with no `system`): Ollama's "load the model" request."""
    system: str | None = None
    images: list[Any] | None = None
    raw: bool | None = None
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None

    _check_images = field_validator("images", mode="before")(_no_images)

    @field_validator("raw", mode="before")
    @classmethod
    def _no_raw(cls, value: Any) -> Any:
        if value is True:
            raise _unsupported("raw (a prompt without the model's chat template)")
        return value

    @field_validator("template", "suffix", "context", mode="before")
    @classmethod
    def _refused_when_given(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise _unsupported(_REFUSED[info.field_name or ""])
        return value

    @property
    def is_load(self) -> bool:
        return not self.prompt and not self.system


class ShowBody(_In):
    model: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)
    """What older clients send instead of `model`."""
