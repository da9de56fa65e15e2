"""Stage links admit only members of the instance (`node.pipeline.link_auth`, `gate`): real TCP on
127.0.0.1, real handshakes, real AES-GCM; a stranger neither gets in, nor holds the door, nor is
dialed with anything to read."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from node.pipeline.frames import Frame, Kind, encode_frame
from node.pipeline.gate import Gate
from node.pipeline.hop import HopError, InLink, OutLink, dial_member, listen
from node.pipeline.link_auth import (
    AUTH_TIMEOUT,
    LINK_ENV,
    OPEN,
    LinkSecurity,
    stage_links,
)
from node.runner.supervisor import child_environment
from protocol.ids import ModelId
from protocol.runner_wire import RunnerSpec

CLUSTER_KEY = bytes(range(32))
MEMBER = LinkSecurity.for_instance(CLUSTER_KEY, "i-1", sealed=True)
BOUNDARY = 3
"""The layer where the link cuts the model: the dialer's end, the acceptor's start."""


@pytest.fixture
def gate() -> Iterator[tuple[Gate, tuple[str, int]]]:
    listener = listen("127.0.0.1", 0)
    door = Gate(listener, MEMBER, boundary=BOUNDARY, name="stage[3,6)")
    try:
        yield door, listener.getsockname()[:2]
    finally:
        door.close()
        listener.close()


def _wire(frame: Frame) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(frame))


def test_link_keys_are_per_instance_and_travel_in_the_environment() -> None:
    other_instance = LinkSecurity.for_instance(CLUSTER_KEY, "i-2", sealed=True)
    assert MEMBER.key != other_instance.key != OPEN.key
    encoded = stage_links(CLUSTER_KEY, b"a secret")("i-1")
    assert LinkSecurity.from_env({LINK_ENV: encoded}) == MEMBER
    assert not LinkSecurity.from_env({LINK_ENV: stage_links(CLUSTER_KEY, None)("i-1")}).sealed
    assert LinkSecurity.from_env({}) == OPEN
    spec = RunnerSpec(ModelId("m"), Path("/m"), stage_link=encoded)
    assert child_environment(spec)[LINK_ENV] == encoded and MEMBER.key.hex() not in repr(spec)
    with pytest.raises(ValueError, match=LINK_ENV):
        LinkSecurity.from_env({LINK_ENV: "sealed:abc"})


def test_members_link_and_sealed_frames_cross_whole(gate: tuple[Gate, tuple[str, int]]) -> None:
    door, address = gate
    sock, sealer = dial_member(address, MEMBER, BOUNDARY, timeout=5)
    admitted = door.admitted(5)
    assert admitted is not None and sealer is not None and admitted[1] is not None
    inbound = InLink(admitted[0], name="previous stage", cipher=admitted[1], timeout=5)
    outbound = OutLink(sock, name="next stage", cipher=sealer, heartbeat_interval=0.05)
    try:
        hidden = mx.random.normal((1, 7, 64))
        outbound.send(Frame(Kind.PREFILL, 9, 0, hidden, {"route": ["10.0.0.2:7000"]}))
        time.sleep(0.2)  # heartbeats, sealed too, go by in between
        outbound.send(Frame(Kind.RESET, 9))
        got = inbound.recv(timeout=5)
        assert got is not None and got.tensor is not None and dict(got.meta) == {"route": ["10.0.0.2:7000"]}
        assert mx.array_equal(got.tensor, hidden).item()
        assert inbound.recv(timeout=5) == Frame(Kind.RESET, 9)
    finally:
        outbound.close()
        inbound.close()


def test_a_sealed_link_refuses_an_altered_frame(gate: tuple[Gate, tuple[str, int]]) -> None:
    """Bytes written by someone on the path (here: after the handshake, straight on the socket)
    fail to open: the link breaks instead of delivering them."""
    door, address = gate
    sock, _sealer = dial_member(address, MEMBER, BOUNDARY, timeout=5)
    admitted = door.admitted(5)
    assert admitted is not None
    inbound = InLink(admitted[0], name="previous stage", cipher=admitted[1], timeout=5)
    try:
        sock.sendall(_wire(Frame(Kind.RESET, 1)))  # a frame in the clear, as a stranger would
        with pytest.raises(HopError, match="failed authentication"):
            inbound.recv(timeout=5)
    finally:
        inbound.close()
        sock.close()


@pytest.mark.parametrize(
    ("security", "boundary", "refusal"),
    [
        (LinkSecurity.for_instance(b"another cluster key" * 2, "i-1", sealed=True), BOUNDARY, "link key"),
        (LinkSecurity.for_instance(CLUSTER_KEY, "i-2", sealed=True), BOUNDARY, "link key"),
        (OPEN, BOUNDARY, "link key"),
        (MEMBER, BOUNDARY + 1, "ends at layer 4, this side starts at 3"),
    ],
    ids=["other-cluster", "other-instance", "no-key", "other-layers"],
)
def test_who_cannot_prove_the_key_for_this_place_is_refused(
    gate: tuple[Gate, tuple[str, int]],
    security: LinkSecurity,
    boundary: int,
    refusal: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    door, address = gate
    with pytest.raises(HopError, match=r"closed during the handshake|link key"):
        dial_member(address, security, boundary, timeout=5)
    assert door.admitted(0.3) is None
    deadline = time.monotonic() + 5
    while refusal not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "refused a connection" in caplog.text and refusal in caplog.text


def test_a_member_is_not_dialed_into_a_strangers_listener() -> None:
    """A route naming a stranger's address: the stranger cannot prove the key, so nothing is sent."""
    stranger = listen("127.0.0.1", 0)
    received: list[bytes] = []

    def pretend() -> None:
        conn, _ = stranger.accept()
        with conn:
            conn.sendall(b"SHL\x01" + bytes(32))  # looks like a stage, cannot answer the proof
            conn.settimeout(5)
            while chunk := conn.recv(1 << 16):
                received.append(chunk)
                if sum(map(len, received)) == 32 + 4 + 32:
                    conn.sendall(bytes(32))  # a guess at the proof

    thread = threading.Thread(target=pretend, daemon=True)
    thread.start()
    try:
        with pytest.raises(HopError, match="does not know this instance's link key"):
            dial_member(stranger.getsockname()[:2], MEMBER, BOUNDARY, timeout=5)
        thread.join(AUTH_TIMEOUT + 5)
        # It saw our proof (bound to its nonce: useless elsewhere), never a frame.
        assert sum(map(len, received)) == 32 + 4 + 32
    finally:
        stranger.close()


def test_a_silent_or_chattering_stranger_never_holds_the_door(gate: tuple[Gate, tuple[str, int]]) -> None:
    """Strangers connect first and stay (one silent, one sending a well-formed HELLO in the clear):
    a member connecting after them is admitted at once, and they are dropped by the deadline."""
    door, address = gate
    silent = socket.create_connection(address)
    chatty = socket.create_connection(address)
    chatty.sendall(_wire(Frame(Kind.HELLO, meta={"layer": BOUNDARY, "route": ["127.0.0.1:9"]})))
    started = time.monotonic()
    sock, _ = dial_member(address, MEMBER, BOUNDARY, timeout=5)
    admitted = door.admitted(5)
    try:
        assert admitted is not None and time.monotonic() - started < AUTH_TIMEOUT
        for stranger in (silent, chatty):
            stranger.settimeout(AUTH_TIMEOUT + 5)
            assert stranger.recv(64)[:4] == b"SHL\x01"  # the challenge, then nothing but the close
            with contextlib.suppress(ConnectionResetError):  # closed with its HELLO's tail unread
                assert stranger.recv(64) == b""
        assert door.admitted(0.2) is None
    finally:
        for s in (silent, chatty, sock, *(admitted[:1] if admitted else ())):
            s.close()
