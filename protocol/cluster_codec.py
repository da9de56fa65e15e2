"""The gossip and anti-entropy wire: cluster messages as CBOR. Sans-I/O: bytes in, messages out.

A message is the CBOR array `[SCHEMA_VERSION, tag, body]`. Records are positional arrays (see
`_value_to_wire`); changing a record's fields is a schema change: bump `SCHEMA_VERSION` (nodes of two
schemas ignore each other). Message tags and record kinds are append-only.

Decoding takes hostile bytes. Before cbor2 sees them, `_scan` walks the raw CBOR and refuses anything
outside the small subset this wire uses (arrays, text, integers, floats, booleans, null; no maps, byte
strings, tags, indefinite lengths; bounded depth), so cbor2 never builds a big, deep or exotic object.
Every failure is a `WireDecodeError`: the caller drops the message and counts it. The field readers
and the larger values (manifests, shapes, holdings, transfers) are in `protocol.codec_fields`.

Anti-entropy, push-pull (stream, node A to a random peer B):
A sends `DigestRequest(digest_A)`; B answers `DigestReply(B.missing_for(digest_A), digest_B)`;
A merges the delta and sends `Delta(A.missing_for(digest_B))`. Gossip: `Delta` of one's own writes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeAlias, assert_never

import cbor2

from protocol.cluster import ClusterState, Digest
from protocol.cluster_records import (
    Entry,
    EntryLoad,
    InstanceRecord,
    LeaderClaim,
    Liveness,
    NodeHoldings,
    NodeLoad,
    NodeProfile,
    NodeTransfers,
    RecordKey,
    RecordKind,
    RecordValue,
    RoundTrip,
    StageAssignment,
    Suspicion,
)
from protocol.codec_fields import (
    MAX_ENTRIES,
    WireDecodeError,
    holdings_from_wire,
    holdings_to_wire,
    manifest_from_wire,
    manifest_to_wire,
    shape_from_wire,
    shape_to_wire,
    transfers_from_wire,
    transfers_to_wire,
    wire_int,
    wire_list,
    wire_str,
)
from protocol.health import RUNNER_STATES
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.record_limits import RecordError
from protocol.sharding import SHARDINGS

SCHEMA_VERSION = 6
"""Bump on any change to a record's or a message's layout. 6: a load says its runner's state.
5: a holding names its model. 4: load records. 3: instance records
carry the model's manifest, shape and hub repo; holdings and transfers records."""
MAX_MESSAGE_BYTES = 512 * 1024
"""Half of GossipSub's 1 MiB delivery limit; `encode_delta` splits bigger deltas."""
MAX_DEPTH = 8
"""CBOR nesting: message > body > entry > value > list > item; anything deeper is hostile."""


class MessageTag(IntEnum):
    """ONLY APPEND TO THIS LIST."""

    DELTA = 1
    DIGEST_REQUEST = 2
    DIGEST_REPLY = 3


@dataclass(frozen=True, slots=True)
class Delta:
    """Entries to merge: a node's own writes (gossip), or what a peer lacks (anti-entropy)."""

    state: ClusterState


@dataclass(frozen=True, slots=True)
class DigestRequest:
    digest: Digest


@dataclass(frozen=True, slots=True)
class DigestReply:
    delta: ClusterState
    """What the requester lacked."""
    digest: Digest
    """The replier's digest, so the requester can send back what the replier lacks."""


GossipMessage: TypeAlias = Delta | DigestRequest | DigestReply


class WireEncodeError(ValueError):
    """A local bug: a message this node must not send (over a size limit)."""


# Encoding.
def _value_to_wire(value: RecordValue | None) -> Any:
    match value:
        case None:
            return None
        case NodeProfile():
            v = value
            return [
                v.hostname,
                v.os,
                v.accelerator,
                v.memory_total,
                v.memory_available,
                v.api_url,
                v.version,
                v.started_at,
                list(v.multiaddrs),
            ] + ([[[t.node, t.us] for t in v.links]] if v.links else [])  # 9 for older nodes
        case Liveness():
            return [value.left, [[s.node, s.incarnation] for s in value.suspects]]
        case LeaderClaim():
            return [value.node, value.term]
        case InstanceRecord():
            stages = [[s.node, s.start_layer, s.end_layer] for s in value.stages]
            manifest, shape = manifest_to_wire(value.manifest), shape_to_wire(value.shape)
            fields = [value.instance_id, value.model, stages, value.source, manifest, shape, value.hub_repo]
            return fields + ([value.sharding] if value.sharding != "pipeline" else [])  # 7 for older nodes
        case NodeHoldings():
            return holdings_to_wire(value.models)
        case NodeTransfers():
            return transfers_to_wire(value.transfers)
        case NodeLoad():
            return [[e.instance_id, e.runner, e.active, e.queued, e.served, e.error] for e in value.entries]
        case _:
            assert_never(value)


def _entry_to_wire(key: RecordKey, entry: Entry) -> list[Any]:
    return [int(key[0]), key[1], entry.owner, entry.version[0], entry.version[1], _value_to_wire(entry.value)]


def _state_to_wire(state: ClusterState) -> list[Any]:
    return [_entry_to_wire(key, entry) for key, entry in state]


def _digest_to_wire(digest: Digest) -> list[Any]:
    return [[int(kind), key_id, *stamp] for (kind, key_id), stamp in digest.stamps.items()]


def encode_message(message: GossipMessage) -> bytes:
    """CBOR bytes for `message`. Raises WireEncodeError past `MAX_ENTRIES` or `MAX_MESSAGE_BYTES`."""
    match message:
        case Delta(state=state):
            tag, sizes, body = MessageTag.DELTA, [len(state)], _state_to_wire(state)
        case DigestRequest(digest=digest):
            tag, sizes, body = MessageTag.DIGEST_REQUEST, [len(digest)], _digest_to_wire(digest)
        case DigestReply(delta=delta, digest=digest):
            tag, sizes = MessageTag.DIGEST_REPLY, [len(delta), len(digest)]
            body = [_state_to_wire(delta), _digest_to_wire(digest)]
        case _:
            assert_never(message)
    if max(sizes) > MAX_ENTRIES:
        raise WireEncodeError(f"{max(sizes)} entries exceed {MAX_ENTRIES}")
    data: bytes = cbor2.dumps([SCHEMA_VERSION, int(tag), body])
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireEncodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def encode_delta(state: ClusterState, max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """`state` as one or more `Delta` messages, each within `max_bytes` and `MAX_ENTRIES`."""
    messages: list[bytes] = []
    batch: list[Any] = []
    size = 16  # envelope and array headers
    for key, entry in state:
        item = _entry_to_wire(key, entry)
        item_size = len(cbor2.dumps(item))
        if batch and (size + item_size > max_bytes or len(batch) >= MAX_ENTRIES):
            messages.append(cbor2.dumps([SCHEMA_VERSION, int(MessageTag.DELTA), batch]))
            batch, size = [], 16
        batch.append(item)
        size += item_size
    if batch or not messages:
        messages.append(cbor2.dumps([SCHEMA_VERSION, int(MessageTag.DELTA), batch]))
    return messages


def encode_digest_reply(state: ClusterState, remote: Digest, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Answers `DigestRequest(remote)`: this node's digest plus as much of what the requester lacks as
    fits in `max_bytes` (the rest follows in the next exchange). Raises WireEncodeError only if the
    digest alone does not fit."""
    digest = _digest_to_wire(state.digest())
    if len(digest) > MAX_ENTRIES:
        raise WireEncodeError(f"{len(digest)} digest entries exceed {MAX_ENTRIES}")
    size = len(cbor2.dumps(digest)) + 16
    entries: list[Any] = []
    for key, entry in state.missing_for(remote, limit=MAX_ENTRIES):
        item = _entry_to_wire(key, entry)
        size += len(cbor2.dumps(item))
        if size > max_bytes:
            break
        entries.append(item)
    data: bytes = cbor2.dumps([SCHEMA_VERSION, int(MessageTag.DIGEST_REPLY), [entries, digest]])
    if len(data) > max_bytes:
        raise WireEncodeError(f"a digest of {len(data)} bytes exceeds {max_bytes}")
    return data


# Decoding: first the raw scan, then typed parsing of plain lists.
_UINT = {24: struct.Struct(">B"), 25: struct.Struct(">H"), 26: struct.Struct(">I"), 27: struct.Struct(">Q")}


def _scan(data: bytes) -> None:
    """Refuses any CBOR outside the wire's subset, before it is decoded (see the module docstring)."""
    pos, end = 0, len(data)
    pending = [1]  # items still to read in each open array, outermost first
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= end:
            raise WireDecodeError("truncated CBOR")
        initial = data[pos]
        pos += 1
        major, info = initial >> 5, initial & 0x1F
        if info < 24:
            arg = info
        elif info in _UINT:
            fmt = _UINT[info]
            if pos + fmt.size > end:
                raise WireDecodeError("truncated CBOR")
            (arg,) = fmt.unpack_from(data, pos)
            pos += fmt.size
        else:
            raise WireDecodeError(f"unsupported CBOR length encoding {info}")
        if major in (0, 1):  # integers
            continue
        if major == 3:  # text: its bytes must be there
            if arg > end - pos:
                raise WireDecodeError("truncated CBOR text")
            pos += arg
        elif major == 4:  # array: each item takes at least one byte
            if arg > end - pos:
                raise WireDecodeError("CBOR array longer than the message")
            if len(pending) > MAX_DEPTH:
                raise WireDecodeError(f"CBOR nested deeper than {MAX_DEPTH}")
            pending.append(arg)
        elif major == 7 and (20 <= info <= 22 or info in (25, 26, 27)):  # false, true, null, floats
            continue
        else:
            raise WireDecodeError(f"unsupported CBOR item (major type {major}, info {info})")
    if pos != end:
        raise WireDecodeError("trailing bytes after the message")


def _value_from_wire(kind: RecordKind, obj: object) -> RecordValue | None:
    if obj is None:
        return None
    if kind is RecordKind.PROFILE:
        f = wire_list(obj, "profile")
        if len(f) not in (9, 10):  # 10: with the round trips
            raise WireDecodeError(f"profile: wrong length {len(f)}")
        started = f[7]
        if type(started) not in (int, float) or not math.isfinite(started):
            raise WireDecodeError("profile.started_at: expected a number")
        addrs = tuple(wire_str(a, "multiaddr") for a in wire_list(f[8], "multiaddrs"))
        return NodeProfile(
            wire_str(f[0], "hostname"),
            wire_str(f[1], "os"),
            wire_str(f[2], "accelerator"),
            wire_int(f[3], "memory_total"),
            wire_int(f[4], "memory_available"),
            wire_str(f[5], "api_url"),
            wire_str(f[6], "version"),
            float(started),
            addrs,
            tuple(_round_trip(item) for item in wire_list(f[9], "links")) if len(f) == 10 else (),
        )
    if kind is RecordKind.LIVENESS:
        f = wire_list(obj, "liveness", 2)
        if type(f[0]) is not bool:
            raise WireDecodeError("liveness.left: expected a bool")
        suspects = []
        for item in wire_list(f[1], "suspects"):
            pair = wire_list(item, "suspicion", 2)
            suspects.append(Suspicion(NodeId(wire_str(pair[0], "node")), wire_int(pair[1], "incarnation")))
        return Liveness(f[0], tuple(suspects))
    if kind is RecordKind.LEADER:
        f = wire_list(obj, "leader claim", 2)
        return LeaderClaim(NodeId(wire_str(f[0], "node")), wire_int(f[1], "term"))
    if kind is RecordKind.HOLDINGS:
        return NodeHoldings(holdings_from_wire(obj))
    if kind is RecordKind.TRANSFERS:
        return NodeTransfers(transfers_from_wire(obj))
    if kind is RecordKind.LOAD:
        return NodeLoad(tuple(_entry_load(item) for item in wire_list(obj, "loads")))
    f = wire_list(obj, "instance")
    if len(f) not in (7, 8):
        raise WireDecodeError(f"instance: wrong length {len(f)}")
    sharding = wire_str(f[7], "sharding") if len(f) == 8 else "pipeline"
    if sharding not in SHARDINGS:
        raise WireDecodeError(f"instance.sharding: {sharding!r} is not one of {SHARDINGS}")
    stages = []
    for item in wire_list(f[2], "stages"):
        s = wire_list(item, "stage", 3)
        node, start, end = NodeId(wire_str(s[0], "node")), wire_int(s[1], "start"), wire_int(s[2], "end")
        stages.append(StageAssignment(node, start, end))
    return InstanceRecord(
        InstanceId(wire_str(f[0], "instance_id")),
        ModelId(wire_str(f[1], "model")),
        tuple(stages),
        wire_str(f[3], "source"),
        manifest_from_wire(f[4]),
        shape_from_wire(f[5]),
        wire_str(f[6], "hub_repo"),
        sharding,
    )


def _round_trip(obj: object) -> RoundTrip:
    f = wire_list(obj, "round trip", 2)
    return RoundTrip(NodeId(wire_str(f[0], "round trip node")), wire_int(f[1], "round trip"))


def _entry_load(obj: object) -> EntryLoad:
    f = wire_list(obj, "load", 6)
    if f[1] is not None and f[1] not in RUNNER_STATES:
        raise WireDecodeError("load.runner: expected a runner state or null")
    active, queued, served = (wire_int(f[i], "load count") for i in (2, 3, 4))
    instance = InstanceId(wire_str(f[0], "instance_id"))
    return EntryLoad(instance, f[1], active, queued, served, wire_str(f[5], "load error"))


def _kind(obj: object) -> RecordKind:
    try:
        return RecordKind(wire_int(obj, "record kind"))
    except ValueError as exc:  # includes WireDecodeError
        raise WireDecodeError(f"unknown record kind {obj!r}") from exc


def _state_from_wire(obj: object) -> ClusterState:
    pairs: list[tuple[RecordKey, Entry]] = []
    for item in wire_list(obj, "entries"):
        f = wire_list(item, "entry", 6)
        kind = _kind(f[0])
        key: RecordKey = (kind, wire_str(f[1], "key"))
        version = (wire_int(f[3], "version"), wire_int(f[4], "version"))
        pairs.append((key, Entry(NodeId(wire_str(f[2], "owner")), version, _value_from_wire(kind, f[5]))))
    return ClusterState.of(pairs)


def _digest_from_wire(obj: object) -> Digest:
    stamps = {}
    for item in wire_list(obj, "digest"):
        f = wire_list(item, "stamp", 5)
        stamps[(_kind(f[0]), wire_str(f[1], "key"))] = (
            wire_int(f[2], "stamp"),
            wire_int(f[3], "stamp"),
            wire_int(f[4], "stamp"),
        )
    return Digest(stamps)


def decode_message(data: bytes) -> GossipMessage:
    """Parses one message. Raises WireDecodeError, and nothing else, on any malformed input."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireDecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    _scan(data)
    try:
        obj = cbor2.loads(data)
    except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError) as exc:
        raise WireDecodeError(f"undecodable CBOR: {exc}") from exc
    envelope = wire_list(obj, "message", 3)
    if envelope[0] != SCHEMA_VERSION or type(envelope[0]) is not int:
        raise WireDecodeError(f"schema version {envelope[0]!r}, expected {SCHEMA_VERSION}")
    try:
        tag = MessageTag(wire_int(envelope[1], "tag"))
    except ValueError as exc:
        raise WireDecodeError(f"unknown message tag {envelope[1]!r}") from exc
    body = envelope[2]
    try:
        if tag is MessageTag.DELTA:
            return Delta(_state_from_wire(body))
        if tag is MessageTag.DIGEST_REQUEST:
            return DigestRequest(_digest_from_wire(body))
        pair = wire_list(body, "digest reply", 2)
        return DigestReply(_state_from_wire(pair[0]), _digest_from_wire(pair[1]))
    except RecordError as exc:
        raise WireDecodeError(f"invalid record: {exc}") from exc
