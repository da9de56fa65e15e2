"""The gossip wire: round trips, size caps, and hostile bytes that must only ever raise WireDecodeError."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.cluster import ClusterState, Digest
from protocol.cluster_codec import (
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Delta,
    DigestReply,
    DigestRequest,
    MessageTag,
    WireDecodeError,
    WireEncodeError,
    decode_message,
    encode_delta,
    encode_digest_reply,
    encode_message,
)
from protocol.cluster_records import (
    Holding,
    InstanceRecord,
    NodeHoldings,
    NodeProfile,
    NodeTransfers,
    RecordKind,
    RoundTrip,
    StageAssignment,
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import MAX_MANIFEST_FILES, MAX_PATH_CHARS, FileEntry, TransferProgress, manifest_of
from protocol.model_shape import ModelShape
from protocol.record_limits import MAX_HOLDINGS, MAX_LAYERS, MAX_MULTIADDRS, MAX_TEXT_CHARS, MAX_TRANSFERS
from tests.cluster_strategies import NODES, states

A, B = NODES[0], NODES[1]


def same(x: ClusterState, y: ClusterState) -> bool:
    return dict(x.entries) == dict(y.entries)


def wire(body: Any, tag: int = MessageTag.DELTA, version: Any = SCHEMA_VERSION) -> bytes:
    return cbor2.dumps([version, tag, body])


def profile_wire(hostname: str = "h", addrs: list[str] | None = None) -> list[Any]:
    return [hostname, "linux", "cpu", 1 << 34, 1 << 33, "http://h:8000", "0.1.0", 1.5, addrs or []]


def entry_wire(
    node: str = A, owner: str = A, value: Any = None, version: tuple[int, int] = (0, 1)
) -> list[Any]:
    return [1, node, owner, *version, profile_wire() if value is None else value]


def instance_wire(
    iid: str = "i1",
    stages: list[list[Any]] | None = None,
    *,
    path: str = "config.json",
    sha: str = "c" * 64,
    version: int = 1,
    layers: int = 4,
    layer: int = 5,
) -> list[Any]:
    manifest = [version, [[path, 2, sha]], None]
    shape = ["m", [layer] * layers, 1, 1, False, 0, 0]
    return [iid, "m", stages or [[A, 0, 4]], "", manifest, shape, ""]


def transfer_wire(state: str = "fetching", rate: float = 1.0) -> list[Any]:
    return ["a" * 64, "m", "peers", state, 1, 2, rate, 0, 1, 1, None]


def assert_rejected(data: bytes) -> None:
    with pytest.raises(WireDecodeError):
        decode_message(data)


def decode_or_reject(data: bytes) -> None:
    """Decoding hostile bytes either works or raises WireDecodeError; nothing else."""
    with contextlib.suppress(WireDecodeError):
        decode_message(data)


# Round trips.
@settings(deadline=None)
@given(states, states)
def test_round_trip_every_message(x: ClusterState, y: ClusterState) -> None:
    for message in (Delta(x), DigestRequest(x.digest()), DigestReply(x, y.digest())):
        decoded = decode_message(encode_message(message))
        assert type(decoded) is type(message)
        match decoded, message:
            case Delta(state=got), Delta(state=want):
                assert same(got, want) and got.digest() == want.digest()
            case DigestRequest(digest=got_digest), DigestRequest(digest=want_digest):
                assert got_digest == want_digest
            case DigestReply(delta=got, digest=got_digest), DigestReply(delta=want, digest=want_digest):
                assert same(got, want) and got_digest == want_digest


def test_round_trip_of_a_real_node_state() -> None:
    profile = NodeProfile(
        "mac",
        "darwin",
        "metal",
        1 << 36,
        1 << 35,
        "http://10.0.0.2:8000",
        "0.1.0",
        1_700_000_000.123,
        ("/ip4/10.0.0.2/tcp/4001", "/ip6/::1/tcp/4001"),
    )
    state = ClusterState.empty().with_profile(A, profile).with_heartbeat(A).with_leader_claim(A, 3)
    decoded = decode_message(encode_message(Delta(state)))
    assert isinstance(decoded, Delta) and decoded.state == state
    assert decoded.state.profiles()[A] == profile
    measured = dataclasses.replace(profile, links=(RoundTrip(NodeId("b"), 21), RoundTrip(NodeId("c"), 1200)))
    decoded = decode_message(encode_message(Delta(ClusterState.empty().with_profile(A, measured))))
    assert isinstance(decoded, Delta) and decoded.state.profiles()[A] == measured


def test_encode_delta_splits_big_states_under_the_byte_limit() -> None:
    state = ClusterState.empty()
    for i in range(300):
        node = NodeId(f"12D3KooW{i:05d}")
        state = state.with_profile(node, NodeProfile("h" * 200, "linux", "cpu", 1, 1, "u", "v", 1.0))
    messages = encode_delta(state, max_bytes=16 * 1024)
    assert len(messages) > 3
    merged = ClusterState.empty()
    for data in messages:
        assert len(data) <= 16 * 1024
        decoded = decode_message(data)
        assert isinstance(decoded, Delta)
        merged = merged.merge(decoded.state)
    assert merged == state
    assert len(encode_delta(ClusterState.empty())) == 1


def test_digest_reply_fills_the_budget_and_the_rest_follows() -> None:
    state = ClusterState.empty()
    for i in range(200):
        node = NodeId(f"12D3KooW{i:05d}")
        state = state.with_profile(node, NodeProfile("h" * 200, "linux", "cpu", 1, 1, "u", "v", 1.0))
    replica = ClusterState.empty()
    for _ in range(10):
        data = encode_digest_reply(state, replica.digest(), max_bytes=32 * 1024)
        assert len(data) <= 32 * 1024
        reply = decode_message(data)
        assert isinstance(reply, DigestReply) and reply.digest == state.digest()
        replica = replica.merge(reply.delta)
    assert replica == state
    with pytest.raises(WireEncodeError):
        encode_digest_reply(state, replica.digest(), max_bytes=1024)


def test_the_largest_file_records_still_fit_one_gossip_message() -> None:
    """An instance naming a 512-file manifest and a 1024-layer shape, and a node holding 32 models
    (names of the longest) in part with 512 files each: each entry fits one gossip message (the
    mesh's 256 KiB)."""
    files = [
        FileEntry(path=f"{i:03d}" + "x" * (MAX_PATH_CHARS - 3), size=2**40, sha256="f" * 64)
        for i in range(MAX_MANIFEST_FILES)
    ]
    manifest = manifest_of(files, derived_from=FileEntry(path="m.gguf", size=1, sha256="e" * 64))
    shape = ModelShape.uniform(
        ModelId("m"), num_layers=MAX_LAYERS, bytes_per_layer=2**40, embedding_bytes=1, head_bytes=1
    )
    stages = tuple(StageAssignment(NodeId(f"12D3KooW{i:044d}"), i * 4, i * 4 + 4) for i in range(256))
    record = InstanceRecord(
        InstanceId("i" * 128), ModelId("m" * 256), stages, "s" * 512, manifest, shape, "o/r"
    )
    held = NodeHoldings(
        tuple(
            Holding(f"{i:064x}", tuple(range(0, 2 * MAX_MANIFEST_FILES, 2)), "n" * MAX_TEXT_CHARS)
            for i in range(MAX_HOLDINGS)
        )
    )
    transfer = TransferProgress(
        manifest_id="a" * 64,
        model="m" * MAX_TEXT_CHARS,
        source="peers",
        state="failed",
        bytes_done=2**50,
        bytes_total=2**50,
        rate_bps=1e12,
        files_done=512,
        files_total=512,
        peers=16,
        error="e" * 512,
    )
    moving = NodeTransfers((transfer,) * MAX_TRANSFERS)
    state = (
        ClusterState.empty()
        .with_leader_claim(A, 1)
        .with_instance(A, 1, record)
        .with_holdings(A, held)
        .with_transfers(A, moving)
    )
    for key, entry in state:
        (data,) = encode_delta(ClusterState.of([(key, entry)]))
        assert len(data) <= 256 * 1024, (key[0].name, len(data))
        decoded = decode_message(data)
        assert isinstance(decoded, Delta) and dict(decoded.state.entries) == {key: entry}


# Caps, on both sides.
def test_encode_refuses_more_than_max_entries() -> None:
    digest = Digest({(RecordKind.PROFILE, f"n{i}"): (0, 0, 0) for i in range(MAX_ENTRIES + 1)})
    with pytest.raises(WireEncodeError):
        encode_message(DigestRequest(digest))


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("too long a hostname", wire([entry_wire(value=profile_wire("x" * (MAX_TEXT_CHARS + 1)))])),
        (
            "too many multiaddrs",
            wire([entry_wire(value=profile_wire(addrs=["/ip4/1"] * (MAX_MULTIADDRS + 1)))]),
        ),
        ("too many entries", wire([[1, "x", "x", 0, 0, None]] * (MAX_ENTRIES + 1))),
        ("too many digest stamps", wire([[1, "x", 0, 0, 0]] * (MAX_ENTRIES + 1), MessageTag.DIGEST_REQUEST)),
        ("over the byte limit", wire([["x" * MAX_MESSAGE_BYTES]])),
        ("wrong schema version", wire([], version=SCHEMA_VERSION + 1)),
        ("schema version as a bool", cbor2.dumps([True, 1, []])),
        ("unknown message tag", wire([], tag=99)),
        ("unknown record kind", wire([[9, A, A, 0, 1, None]])),
        ("a profile owned by someone else", wire([entry_wire(node=A, owner=B)])),
        ("a claim in another's name", wire([[3, "", A, 1, 0, [B, 1]]])),
        ("a claim at the wrong version", wire([[3, "", A, 1, 5, [A, 1]]])),
        ("an instance under another key", wire([[4, "i1", A, 1, 1, instance_wire("i2")]])),
        ("overlapping stages", wire([[4, "i1", A, 1, 1, instance_wire(stages=[[A, 0, 4], [B, 2, 8]])]])),
        ("an instance of the old schema", wire([[4, "i1", A, 1, 1, ["i1", "m", [[A, 0, 4]], ""]]])),
        ("a manifest path leaving the folder", wire([[4, "i1", A, 1, 1, instance_wire(path="../x")]])),
        ("a manifest with a short hash", wire([[4, "i1", A, 1, 1, instance_wire(sha="ab")]])),
        ("a manifest of another version", wire([[4, "i1", A, 1, 1, instance_wire(version=2)]])),
        ("a shape with other layers than the stages", wire([[4, "i1", A, 1, 1, instance_wire(layers=3)]])),
        ("a shape with a negative layer", wire([[4, "i1", A, 1, 1, instance_wire(layer=-1)]])),
        ("holdings owned by another", wire([[5, A, B, 0, 1, [["a" * 64, None]]]])),
        ("holdings out of order", wire([[5, A, A, 0, 1, [["b" * 64, None], ["a" * 64, None]]]])),
        ("holdings with repeated files", wire([[5, A, A, 0, 1, [["a" * 64, [1, 1]]]]])),
        (
            "too many holdings",
            wire([[5, A, A, 0, 1, [[f"{i:064x}", None] for i in range(MAX_HOLDINGS + 1)]]]),
        ),
        ("a transfer in an unknown state", wire([[6, A, A, 0, 1, [transfer_wire(state="lost")]]])),
        ("a transfer at an infinite rate", wire([[6, A, A, 0, 1, [transfer_wire(rate=math.inf)]]])),
        ("too many transfers", wire([[6, A, A, 0, 1, [transfer_wire()] * (MAX_TRANSFERS + 1)]])),
        ("a negative counter", wire([entry_wire(version=(0, -1))])),
        ("a counter over 63 bits", wire([entry_wire(version=(0, 2**63))])),
        ("a bool as a counter", wire([entry_wire(version=(0, True))])),
        ("a float as a counter", wire([entry_wire(version=(0, 1.0))])),  # type: ignore[arg-type]
        ("a string as memory", wire([entry_wire(value=["h", "l", "c", "1", 1, "u", "v", 1.5, []])])),
        ("a NaN start time", wire([entry_wire(value=["h", "l", "c", 1, 1, "u", "v", math.nan, []])])),
        ("a short entry", wire([[1, A, A, 0, 1]])),
        ("a long entry", wire([[*entry_wire(), 7]])),
        ("a digest reply of one part", wire([[]], MessageTag.DIGEST_REPLY)),
        ("an empty node id", wire([entry_wire(node="", owner="")])),
        ("a map", cbor2.dumps({"v": 1})),
        ("a byte string", wire([b"\x00"])),
        ("a tag", wire(cbor2.CBORTag(2, b"\x01" * 100))),
        ("a regex tag", cbor2.dumps(cbor2.CBORTag(35, "(a+)+$"))),
        ("deep nesting", b"\x81" * 10_000 + b"\x00"),
        ("nesting just past the limit", cbor2.dumps([1, 1, [[[[[[[[]]]]]]]]])),
        ("a huge array length", b"\x9b" + b"\xff" * 8),
        ("a huge text length", b"\x83\x01\x01\x7b" + b"\x7f" * 8 + b"abc"),
        ("an indefinite array", b"\x9f\x01\xff"),
        ("a reserved length code", b"\x1c"),
        ("invalid UTF-8", b"\x83\x01\x01\x81\x62\xff\xfe"),
        ("truncated", wire([entry_wire()])[:-3]),
        ("trailing bytes", wire([]) + b"\x00"),
        ("empty", b""),
        ("a simple value", b"\xf8\x20"),
        ("undefined", b"\xf7"),
    ],
)
def test_decode_refuses(name: str, data: bytes) -> None:
    assert_rejected(data)


def test_nesting_up_to_the_limit_is_only_a_type_error() -> None:
    nested: Any = []  # with the envelope: MAX_DEPTH arrays
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    with pytest.raises(WireDecodeError, match=r"expected|length"):
        decode_message(wire(nested))


# Hostile input, generated.
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_wire_decode_error(data: bytes) -> None:
    decode_or_reject(data)


cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from([A, B, "", 0, 1, 2, 3, 4, SCHEMA_VERSION]),
    lambda inner: (
        st.lists(inner, max_size=7)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        | st.builds(cbor2.CBORTag, st.sampled_from([1, 2, 4, 30, 37, 258, 260, 999]), inner)
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(cbor_values, st.sampled_from(list(MessageTag)))
def test_random_cbor_structures_only_raise_wire_decode_error(value: Any, tag: MessageTag) -> None:
    decode_or_reject(cbor2.dumps(value))
    decode_or_reject(wire(value, tag))
    decode_or_reject(wire([value], tag))
    decode_or_reject(wire([[1, A, A, 0, 1, value], [4, "i", A, 1, 1, ["i", "m", value]]], tag))
    decode_or_reject(wire([[value, value], value], tag))


@settings(max_examples=200, deadline=None)
@given(states, st.data())
def test_mutated_valid_messages_only_raise_wire_decode_error(
    state: ClusterState, data: st.DataObject
) -> None:
    encoded = bytearray(encode_message(DigestReply(state, state.digest())))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            encoded[position] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del encoded[position:]
            if not encoded:
                break
        else:
            encoded[position:position] = data.draw(st.binary(min_size=1, max_size=9))
    decode_or_reject(bytes(encoded))


def test_a_shape_says_why_it_cannot_be_split_only_when_it_cannot() -> None:
    """Splittable shapes keep the 7 fields older nodes decode; the reason is an 8th when set."""
    from protocol.codec_fields import shape_from_wire, shape_to_wire

    plain = ModelShape.uniform(ModelId("m"), num_layers=2, bytes_per_layer=1, embedding_bytes=1, head_bytes=1)
    assert len(shape_to_wire(plain)) == 7 and shape_from_wire(shape_to_wire(plain)) == plain
    whole = dataclasses.replace(plain, unsplittable="per-layer inputs")
    assert shape_from_wire(shape_to_wire(whole)) == whole
    routed = dataclasses.replace(plain, token_bytes=2)  # a mixture of experts: an 11th field
    assert len(shape_to_wire(routed)) == 11 and shape_from_wire(shape_to_wire(routed)) == routed
    for bad in ([*shape_to_wire(whole), "x"], [*shape_to_wire(plain)[:7], 3]):
        with pytest.raises(WireDecodeError):
            shape_from_wire(bad)
