"""The hop between stages: pipeline frames as bytes, and the links that carry them over TCP."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import mlx.core as mx
import pytest

from node.pipeline.frames import HEADER_BYTES, MAX_FRAME_BYTES, Frame, Kind, decode_frame, encode_frame
from node.pipeline.hop import HopError, InLink, OutLink
from protocol.framing import FrameError


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int32])
def test_frames_round_trip(dtype: mx.Dtype) -> None:
    tensor = (mx.random.normal((1, 3, 8)) * 100).astype(dtype)
    frame = Frame(
        Kind.PREFILL, request=2**40 + 3, position=17, tensor=tensor[:, ::2, :], meta={"a": [1, "b"]}
    )
    wire = b"".join(bytes(part) for part in encode_frame(frame))
    back = decode_frame(wire[4:])
    assert int.from_bytes(wire[:4], "big") == len(wire) - 4
    assert (back.kind, back.request, back.position, dict(back.meta)) == (
        Kind.PREFILL,
        2**40 + 3,
        17,
        {"a": [1, "b"]},
    )
    assert back.tensor is not None and back.tensor.dtype == dtype
    assert mx.array_equal(back.tensor, tensor[:, ::2, :]).item()
    bare = b"".join(bytes(part) for part in encode_frame(Frame(Kind.RESET, request=5)))
    assert decode_frame(bare[4:]) == Frame(Kind.RESET, request=5)


def test_garbage_is_a_frame_error() -> None:
    good = b"".join(bytes(p) for p in encode_frame(Frame(Kind.TOKEN, 1, 0, mx.array([7], dtype=mx.int32))))[
        4:
    ]
    for bad in [b"XX" + good[2:], good[:-1], good + b"\0", good[:5]]:
        with pytest.raises(FrameError):
            decode_frame(bad)


# --- the links ------------------------------------------------------------------------------


def _wire(frame: Frame) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(frame))


@pytest.fixture
def inlink() -> Iterator[tuple[socket.socket, InLink]]:
    """An InLink reading what the test writes to the other end of a socket pair."""
    ours, theirs = socket.socketpair()
    link = InLink(theirs, name="peer", timeout=5.0)
    try:
        yield ours, link
    finally:
        link.close()
        ours.close()


def test_a_link_reassembles_frames_sent_byte_by_byte(inlink: tuple[socket.socket, InLink]) -> None:
    sock, link = inlink
    frames = [
        Frame(Kind.HEARTBEAT),
        Frame(Kind.TOKEN, 3, 9, mx.array([7], dtype=mx.int32)),
        Frame(Kind.RESET, 3),
    ]
    for byte in b"".join(_wire(f) for f in frames):
        sock.sendall(bytes([byte]))
    token = link.recv(timeout=5)
    assert token is not None and (token.kind, token.request, token.position) == (Kind.TOKEN, 3, 9)
    assert token.tensor is not None and token.tensor.tolist() == [7]
    assert link.recv(timeout=5) == Frame(Kind.RESET, 3)  # the heartbeat was consumed, not delivered
    sock.close()
    with pytest.raises(HopError, match="closed the link"):
        link.recv(timeout=5)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # Refused from the prefix alone: no 1 GiB buffer, no waiting for the body (or the timeout).
        (struct.pack(">I", MAX_FRAME_BYTES + 1), "broke the framing: frame of"),
        (struct.pack(">I", 3) + b"abc", "shorter than a header"),
        (struct.pack(">I", HEADER_BYTES) + b"XX" + bytes(HEADER_BYTES - 2), "sent a bad frame"),
    ],
    ids=["over-the-cap", "too-short", "not-a-pipeline-frame"],
)
def test_a_broken_frame_fails_the_link_for_good(
    inlink: tuple[socket.socket, InLink], data: bytes, why: str
) -> None:
    sock, link = inlink
    sock.sendall(data)
    for _ in range(2):
        with pytest.raises(HopError, match=why):
            link.recv(timeout=5)


def test_a_tensor_crosses_a_link_whole() -> None:
    a, b = socket.socketpair()
    out = OutLink(a, name="next", heartbeat_interval=0.02)
    link = InLink(b, name="previous", timeout=5.0)
    try:
        tensor = mx.random.normal((1, 64, 4096))  # 1 MiB: many reads into one buffer
        out.send(Frame(Kind.PREFILL, 1, 0, tensor))
        got = link.recv(timeout=5)
        assert got is not None and got.kind == Kind.PREFILL and got.tensor is not None
        assert mx.array_equal(got.tensor, tensor).item()
    finally:
        out.close()
        link.close()


def test_silence_fails_a_link_and_heartbeats_keep_a_quiet_one_open() -> None:
    """A neighbour that sends nothing for the link's timeout is frozen or cut off (the error the
    request then reports); one whose OutLink only heartbeats is alive, however long it is quiet.
    (The 3 s default in a real pipeline: tests/test_pipeline_instances.py freezes a node.)"""
    quiet, quiet_peer = socket.socketpair()
    silent, silent_peer = socket.socketpair()
    out = OutLink(quiet, name="next", heartbeat_interval=0.02)
    alive = InLink(quiet_peer, name="quiet stage", timeout=0.5)
    frozen = InLink(silent_peer, name="frozen stage", timeout=0.5)
    try:
        with pytest.raises(HopError, match=r"nothing from frozen stage for 0\.5s: frozen or cut off"):
            frozen.recv(timeout=10)  # the bound on the test, not the claim
        assert alive.recv(timeout=1.0) is None  # twice the timeout of heartbeats only: no error
        out.send(Frame(Kind.RESET, 7))
        assert alive.recv(timeout=5) == Frame(Kind.RESET, 7)
    finally:
        out.close()
        for link in (alive, frozen):
            link.close()
        silent.close()
