"""Control requests over `CONTROL_PROTOCOL`: place, preview and delete instances; stage addresses.

Any node accepts `POST /v1/instances`; it resolves the model itself (so it can read the model's shape
and hash its files into a manifest) and forwards a `PlaceInstance` to the leader, which alone writes
instance records; the leader never resolves a model, and the nodes it places one on fetch its files
by the manifest from the nodes that hold them. The leader answers
with an outcome (a tagged union: placed, exists, deleted, not found, invalid, unavailable, each with
its reason); `api/` alone turns outcomes into HTTP statuses. Encoded like the runner wire: pydantic
messages as CBOR, one message per request or answer; bad bytes raise `ControlWireError` (the message
is dropped, never a crash). Message tags are append-only.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt, TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, encode_cbor
from protocol.cluster_view import InstanceView
from protocol.manifest import Manifest
from protocol.placement import MAX_REPLICAS, ModelShape
from protocol.sharding import ShardingChoice

CONTROL_PROTOCOL = "/shoal/control/5.0.0"
"""5.0.0: a node asks a peer to describe a model it holds by name. 4.0.0: a place request may ask
for replicas, and its answer lists them. 3.0.0: a place request carries the model's manifest.
2.0.0: typed outcomes replaced 1.0.0's `ControlAnswer` with HTTP status codes. A node of another
version does not speak this protocol: asking it is `Unavailable`."""
MAX_CONTROL_BYTES = 1024 * 1024


class PlaceInstance(WireMessage):
    """Place `source` (served as `model`); `preview` computes the plan without writing it."""

    type: Literal["place"] = "place"
    model: str
    source: str
    shape: ModelShape
    nodes: int | None = None
    preview: bool = False
    manifest: Manifest | None = None
    """The model's files as the requesting node holds them (None for a preview: nothing is hashed)."""
    hub_repo: str = ""
    """The Hugging Face repo the model came from, for stage nodes no peer can serve; else empty."""
    replicas: StrictInt | None = Field(default=None, ge=1, le=MAX_REPLICAS)
    """Keep this many instances of the model, on disjoint nodes: the leader places the missing ones
    (as many as fit). None: one instance per model, `Exists` when there is one."""
    sharding: ShardingChoice = "pipeline"
    """How each instance spreads over its nodes (`InstanceRecord.sharding`); "auto": the leader picks."""


class DeleteInstance(WireMessage):
    type: Literal["delete"] = "delete"
    instance_id: str


# --- the leader's outcomes: what happened, never how HTTP would say it (that is `api/`'s job) ----
class Placed(WireMessage):
    """The leader wrote this instance; for a preview, the instance it would write."""

    type: Literal["placed"] = "placed"
    instance: InstanceView
    stage_bytes: tuple[int, ...] = ()
    """Bytes each stage needs, in stage order."""
    preview: bool = False
    replicas: tuple[InstanceView, ...] = ()
    """With `PlaceInstance.replicas`: every instance of the model after the request (the running
    ones by id, then the new ones); `instance` is the first new one."""
    requested: int | None = None
    """The replicas asked for; `replicas` holds fewer when no more fit."""
    sharding_reason: str = ""
    """Why the leader chose the sharding, when the request asked for "auto"."""


class Exists(WireMessage):
    """The model already has an instance (or as many replicas as asked, or no more fit): this one;
    nothing was written."""

    type: Literal["exists"] = "exists"
    instance: InstanceView
    replicas: tuple[InstanceView, ...] = ()
    """As `Placed.replicas`; `instance` is the first of them."""
    requested: int | None = None


class Deleted(WireMessage):
    """The leader removed this instance; its nodes stop its runners."""

    type: Literal["deleted"] = "deleted"
    instance: InstanceView


class NotFound(WireMessage):
    """The model does not resolve (`kind="model"`) or no instance has that id (`kind="instance"`)."""

    type: Literal["not_found"] = "not_found"
    kind: Literal["model", "instance"]
    reason: str


class Invalid(WireMessage):
    """A request the leader will never grant as sent: the model does not fit the nodes alive
    (`does_not_fit`), the bytes were not a control request (`malformed`), or this cluster cannot
    run it as asked (`unsupported`)."""

    type: Literal["invalid"] = "invalid"
    kind: Literal["does_not_fit", "malformed", "unsupported"]
    reason: str


class Unavailable(WireMessage):
    """No leader could decide now (none yet, not or no longer the leader, no answer): ask again."""

    type: Literal["unavailable"] = "unavailable"
    kind: Literal["no_leader", "not_leader", "no_answer"]
    reason: str


PlaceOutcome = Placed | Exists | NotFound | Invalid | Unavailable
"""What placing (or previewing) an instance can come to."""
DeleteOutcome = Deleted | NotFound | Invalid | Unavailable
"""What deleting an instance can come to."""
PLACE_OUTCOMES = (Placed, Exists, NotFound, Invalid, Unavailable)
DELETE_OUTCOMES = (Deleted, NotFound, Invalid, Unavailable)


class DescribeModel(WireMessage):
    """Any node -> a peer: describe the model you hold (or can prepare from your own files) as
    `name`, so that I can place it by that name (`protocol.model_names`)."""

    type: Literal["describe_model"] = "describe_model"
    name: str = Field(min_length=1, max_length=512)


class ModelDescribed(WireMessage):
    """The answer to `DescribeModel` (else `NotFound`): what a place request for it carries. The
    files are served by the answering node from now on."""

    type: Literal["model_described"] = "model_described"
    model: str
    """The name it is served as (a clashing name gets a suffix: `protocol.model_names`)."""
    shape: ModelShape
    manifest: Manifest
    hub_repo: str = ""


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
    PlaceInstance
    | DeleteInstance
    | Placed
    | Exists
    | Deleted
    | NotFound
    | Invalid
    | Unavailable
    | StageAddress
    | StageAddressAnswer
    | DescribeModel
    | ModelDescribed,
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
