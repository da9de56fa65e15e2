"""Control requests to the leader over `/shoal/control/1.0.0`: place, preview and delete instances.

Any node accepts `POST /v1/instances`; it resolves the model itself (so it can read the model's shape)
and forwards a `PlaceInstance` to the leader, which alone writes instance records. Encoded like the
runner wire: pydantic messages as CBOR, one message per request or answer; bad bytes raise
`ControlWireError` (the message is dropped, never a crash).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, encode_cbor
from protocol.cluster_view import InstanceView
from protocol.placement import ModelShape

CONTROL_PROTOCOL = "/shoal/control/1.0.0"
MAX_CONTROL_BYTES = 1024 * 1024


class PlaceInstance(WireMessage):
    """Place `source` (served as `model`); `preview` computes the plan without writing it."""

    type: Literal["place"] = "place"
    model: str
    source: str
    shape: ModelShape
    nodes: int | None = None
    preview: bool = False


class DeleteInstance(WireMessage):
    type: Literal["delete"] = "delete"
    instance_id: str


class ControlAnswer(WireMessage):
    """`status` follows HTTP: 200/201 done, 404 unknown instance, 409 not leader, 422 does not fit."""

    type: Literal["answer"] = "answer"
    status: int
    error: str | None = None
    instance: InstanceView | None = None
    stage_bytes: tuple[int, ...] = ()


class StageAddress(WireMessage):
    """Entry node -> a later stage's node: where does your stage [start, end) of the instance listen?"""

    type: Literal["stage_address"] = "stage_address"
    instance_id: str
    start_layer: int
    end_layer: int
    nodes: tuple[str, ...] = ()
    """Every stage's node, in order: a node whose record of the instance differs answers None."""


class StageAddressAnswer(WireMessage):
    """`address` is "host:port" once the stage process is ready, None while it is not (ask again)."""

    type: Literal["stage_address_answer"] = "stage_address_answer"
    address: str | None = None


ControlMessage = Annotated[
    PlaceInstance | DeleteInstance | ControlAnswer | StageAddress | StageAddressAnswer,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


class ControlWireError(ValueError):
    """The peer sent bytes that are not a control message."""


def encode_control(message: ControlMessage) -> bytes:
    return encode_cbor(message, limit=MAX_CONTROL_BYTES, error=ControlWireError)


def decode_control(data: bytes) -> ControlMessage:
    return decode_cbor(
        _adapter, data, limit=MAX_CONTROL_BYTES, error=ControlWireError, what="control message"
    )
