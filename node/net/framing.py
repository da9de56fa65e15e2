"""Frames over a libp2p stream: the short I/O shell around `protocol.framing`.

`stream.read(n)` returns whatever is buffered (1..n bytes), so a message needs the framer's
boundaries. A length over the caller's cap is refused before a single payload byte is read, so a
peer cannot make us buffer more than the cap.

Errors are remote errors (the other side sent something wrong or went away): `FrameError` for
bad framing or a stream that ends too soon, the TRANSPORT_ERRORS of `quirks` for a dead stream.
Callers drop and count them.
"""

from __future__ import annotations

from libp2p.abc import INetStream

from protocol.framing import FrameDecoder, FrameError, encode

READ_CHUNK = 64 * 1024
"""Bytes asked for per `read()`: bounds each read's allocation while large frames stream in."""


async def read_some(stream: INetStream, n: int) -> bytes:
    """Up to `n` bytes; b"" once the stream has ended (libp2p's StreamEOF is an EOFError)."""
    try:
        return await stream.read(n)
    except EOFError:
        return b""


async def read_exactly(stream: INetStream, n: int) -> bytes:
    """Read exactly `n` bytes (fixed-size fields, not frames); `FrameError` if the stream ends first."""
    parts: list[bytes] = []
    left = n
    while left > 0:
        chunk = await read_some(stream, min(left, READ_CHUNK))
        if not chunk:
            raise FrameError(f"stream ended {left} bytes short of {n}")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def read_frame(stream: INetStream, max_bytes: int) -> bytes:
    """The next frame; reads no byte past it, so the stream can carry an answer after it."""
    decoder = FrameDecoder(max_bytes)
    while True:
        chunk = await read_some(stream, min(decoder.wanted, READ_CHUNK))
        if not chunk:
            raise FrameError("stream ended before a whole frame")
        if frames := decoder.feed(chunk):
            return bytes(frames[0])


async def write_frame(stream: INetStream, payload: bytes, max_bytes: int) -> None:
    """Send one frame; ValueError (a local bug) over `max_bytes`."""
    await stream.write(encode(payload, max_bytes))
