"""Length-prefixed frames over a libp2p stream.

`stream.read(n)` returns whatever is buffered (1..n bytes), so a message needs its own boundary:
a 4-byte big-endian length, then that many bytes. A length over the caller's cap is refused before
a single payload byte is read, so a peer cannot make us buffer more than the cap.

Errors are remote errors (the other side sent something wrong or went away): `FrameError` for
bad framing, the TRANSPORT_ERRORS of `quirks` for a dead stream. Callers drop and count them.
"""

from __future__ import annotations

import struct

from libp2p.abc import INetStream

HEADER = struct.Struct(">I")
READ_CHUNK = 64 * 1024
"""Bytes asked for per `read()`: bounds each read's allocation while large frames stream in."""


class FrameError(Exception):
    """The peer broke the framing: a length over the cap, or EOF in the middle of a frame."""


class FrameTooLarge(FrameError):
    pass


class FrameTruncated(FrameError):
    pass


def encode_frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_exactly(stream: INetStream, n: int) -> bytes:
    """Read exactly `n` bytes; `FrameTruncated` if the stream ends first."""
    parts: list[bytes] = []
    left = n
    while left > 0:
        try:
            chunk = await stream.read(min(left, READ_CHUNK))
        except EOFError as exc:  # libp2p's StreamEOF is an EOFError
            raise FrameTruncated(f"stream ended {left} bytes short of {n}") from exc
        if not chunk:
            raise FrameTruncated(f"stream ended {left} bytes short of {n}")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def read_frame(stream: INetStream, max_bytes: int) -> bytes:
    (length,) = HEADER.unpack(await read_exactly(stream, HEADER.size))
    if length > max_bytes:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {max_bytes}-byte cap")
    return await read_exactly(stream, length)


class FrameBuffer:
    """Sans-I/O framing for streams that carry many frames (channels): bytes in, frames out.

    Reading whatever is buffered and splitting it here costs one `read()` (and at most one yamux
    window update) per batch of frames, instead of two reads per frame.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append received bytes; return the frames now complete. FrameTooLarge over the cap."""
        self._data += data
        frames: list[bytes] = []
        while len(self._data) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._data)
            if length > self.max_bytes:
                raise FrameTooLarge(f"frame of {length} bytes exceeds the {self.max_bytes}-byte cap")
            end = HEADER.size + length
            if len(self._data) < end:
                break
            frames.append(bytes(self._data[HEADER.size : end]))
            del self._data[:end]
        return frames

    def end(self) -> None:
        """The stream ended: FrameTruncated if it did so inside a frame."""
        if self._data:
            raise FrameTruncated(f"stream ended inside a frame ({len(self._data)} bytes of it)")


async def write_frame(stream: INetStream, payload: bytes) -> None:
    await stream.write(encode_frame(payload))
