"""Streaming channels: many length-prefixed frames, both ways, over one authenticated libp2p stream.

`Mesh.open_channel(peer_id, protocol)` opens one to a peer; `Mesh.set_channel_handler(protocol,
handler)` serves them (only authenticated peers reach the handler, as with requests). A channel
moves bytes: what the frames mean is the protocol's business (e.g. `protocol/generate_wire.py`).

- `await channel.send(payload)`: one frame (4-byte length + payload); a payload over the cap
  raises ValueError (a local bug), a dead stream `ChannelError`.
- `await channel.receive(idle_timeout_s=...)`: the next frame. A frame announced over the cap, EOF
  inside a frame or a broken stream raise `ChannelError`; the end of the stream between two frames
  raises `ChannelClosed`; no frame within `idle_timeout_s` raises `ChannelTimeout`, and the
  channel stays usable: nothing is lost or torn. py-libp2p 0.8.1 reads a peer's reset and a lost
  connection as a plain end of stream (yamux drops the stream's entry, `read` raises EOF), so
  `ChannelClosed` does not prove a clean end: a protocol that must know marks its last frame
  itself (as the generate protocol's terminal event does).
- `await channel.aclose()`: half-close our side (the peer reads every frame we sent, then the
  end) and stop receiving. `await channel.reset()`: abort both directions now. Both are
  idempotent, never raise, and do their I/O even inside a cancelled scope (bounded by
  `CLOSE_TIMEOUT_S`). `async with channel:` closes on a normal exit and resets on an exception.

A peer process that dies fails the next `receive()` at once (SIGKILL on loopback: ~25 ms); a
peer that freezes (connection open, nothing sent) is noticed only by the caller's idle timeout, or
after ~3-4 s when py-libp2p's ping monitor drops the connection (`quirks.connection_config`).

Why a read-ahead task: cancelling py-libp2p's `stream.read()` can drop bytes it already took from
its buffer (yamux `read` awaits a window update after taking them), so a timed-out read would
tear a frame. One task per channel (in the mesh's nursery, or the handler's) reads whatever has
arrived, splits it into frames (`protocol.framing.FrameDecoder`) and queues them; `receive()` waits on that
queue, which is cancel-safe. When the queue is full the task stops reading, and yamux's flow
control slows the sender. One read (and at most one yamux window update) per batch of frames,
rather than two reads per frame, cut a small frame's cost from ~1.5 to ~0.6 ms (both ends in
one process).

Cancelling a send (or closing the channel, which cancels the read-ahead) is safe for the
connection only because `Mesh` shields py-libp2p's frame writes (`quirks.shield_frame_writes`). A
send cancelled midway through a frame tears the channel's framing: the channel then refuses to
send more, and `aclose()` resets it instead.
"""

from __future__ import annotations

import math
from types import TracebackType

import trio
from libp2p.abc import INetStream

from node.net import quirks
from node.net.framing import READ_CHUNK
from protocol.framing import FrameDecoder, FrameError, encode

RECEIVE_BUFFER_FRAMES = 8
"""Frames queued ahead of `receive()` (plus those of the last read, up to 64 KiB of them); beyond
that the read-ahead stops and yamux flow control holds the sender back."""
CLOSE_TIMEOUT_S = 1.0
"""`aclose()`/`reset()` write one small yamux frame; a frozen connection must not hold them up."""


class ChannelError(Exception):
    """The channel broke: reset, connection lost, framing broken, or closed (see the subclasses)."""


class ChannelClosed(ChannelError):
    """The peer ended its side cleanly after its last frame (or we closed the channel)."""


class ChannelTimeout(ChannelError):
    """`receive()` got no frame within its idle timeout; the channel itself is still usable."""


class Channel:
    """One stream of frames to or from `peer_id` on `protocol`; made by `Mesh`, not by hand."""

    def __init__(self, stream: INetStream, peer_id: str, protocol: str, max_frame_bytes: int) -> None:
        self.peer_id = peer_id
        self.protocol = protocol
        self.max_frame_bytes = max_frame_bytes
        self._stream = stream
        self._frames_in, self._frames = trio.open_memory_channel[bytes](RECEIVE_BUFFER_FRAMES)
        self._end: tuple[type[ChannelError], str] | None = None
        """Why the read-ahead stopped (set before it closes `_frames_in`)."""
        self._reader_scope = trio.CancelScope()
        self._send_lock = trio.Lock()
        self._send_torn = False
        """A send was interrupted mid-frame: the peer's framing is broken, nothing more may follow."""
        self._closed = False

    def start_reading(self, nursery: trio.Nursery) -> None:
        """Start the read-ahead task; `Mesh` calls this once, with a nursery that outlives the channel."""
        nursery.start_soon(self._read_ahead)

    async def _read_ahead(self) -> None:
        async with self._frames_in:
            with self._reader_scope:
                frames = FrameDecoder(self.max_frame_bytes)
                try:
                    while True:
                        try:
                            data = await self._stream.read(READ_CHUNK)
                        except EOFError:  # libp2p's StreamEOF: closed, reset or lost (see above)
                            data = b""
                        if not data:
                            frames.end()
                            break
                        for frame in frames.feed(data):
                            await self._frames_in.send(bytes(frame))
                    self._end = (
                        ChannelClosed,
                        f"the channel to {self.peer_id} ended (closed, reset or lost)",
                    )
                except FrameError as exc:
                    self._end = (ChannelError, f"{self.peer_id} broke the framing: {exc}")
                except quirks.TRANSPORT_ERRORS as exc:
                    self._end = (ChannelError, f"the channel to {self.peer_id} broke: {exc!r}")
            if self._end is None:
                self._end = (ChannelClosed, "the channel was closed on this side")

    # --- data ------------------------------------------------------------------------------------
    async def send(self, payload: bytes) -> None:
        """Send one frame. ValueError over `max_frame_bytes`; ChannelError if the stream is dead."""
        frame = encode(payload, self.max_frame_bytes)
        async with self._send_lock:
            if self._closed:
                raise ChannelClosed("the channel was closed on this side")
            if self._send_torn:
                raise ChannelError("an earlier send was interrupted mid-frame")
            self._send_torn = True
            try:
                await self._stream.write(frame)
            except quirks.TRANSPORT_ERRORS as exc:
                raise ChannelError(f"sending to {self.peer_id} failed: {exc!r}") from exc
            self._send_torn = False

    async def receive(self, idle_timeout_s: float | None = None) -> bytes:
        """The next frame; ChannelTimeout when none arrives within `idle_timeout_s` (None: wait)."""
        with trio.move_on_after(math.inf if idle_timeout_s is None else idle_timeout_s):
            try:
                return await self._frames.receive()
            except trio.EndOfChannel:
                kind, message = self._end or (ChannelError, "the channel ended")
                raise kind(message) from None
            except trio.ClosedResourceError:
                raise ChannelClosed("the channel was closed on this side") from None
        raise ChannelTimeout(f"nothing from {self.peer_id} for {idle_timeout_s:.1f} s")

    # --- the end ---------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Half-close our side after the frames already sent, and stop receiving. Never raises."""
        if self._closed:
            return
        self._closed = True
        self._reader_scope.cancel()
        self._frames.close()
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            if self._send_torn:  # the peer would read a torn frame: abort instead
                await quirks.reset_quietly(self._stream)
            else:
                await quirks.close_quietly(self._stream)

    async def reset(self) -> None:
        """Abort both directions now; the peer's next `receive()` raises ChannelError. Never raises."""
        already = self._closed
        self._closed = True
        self._reader_scope.cancel()
        self._frames.close()
        if not already:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await quirks.reset_quietly(self._stream)

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            await self.aclose()
        else:
            await self.reset()
