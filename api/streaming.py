"""Moving the backend's events to a client: one streaming response class and one collector.

Every surface hands `EventStream` an `EventEncoder` (sans-I/O: events in, bytes out) and gets the
same behaviour. The status waits for the first event, but at most one `keepalive_s`: an error that
comes sooner answers as a plain error in the surface's shape (400, 429 or 503); a generation that has
not begun by then (its model still loading, a runner restarting) gets the 200 and the stream's
opening, so that the client and the proxies between keep the connection, and an error after that goes
out as the surface's in-stream error event, as one mid-stream does. Every `keepalive_s` without a
byte sent gets the encoder's keep-alive frame, and a client that hangs up cancels the generation,
even one still waiting to begin. `collect` does the same for answers that are one JSON object
(they just wait). Whatever ends the request leaves the context of `Backend.open_stream`, which is how
the backend learns to cancel a generation nobody waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api import sse
from api.backend import Backend
from api.errors import from_generation_error
from api.surface import Surface
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, GenerationError


class EventEncoder(Protocol):
    """One streamed answer in a surface's format: `start()`, then `feed()` each event until `done`."""

    @property
    def done(self) -> bool:
        """True once the stream's last frame was returned; feed nothing more."""
        ...

    def start(self) -> bytes: ...

    def feed(self, event: ChunkEvent) -> bytes: ...

    def broken_off(self) -> bytes:
        """The backend's events ended without a terminal event: close the stream with an error."""
        ...

    def keep_alive(self) -> bytes:
        """A frame for a stream that sent nothing for `keepalive_s` (a long prompt being read, or
        events the encoder leaves out), which the surface's clients skip."""
        ...


async def _pump(backend: Backend, request: GenerateRequest, into: trio.MemorySendChannel[ChunkEvent]) -> None:
    """Run the generation and move its events into a channel, all in this one task.

    Entering `open_stream` may take long (a model still loading): here it does not hold up the
    response, which watches the channel with a timeout and sends keep-alives meanwhile. Cancelling a
    wait on an async generator would kill it; cancelling `MemoryReceiveChannel.receive` loses
    nothing. This lets backends hand out any async iterator.
    """
    async with into, backend.open_stream(request) as events:
        async for event in events:
            await into.send(event)


async def _receive(events: trio.MemoryReceiveChannel[ChunkEvent]) -> ChunkEvent | None:
    try:
        return await events.receive()
    except trio.EndOfChannel:
        return None


class EventStream(Response):
    """The ASGI response of a streamed answer, in `surface`'s format as `encoder` writes it."""

    def __init__(
        self,
        backend: Backend,
        request: GenerateRequest,
        encoder: EventEncoder,
        *,
        surface: Surface,
        keepalive_s: float,
    ) -> None:
        self.status_code = 200
        self.media_type = surface.media_type
        self.init_headers(surface.stream_headers)  # no `body` attribute: no content-length
        self._backend = backend
        self._request = request
        self._encoder = encoder
        self._surface = surface
        self._keepalive_s = keepalive_s
        self._last_sent = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with sse.cancel_on_disconnect(receive), trio.open_nursery() as nursery:
            into, received = trio.open_memory_channel[ChunkEvent](0)
            nursery.start_soon(_pump, self._backend, self._request, into)
            await self._respond(received, scope, receive, send)
            nursery.cancel_scope.cancel()

    async def _respond(
        self, events: trio.MemoryReceiveChannel[ChunkEvent], scope: Scope, receive: Receive, send: Send
    ) -> None:
        event: ChunkEvent | None = None
        with trio.move_on_after(self._keepalive_s) as quiet:
            event = await _receive(events)
        if isinstance(event, GenerationError):  # before any byte went out: the status says it
            error = self._surface.error_response(from_generation_error(event))
            await error(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._last_sent = trio.current_time()
        await self._send_body(send, self._encoder.start())
        if quiet.cancelled_caught:  # committed before the generation began: keep the client waiting
            await self._send_body(send, self._encoder.keep_alive())
            event = await self._receive_or_keep_alive(events, send)
        while True:
            frames = self._encoder.broken_off() if event is None else self._encoder.feed(event)
            await self._send_body(send, frames)
            if self._encoder.done:
                break
            event = await self._receive_or_keep_alive(events, send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _receive_or_keep_alive(
        self, events: trio.MemoryReceiveChannel[ChunkEvent], send: Send
    ) -> ChunkEvent | None:
        """The next event (None once they ended), with a keep-alive frame for every quiet interval."""
        while True:
            with trio.move_on_at(self._last_sent + self._keepalive_s):
                return await _receive(events)
            await self._send_body(send, self._encoder.keep_alive())

    async def _send_body(self, send: Send, frames: bytes) -> None:
        """Send `frames` unless empty; the quiet interval counts from the last bytes sent."""
        if frames:
            await send({"type": "http.response.body", "body": frames, "more_body": True})
            self._last_sent = trio.current_time()


async def collect(
    backend: Backend, request: GenerateRequest, receive: Receive, feed: Callable[[ChunkEvent], None]
) -> bool:
    """Run a generation to its end, handing each event to `feed`; False if the client hung up first.

    Use it once the request body was read (it watches `receive` for the disconnect).
    """
    finished = False
    async with sse.cancel_on_disconnect(receive), backend.open_stream(request) as events:
        async for event in events:
            feed(event)
        finished = True
    return finished
