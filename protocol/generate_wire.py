"""The wire of `/shoal/generate/1.1.0`: a generation run on another node, its events streamed back.

One channel (node/net/channel.py: length-prefixed frames over one libp2p stream) per request,
straight between the node that accepted the request and the instance's entry node:

    requester -> entry node:  RemoteGenerate, then at most one RemoteCancel (or just closing its side)
    entry node -> requester:  any mix of KeepAlive and Event, up to the one terminal Event
                              (`Finish` or `GenerationError`); then it closes its side

Each frame is one CBOR-encoded message, a tagged union of frozen pydantic models as in
`runner_wire` (whose `Generate`/`Cancel` go from a node to its own runner: hence `Remote` here).
Sans-I/O: `encode`/`decode_*` only; `node/serving/routing.py` moves the bytes.
The `type` tags are ONLY APPENDED: a node never reuses or renames one.

Versions (the protocol id names the version; a node speaks one, so peers of another version cannot
open a channel and the requester reports the peer `node_unavailable` instead of misreading it):
- 1.0.0: the first.
- 1.1.0: failover. A request may carry `resume` (the tokens its client already has) and output
  events carry the generated token ids they consumed (`tokens`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from protocol.cbor_messages import T, WireMessage, decode_cbor, encode_cbor
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent

GENERATE_PROTOCOL = "/shoal/generate/1.1.0"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Cap on one message, both ways (as `runner_wire.MAX_FRAME_BYTES`): a request may carry a long
conversation; events are small. A larger one is a protocol violation."""


# Requester -> entry node.
class RemoteGenerate(WireMessage):
    """Run this request on your local model; the first message of every channel."""

    type: Literal["generate"] = "generate"
    request: GenerateRequest


class RemoteCancel(WireMessage):
    """Stop the generation; the entry node keeps streaming until the runner's `Finish(cancelled)`."""

    type: Literal["cancel"] = "cancel"


# Entry node -> requester.
class Event(WireMessage):
    type: Literal["event"] = "event"
    event: ChunkEvent


class KeepAlive(WireMessage):
    """Sent when the entry node has had nothing to send for a while (model loading, long prefill,
    slow decode), so that the requester can tell a slow node from a dead one."""

    type: Literal["keep_alive"] = "keep_alive"


RequesterMessage = Annotated[RemoteGenerate | RemoteCancel, Field(discriminator="type")]
EntryMessage = Annotated[Event | KeepAlive, Field(discriminator="type")]
_requester: TypeAdapter[RequesterMessage] = TypeAdapter(RequesterMessage)
_entry: TypeAdapter[EntryMessage] = TypeAdapter(EntryMessage)


class GenerateWireError(ValueError):
    """Bytes that are not a valid message of this protocol (or a message over the size cap)."""


def encode(message: RemoteGenerate | RemoteCancel | Event | KeepAlive) -> bytes:
    return encode_cbor(message, limit=MAX_MESSAGE_BYTES, error=GenerateWireError)


def decode_requester_message(body: bytes) -> RequesterMessage:
    return _decode(_requester, body)


def decode_entry_message(body: bytes) -> EntryMessage:
    return _decode(_entry, body)


def _decode(adapter: TypeAdapter[T], body: bytes) -> T:
    return decode_cbor(
        adapter, body, limit=MAX_MESSAGE_BYTES, error=GenerateWireError, what="generate message"
    )
