"""Length-prefixed frames, sans-I/O: the one framer of every Shoal wire.

A byte stream has no message boundaries (a pipe's `read`, a socket's `recv` and a libp2p stream's
`read` all return whatever has arrived), so each wire sends a frame: a 4-byte big-endian length,
then that many bytes. Used by the runner's pipes (`runner_wire`), the libp2p requests and channels
(`node/net`) and the TCP hops between pipeline stages (`node/pipeline`); each wire passes its own
size cap, a named constant.

`encode` turns a payload into bytes; a `FrameDecoder` turns received bytes into payloads. Neither
touches a stream: the I/O shells around them live in `node/`. A length over the cap is refused
as soon as its 4 bytes are in, so a peer cannot make us buffer more than the cap.
"""

from __future__ import annotations

import struct

PREFIX = struct.Struct(">I")
"""The length before every frame; a frame of more than 4 GiB cannot be said."""


class FrameError(ValueError):
    """The other side sent bytes that are not a valid frame (or not a valid message inside one).

    A remote error: drop the stream or link and count it; it never means a bug on this side.
    """


def prefix(length: int, max_bytes: int) -> bytes:
    """The 4 bytes announcing a `length`-byte payload; ValueError (a local bug) over `max_bytes`."""
    if length > max_bytes:
        raise ValueError(f"frame of {length} bytes exceeds the {max_bytes}-byte cap")
    return PREFIX.pack(length)


def encode(payload: bytes, max_bytes: int) -> bytes:
    """One frame; ValueError (a local bug) when `payload` is over `max_bytes`."""
    return prefix(len(payload), max_bytes) + payload


class FrameDecoder:
    """Bytes in, complete frames out, in order; `FrameError` once the peer breaks the framing.

    Push (`feed`) for shells that read whatever arrived, or pull (`writable` + `advance`) for a
    socket's `recv_into`, which then writes a large frame straight into its final buffer. Each
    frame is a fresh bytearray that the caller owns. After a `FrameError` the stream is lost:
    the shell drops it, it does not feed more.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._prefix = bytearray(PREFIX.size)
        self._body: bytearray | None = None
        """The frame being filled, once its prefix is in; None while the prefix is."""
        self._filled = 0
        """Bytes of the current part (prefix or body) already in."""

    @property
    def wanted(self) -> int:
        """Bytes that complete the current prefix or body. A shell that never reads more than this
        leaves a stream at a frame boundary (a request stream carries one frame, then an answer)."""
        return len(self._body if self._body is not None else self._prefix) - self._filled

    @property
    def inside_frame(self) -> bool:
        """Part of a frame is in: a stream ending now ended mid-frame."""
        return self._body is not None or self._filled > 0

    def writable(self) -> memoryview:
        """Where the next `wanted` bytes go; pass the count written to `advance`."""
        target = self._body if self._body is not None else self._prefix
        return memoryview(target)[self._filled :]

    def advance(self, count: int) -> bytearray | None:
        """`count` more bytes are in `writable()`; the frame they complete, if any."""
        if not 0 <= count <= self.wanted:
            raise ValueError(f"advance({count}) with {self.wanted} bytes wanted")
        self._filled += count
        if self.wanted:
            return None
        if self._body is None:
            (length,) = PREFIX.unpack(self._prefix)
            if length > self.max_bytes:
                raise FrameError(f"frame of {length} bytes exceeds the {self.max_bytes}-byte cap")
            self._body, self._filled = bytearray(length), 0
            if length:
                return None
        frame, self._body, self._filled = self._body, None, 0
        return frame

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray]:
        """Take received bytes; the frames they complete."""
        view = memoryview(data).cast("B")
        frames: list[bytearray] = []
        while view:
            count = min(self.wanted, len(view))
            self.writable()[:count] = view[:count]
            view = view[count:]
            if (frame := self.advance(count)) is not None:
                frames.append(frame)
        return frames

    def end(self) -> None:
        """The stream ended: `FrameError` if it did so inside a frame."""
        if self.inside_frame:
            part = "prefix" if self._body is None else "body"
            raise FrameError(f"stream ended inside a frame ({self.wanted} bytes of its {part} missing)")
