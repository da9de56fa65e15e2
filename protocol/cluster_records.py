"""The records of the cluster state, their owners and their size limits. Pure values, no I/O.

Every record lives under a key `(kind, id)` in an `Entry` saying who wrote it (`owner`) and at which
`version` (merged as `protocol.cluster` says). Five kinds are owned by a node, keyed by its id: its
profile, liveness claim, model files held, files moving to it, and the load of the instances it is
the entry of; two by the leader: the leader claim (a singleton) and one record per instance. Files,
transfers and loads are records of their own, so that frequent writes of one never carry another.

The limits (`protocol.record_limits`) are enforced when a record is built, so a state never holds a
record that the wire codec (`protocol.cluster_codec`) would refuse: what one node writes, every node
can decode.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import IntEnum

from protocol.health import RUNNER_STATES, RunnerState
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import MAX_MANIFEST_FILES, Manifest, TransferProgress
from protocol.model_shape import ModelShape
from protocol.record_limits import (
    MANIFEST_ID_CHARS,
    MAX_ENTRY_LOADS,
    MAX_ERROR_CHARS,
    MAX_HOLDINGS,
    MAX_ID_CHARS,
    MAX_LAYERS,
    MAX_LINKS,
    MAX_MULTIADDRS,
    MAX_STAGES,
    MAX_SUSPECTS,
    MAX_TEXT_CHARS,
    MAX_TRANSFERS,
    MAX_URL_CHARS,
    RecordError,
    check_int,
    check_keyed,
    check_node_id,
    check_text,
)
from protocol.sharding import Sharding, layout_error


class RecordKind(IntEnum):
    """What a record is; the value is its wire tag. ONLY APPEND TO THIS LIST."""

    PROFILE = 1
    LIVENESS = 2
    LEADER = 3
    INSTANCE = 4
    HOLDINGS = 5
    TRANSFERS = 6
    LOAD = 7


NODE_KINDS = tuple(k for k in RecordKind if k not in (RecordKind.LEADER, RecordKind.INSTANCE))
"""Kinds keyed and owned by one node: only that node writes them."""
LEADER_KEY_ID = ""
"""The id of the single `LEADER` record."""

RecordKey = tuple[RecordKind, str]
Version = tuple[int, int]
"""(incarnation, counter) for node-owned records; (term, counter) for leader-owned ones."""
Stamp = tuple[int, int, int]
"""A version plus a 63-bit hash of (owner, value): the total order entries merge by."""


def check_version(version: Version) -> None:
    check_int("version[0]", version[0])
    check_int("version[1]", version[1])


@dataclass(frozen=True, slots=True, order=True)
class RoundTrip:
    """The round trip a node measured to `node` (`node.cluster.links`), in microseconds."""

    node: NodeId
    us: int

    def __post_init__(self) -> None:
        check_node_id("round trip node", self.node)
        check_int("round trip", self.us)


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """What a node says about itself. Owned by that node; rewritten only when it changes."""

    hostname: str
    os: str
    accelerator: str
    """Where the model runs: "cpu", "metal", "cuda" (`backend` in `/v1/cluster`)."""
    memory_total: int
    """Bytes."""
    memory_available: int
    """Bytes; round it before writing, or every small change becomes a gossip message."""
    api_url: str
    version: str
    """Shoal's version on that node."""
    started_at: float
    """Wall-clock seconds since the epoch, for display only: liveness never compares remote clocks."""
    multiaddrs: tuple[str, ...] = ()
    links: tuple[RoundTrip, ...] = ()
    """Round trips to the peers this node measured lately, for "auto" sharding; rounded (few
    rewrites)."""

    def __post_init__(self) -> None:
        check_text("hostname", self.hostname, MAX_TEXT_CHARS)
        check_text("os", self.os, MAX_TEXT_CHARS)
        check_text("accelerator", self.accelerator, MAX_TEXT_CHARS)
        check_int("memory_total", self.memory_total)
        check_int("memory_available", self.memory_available)
        check_text("api_url", self.api_url, MAX_URL_CHARS)
        check_text("version", self.version, MAX_TEXT_CHARS)
        if type(self.started_at) is not float or not math.isfinite(self.started_at):
            raise RecordError("started_at must be a finite float")
        if not isinstance(self.multiaddrs, tuple) or len(self.multiaddrs) > MAX_MULTIADDRS:
            raise RecordError(f"multiaddrs must be a tuple of at most {MAX_MULTIADDRS}")
        for addr in self.multiaddrs:
            check_text("multiaddr", addr, MAX_URL_CHARS, allow_empty=False)
        check_keyed("links", self.links, RoundTrip, MAX_LINKS, lambda trip: trip.node)


@dataclass(frozen=True, slots=True, order=True)
class Suspicion:
    """`node` at `incarnation` has not been heard from lately (by the owner of the liveness record)."""

    node: NodeId
    incarnation: int

    def __post_init__(self) -> None:
        check_node_id("suspected node", self.node)
        check_int("suspected incarnation", self.incarnation)


@dataclass(frozen=True, slots=True)
class Liveness:
    """A node's claim to be alive; its version (incarnation, counter) is the heartbeat. `left` is a
    clean goodbye (observers mark it left at once); `suspects` lists whom the owner suspects, so that a
    suspect hears of it and refutes it by bumping its incarnation (`ClusterState.with_heartbeat`)."""

    left: bool = False
    suspects: tuple[Suspicion, ...] = ()

    def __post_init__(self) -> None:
        if type(self.left) is not bool:
            raise RecordError("left must be a bool")
        if not isinstance(self.suspects, tuple) or len(self.suspects) > MAX_SUSPECTS:
            raise RecordError(f"suspects must be a tuple of at most {MAX_SUSPECTS}")
        for suspicion in self.suspects:
            if not isinstance(suspicion, Suspicion):
                raise RecordError("suspects must hold Suspicion values")


@dataclass(frozen=True, slots=True)
class LeaderClaim:
    """`node` leads the cluster for `term`. Stored once, under the `LEADER` key, at version (term, 0)."""

    node: NodeId
    term: int

    def __post_init__(self) -> None:
        check_node_id("leader", self.node)
        check_int("term", self.term)


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """Layers [start_layer, end_layer) of an instance run on `node`."""

    node: NodeId
    start_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        check_node_id("stage node", self.node)
        check_int("start_layer", self.start_layer)
        check_int("end_layer", self.end_layer)
        if self.start_layer >= self.end_layer:
            raise RecordError(f"empty stage [{self.start_layer}, {self.end_layer})")


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """One placement of a model: its stages (`sharding` says how), in order. Written by the leader."""

    instance_id: InstanceId
    model: ModelId
    """The id clients name in requests (`/v1/models`)."""
    stages: tuple[StageAssignment, ...]
    source: str = ""
    """The model reference as the requesting node wrote it (built-in name, folder, .gguf or Hugging
    Face repo id); empty means `model` itself. Only a record without a manifest is resolved by it."""
    manifest: Manifest | None = None
    """The model's files: a stage node that lacks them fetches them from the nodes that hold them."""
    shape: ModelShape | None = None
    """What the requesting node read of the model, so that a leader re-places the instance
    without resolving the model itself."""
    hub_repo: str = ""
    """The Hugging Face repo the files also come from, when no peer has them; empty: peers only."""
    sharding: Sharding = "pipeline"
    """"pipeline": contiguous stages; "tensor": the ranks, each [0, layers) (`protocol.sharding`)."""

    def __post_init__(self) -> None:
        check_node_id("instance_id", self.instance_id)
        check_text("model", self.model, MAX_TEXT_CHARS, allow_empty=False)
        check_text("source", self.source, MAX_URL_CHARS)
        check_text("hub_repo", self.hub_repo, MAX_TEXT_CHARS)
        if not isinstance(self.stages, tuple) or not 1 <= len(self.stages) <= MAX_STAGES:
            raise RecordError(f"an instance has 1 to {MAX_STAGES} stages")
        if why := layout_error(self.sharding, [(s.node, s.start_layer, s.end_layer) for s in self.stages]):
            raise RecordError(why)
        if self.manifest is not None and not isinstance(self.manifest, Manifest):
            raise RecordError("manifest must be a Manifest")
        if self.shape is not None:
            if not isinstance(self.shape, ModelShape) or self.shape.num_layers > MAX_LAYERS:
                raise RecordError(f"shape must be a ModelShape of at most {MAX_LAYERS} layers")
            if self.stages[-1].end_layer != self.shape.num_layers:
                raise RecordError("the stages must cover the shape's layers")


@dataclass(frozen=True, slots=True)
class Holding:
    """A model whose files a node holds and serves: all of them, or those at `files` (indices into
    the manifest's files, which the reader knows from the instance record naming the manifest)."""

    manifest_id: str
    files: tuple[int, ...] | None = None
    """Sorted, unique indices; None: every file of the manifest."""
    model: str = ""
    """The holder's name for the model, by which any node may place it (`protocol.model_names`)."""

    def __post_init__(self) -> None:
        check_text("manifest_id", self.manifest_id, MANIFEST_ID_CHARS, allow_empty=False)
        check_text("holding model", self.model, MAX_TEXT_CHARS)
        if self.files is None:
            return
        if not isinstance(self.files, tuple) or len(self.files) > MAX_MANIFEST_FILES:
            raise RecordError(f"files must be a tuple of at most {MAX_MANIFEST_FILES} indices")
        for index in self.files:
            check_int("file index", index)
        if any(a >= b for a, b in zip(self.files, self.files[1:], strict=False)):
            raise RecordError("file indices must be sorted and unique")


@dataclass(frozen=True, slots=True)
class NodeHoldings:
    """The models a node serves to its peers (`GET /v1/files/...`). Owned by that node."""

    models: tuple[Holding, ...] = ()

    def __post_init__(self) -> None:
        check_keyed("holdings", self.models, Holding, MAX_HOLDINGS, lambda held: held.manifest_id)


@dataclass(frozen=True, slots=True)
class NodeTransfers:
    """Model files moving to a node now, and the latest finished moves (with a failure's reason)."""

    transfers: tuple[TransferProgress, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.transfers, tuple) or len(self.transfers) > MAX_TRANSFERS:
            raise RecordError(f"a node shows at most {MAX_TRANSFERS} transfers")
        for transfer in self.transfers:
            if not isinstance(transfer, TransferProgress):
                raise RecordError("transfers must hold TransferProgress values")
            check_text("transfer manifest_id", transfer.manifest_id, MANIFEST_ID_CHARS)
            check_text("transfer model", transfer.model, MAX_TEXT_CHARS)
            check_text("transfer error", transfer.error or "", MAX_ERROR_CHARS)
            for value in (
                transfer.bytes_done,
                transfer.bytes_total,
                transfer.files_done,
                transfer.files_total,
            ):
                check_int("transfer count", value)
            if not math.isfinite(transfer.rate_bps):
                raise RecordError("a transfer's rate must be finite")


@dataclass(frozen=True, slots=True)
class EntryLoad:
    """An instance whose first stage runs on the reporting node: its runner's state (None before there
    is one; `error` if it failed or restarts), requests in it (`active`) and since start (`served`)."""

    instance_id: InstanceId
    runner: RunnerState | None
    active: int
    queued: int
    served: int
    error: str = ""

    def __post_init__(self) -> None:
        check_node_id("load instance_id", self.instance_id)
        if self.runner is not None and self.runner not in RUNNER_STATES:
            raise RecordError(f"unknown runner state {self.runner!r}")
        check_text("load error", self.error, MAX_ERROR_CHARS)
        for name in ("active", "queued", "served"):
            check_int(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """The instances a node is the entry of, and their load (`protocol.replicas` routes by it)."""

    entries: tuple[EntryLoad, ...] = ()

    def __post_init__(self) -> None:
        check_keyed("loads", self.entries, EntryLoad, MAX_ENTRY_LOADS, lambda entry: entry.instance_id)


RecordValue = NodeProfile | Liveness | LeaderClaim | InstanceRecord | NodeHoldings | NodeTransfers | NodeLoad
VALUE_TYPES: dict[RecordKind, type] = {
    RecordKind.PROFILE: NodeProfile,
    RecordKind.LIVENESS: Liveness,
    RecordKind.LEADER: LeaderClaim,
    RecordKind.INSTANCE: InstanceRecord,
    RecordKind.HOLDINGS: NodeHoldings,
    RecordKind.TRANSFERS: NodeTransfers,
    RecordKind.LOAD: NodeLoad,
}


def _value_hash(owner: NodeId, value: RecordValue | None) -> int:
    # repr of these frozen dataclasses and pydantic models (str, int, float, bool, None, tuples) is
    # deterministic across processes and platforms; a change of fields is a schema change, so mixed
    # reprs never meet.
    text = repr((owner, value)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1  # <= MAX_INT


@dataclass(frozen=True, slots=True)
class Entry:
    """A record as stored: who wrote it, at which version; `value=None` is a tombstone (a delete)."""

    owner: NodeId
    version: Version
    value: RecordValue | None
    stamp: Stamp = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_node_id("owner", self.owner)
        check_version(self.version)
        object.__setattr__(
            self, "stamp", (self.version[0], self.version[1], _value_hash(self.owner, self.value))
        )


def check_entry(key: RecordKey, entry: Entry) -> None:
    """The rules tying a key to its entry; what a peer sends must pass them (see the codec).

    A node-owned record must be owned by the node it is keyed by; the leader claim must be owned by
    the node it names, at version (term, 0); an instance must be keyed by its own id.
    """
    kind, key_id = key
    check_text("key id", key_id, MAX_ID_CHARS)
    value = entry.value
    if value is not None and not isinstance(value, VALUE_TYPES[kind]):
        raise RecordError(f"a {kind.name} key holds a {type(value).__name__}")
    if kind in NODE_KINDS:
        if entry.owner != key_id:
            raise RecordError(f"{kind.name} of {key_id!r} written by {entry.owner!r}")
    elif kind is RecordKind.LEADER:
        if key_id != LEADER_KEY_ID:
            raise RecordError("the leader claim has a single key")
        if isinstance(value, LeaderClaim) and (value.node != entry.owner or entry.version != (value.term, 0)):
            raise RecordError("a leader claim is written by its node at version (term, 0)")
    elif isinstance(value, InstanceRecord) and value.instance_id != key_id:
        raise RecordError(f"instance {value.instance_id!r} stored under {key_id!r}")
