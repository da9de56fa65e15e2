"""The one length-prefix framer (`protocol/framing.py`) and the shells that read with it."""

from __future__ import annotations

import random
import struct
from typing import cast

import pytest
import trio
from libp2p.abc import INetStream

from node.net.framing import read_frame
from protocol.framing import FrameDecoder, FrameError, encode
from protocol.ids import RequestId
from protocol.runner_wire import Cancel, MessageDecoder, Shutdown, encode_frame

FRAMES = [b"", b"a", bytes(range(256)) + b"tail", b"", b"last"]
CAP = 300
WIRE = b"".join(encode(f, CAP) for f in FRAMES)


def test_round_trip() -> None:
    decoder = FrameDecoder(CAP)
    assert decoder.feed(WIRE) == FRAMES
    assert not decoder.inside_frame
    decoder.end()
    assert WIRE[:4] == struct.pack(">I", 0) and WIRE[4:9] == struct.pack(">I", 1) + b"a"


def test_every_split_into_three_reads_gives_the_same_frames() -> None:
    for i in range(len(WIRE) + 1):
        for j in range(i, len(WIRE) + 1, 7):
            decoder = FrameDecoder(CAP)
            got = decoder.feed(WIRE[:i]) + decoder.feed(WIRE[i:j]) + decoder.feed(WIRE[j:])
            assert got == FRAMES, (i, j)
            decoder.end()


def test_one_byte_at_a_time() -> None:
    decoder = FrameDecoder(CAP)
    got: list[bytearray] = []
    for at in range(len(WIRE)):
        got += decoder.feed(WIRE[at : at + 1])
        assert decoder.inside_frame == (at + 1 not in _frame_ends())
    assert got == FRAMES


def _frame_ends() -> set[int]:
    ends, at = {0}, 0
    for frame in FRAMES:
        at += 4 + len(frame)
        ends.add(at)
    return ends


def test_pull_side_reads_no_byte_past_the_current_part() -> None:
    """`writable` + `advance`, as a socket's recv_into uses them, with random short reads."""
    rng = random.Random(3)
    decoder, got, at = FrameDecoder(CAP), [], 0
    while at < len(WIRE):
        target = decoder.writable()
        assert len(target) == decoder.wanted > 0
        count = min(len(target), rng.randrange(1, 9), len(WIRE) - at)
        target[:count] = WIRE[at : at + count]
        at += count
        if (frame := decoder.advance(count)) is not None:
            got.append(frame)
    assert got == FRAMES
    with pytest.raises(ValueError):
        decoder.advance(decoder.wanted + 1)


def test_a_frame_over_the_cap_is_refused_from_its_prefix() -> None:
    assert FrameDecoder(10).feed(encode(b"x" * 10, 10)) == [b"x" * 10]
    decoder = FrameDecoder(10)
    with pytest.raises(FrameError, match="11 bytes exceeds the 10-byte cap"):
        decoder.feed(struct.pack(">I", 11))  # not one byte of the payload needed
    with pytest.raises(FrameError):
        FrameDecoder(10).feed(struct.pack(">I", 2**32 - 1) + b"x")
    # Sending over the cap is this side's bug, not the peer's: a ValueError that is no FrameError.
    with pytest.raises(ValueError, match="exceeds the 10-byte cap") as local:
        encode(b"x" * 11, 10)
    assert not isinstance(local.value, FrameError)


def test_a_stream_that_ends_inside_a_frame_is_truncated() -> None:
    one = encode(b"hello", CAP)
    for cut in range(1, len(one)):
        decoder = FrameDecoder(CAP)
        assert decoder.feed(one[:cut]) == []
        with pytest.raises(FrameError, match="ended inside a frame"):
            decoder.end()
    decoder = FrameDecoder(CAP)
    decoder.end()  # nothing at all: a clean end
    assert decoder.feed(one) == [b"hello"]
    decoder.end()


def test_runner_messages_across_any_split() -> None:
    wire = encode_frame(Cancel(request_id=RequestId("r1"))) + encode_frame(Shutdown())
    for cut in range(len(wire) + 1):
        decoder = MessageDecoder()
        assert decoder.feed(wire[:cut]) + decoder.feed(wire[cut:]) == [
            Cancel(request_id=RequestId("r1")),
            Shutdown(),
        ]
    with pytest.raises(FrameError, match="undecodable runner message"):
        MessageDecoder().feed(encode(b"\xff\x00", CAP))


class _Stream:
    """What `read_frame` uses of a libp2p stream: `read(n)` returns 1..n bytes, b"" at the end."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    async def read(self, n: int) -> bytes:
        chunk, self.data = self.data[: min(n, self.step)], self.data[min(n, self.step) :]
        return chunk


def _read(data: bytes, step: int, cap: int = CAP) -> tuple[bytes, bytes]:
    stream = _Stream(data, step)
    frame = trio.run(read_frame, cast(INetStream, stream), cap)
    return frame, stream.data


def test_read_frame_stops_at_the_frame_boundary() -> None:
    for step in (1, 3, 1000):
        assert _read(encode(b"request", CAP) + b"answer", step) == (b"request", b"answer")
    with pytest.raises(FrameError, match="ended before a whole frame"):
        _read(encode(b"request", CAP)[:-1], 2)
    with pytest.raises(FrameError, match="cap"):
        _read(encode(b"request", CAP), 1, cap=6)
