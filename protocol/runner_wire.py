"""The wire between a node and its runner process: CBOR messages in length-prefixed frames.

Sans-I/O (h11 style): `encode_frame` turns a message into bytes, `MessageDecoder` turns received
bytes into messages (frames by `protocol.framing`). Whoever owns the pipe moves the bytes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, encode_cbor
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent
from protocol.framing import FrameDecoder, FrameError, encode
from protocol.ids import RequestId

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""A frame bigger than this is a protocol violation, not a message."""


# Node -> runner.
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


class RequestEvent(WireMessage):
    type: Literal["event"] = "event"
    request_id: RequestId
    event: ChunkEvent


class LoadFailed(WireMessage):
    """The model could not be loaded; the runner exits after sending this."""

    type: Literal["load_failed"] = "load_failed"
    message: str


RunnerMessage = Annotated[
    Generate | Cancel | Shutdown | Ready | RequestEvent | LoadFailed, Field(discriminator="type")
]
_adapter: TypeAdapter[RunnerMessage] = TypeAdapter(RunnerMessage)


def encode_frame(message: RunnerMessage) -> bytes:
    return encode(encode_cbor(message, limit=MAX_FRAME_BYTES, error=FrameError), MAX_FRAME_BYTES)


def decode_message(body: bytes) -> RunnerMessage:
    return decode_cbor(_adapter, body, limit=MAX_FRAME_BYTES, error=FrameError, what="runner message")


class MessageDecoder:
    """Accumulates bytes and yields each complete message; `FrameError` for bad frames or messages."""

    def __init__(self) -> None:
        self._frames = FrameDecoder(MAX_FRAME_BYTES)

    def feed(self, data: bytes) -> list[RunnerMessage]:
        return [decode_message(bytes(frame)) for frame in self._frames.feed(data)]
