"""The wire between a node and its runner process: CBOR messages in length-prefixed frames.

Sans-I/O (h11 style): `encode_frame` turns a message into bytes, `MessageDecoder` turns received
bytes into messages (frames by `protocol.framing`). Whoever owns the pipe moves the bytes.

The node's first frame is `Start`, the runner's whole `RunnerSpec`: a runner has no command-line
arguments, so each setting is written once (`RunnerSettings`), not once per side of an argv.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, framed_cbor
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent
from protocol.framing import FrameDecoder, FrameError
from protocol.ids import ModelId, RequestId

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""A frame bigger than this is a protocol violation, not a message."""


@dataclass(frozen=True, kw_only=True)
class RunnerSettings:
    """How a node runs its models, the same for every runner it starts (`shoal run` flags)."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    prefill_step_size: int = 512
    """Tokens per prefill chunk: smaller means more progress events and cancel points, slightly slower."""
    max_concurrent: int = 8
    """Requests to one model decoded together. Batching reads the weights once per step for all of
    them: aggregate tokens/s grow with it while each stream slows a little; 8 is past the knee on a
    small CPU."""
    max_queued: int = 32
    """Requests that may wait for a place in the batch; past max_concurrent + max_queued in flight the
    node answers `overloaded` (HTTP 429) at once instead of letting a client wait for minutes."""
    prefix_cache_tokens: int = 8192
    """KV cache kept from finished requests so the next turn of a chat prefills only its new tokens;
    0 = off. Memory: tokens x layers x 2 x kv_heads x head_dim x 2 bytes (float16 on the CPU kernels),
    e.g. 8192 tokens = 0.2 GB for SmolLM2-135M, 0.9 GB for Qwen3-0.6B."""
    fast_path: bool = True
    """Runners use the BLAS fast path where it is available (Linux CPU); off = plain MLX, for
    comparisons and as the escape hatch should the fast path misbehave on some machine."""


PipelineRoute = tuple[int, str, tuple[str, ...]]
"""(end layer k, host the last stage dials back, HOST:PORT of the later stages)."""


@dataclass(frozen=True)
class RunnerSpec(RunnerSettings):
    """One runner: its model, the node's settings, and (pipeline mode) its route."""

    model_id: ModelId
    model_path: Path
    vocab_dir: Path | None = None
    """The harmony vocab's folder (GPT-OSS models); None when the node has none."""
    pipeline: PipelineRoute | None = None
    """Pipeline mode: the runner holds layers [0, k) and drives the others (`node.runner.pipeline_mode`)."""
    tensor: tuple[str, ...] | None = None
    """Tensor mode: the runner is rank 0 of a tensor-parallel group and drives the other ranks, which
    listen at these HOST:PORTs in rank order (`node.runner.pipeline_mode.load_tensor`)."""
    stage_link: str = field(default="", repr=False)
    """The instance's stage link key (`node.pipeline.link_auth.LinkSecurity.encode`), which the node
    puts in the environment of this runner and of its stage processes; "": stages started by hand."""
    ready_timeout_s: float = 300.0
    """How long a request waits for a (re)starting runner before it fails (the node's side only)."""
    exit_grace_s: float = 2.0
    """How long a runner gets to exit after its stdin closes before it is killed (the node's side only)."""

    @classmethod
    def of(
        cls, settings: RunnerSettings, model_id: ModelId, model_path: Path, *, vocab_dir: Path | None
    ) -> RunnerSpec:
        return cls(model_id, model_path, vocab_dir=vocab_dir, **asdict(settings))


# Node -> runner.
class Start(WireMessage):
    """Always the first frame, and only that one: what this runner runs, and how."""

    type: Literal["start"] = "start"
    spec: RunnerSpec


class Generate(WireMessage):
    type: Literal["generate"] = "generate"
    request: GenerateRequest


class Cancel(WireMessage):
    type: Literal["cancel"] = "cancel"
    request_id: RequestId


class Shutdown(WireMessage):
    type: Literal["shutdown"] = "shutdown"


# Runner -> node.
class Ready(WireMessage):
    """The model is loaded; the runner accepts `Generate` from now on."""

    type: Literal["ready"] = "ready"
    model_type: str
    context_length: int
    pid: int
    ring_port: int | None = None
    """Pipeline mode: the port where the driver accepts the last stage, which the node answers
    that stage's node with (`node.hosting.stages`); None otherwise."""


class RequestEvent(WireMessage):
    type: Literal["event"] = "event"
    request_id: RequestId
    event: ChunkEvent


class LoadFailed(WireMessage):
    """The model could not be loaded; the runner exits after sending this."""

    type: Literal["load_failed"] = "load_failed"
    message: str


RunnerMessage = Annotated[
    Start | Generate | Cancel | Shutdown | Ready | RequestEvent | LoadFailed, Field(discriminator="type")
]
_adapter: TypeAdapter[RunnerMessage] = TypeAdapter(RunnerMessage)


def encode_frame(message: RunnerMessage) -> bytes:
    return framed_cbor(message, MAX_FRAME_BYTES)


def decode_message(body: bytes) -> RunnerMessage:
    return decode_cbor(_adapter, body, limit=MAX_FRAME_BYTES, error=FrameError, what="runner message")


class MessageDecoder:
    """Accumulates bytes and yields each complete message; `FrameError` for bad frames or messages."""

    def __init__(self) -> None:
        self._frames = FrameDecoder(MAX_FRAME_BYTES)

    def feed(self, data: bytes) -> list[RunnerMessage]:
        return [decode_message(bytes(frame)) for frame in self._frames.feed(data)]
