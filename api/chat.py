"""`POST /v1/chat/completions` (streamed and not) and `POST /v1/cancel/{request_id}`.

A handler validates the body, builds a `GenerateRequest` and opens the backend's stream. Whatever ends
the request (the last event, the client hanging up, an error) leaves `Backend.open_stream`'s context,
which is how the backend learns to cancel a generation nobody waits for any more.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from api import sse
from api.backend import Backend
from api.completions import CompletionCollector, StreamEncoder
from api.errors import ApiError, from_generation_error
from api.schemas import parse_chat_request, to_generate_request
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, GenerationError
from protocol.ids import RequestId, new_request_id

CLIENT_GONE = 499
"""Status for a response nobody will read (nginx's "client closed request"); never reaches the wire."""


async def _pump(events: AsyncIterator[ChunkEvent], into: trio.MemorySendChannel[ChunkEvent]) -> None:
    """Move the backend's events into a channel, so that waiting for one can time out safely.

    Cancelling a wait on an async generator would kill it; cancelling `MemoryReceiveChannel.receive`
    loses nothing. This lets backends hand out any async iterator.
    """
    async with into:
        async for event in events:
            await into.send(event)


async def _receive(events: trio.MemoryReceiveChannel[ChunkEvent]) -> ChunkEvent | None:
    try:
        return await events.receive()
    except trio.EndOfChannel:
        return None


class ChatStream(Response):
    """The ASGI response of a streamed completion.

    It opens the backend's stream itself and waits for the first event before it commits to a status:
    a `GenerationError` there becomes a plain JSON error (400 for an invalid request, 429 when the
    model's request queue is full), anything else a 200 `text/event-stream`. A comment goes out for
    every `keepalive_s` without an event. When the client disconnects, everything is cancelled and
    the backend's context exits.
    """

    media_type = sse.MEDIA_TYPE

    def __init__(
        self, backend: Backend, request: GenerateRequest, encoder: StreamEncoder, *, keepalive_s: float
    ) -> None:
        self.status_code = 200
        self.init_headers(sse.HEADERS)  # no `body` attribute: no content-length
        self._backend = backend
        self._request = request
        self._encoder = encoder
        self._keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with (
            sse.cancel_on_disconnect(receive),
            self._backend.open_stream(self._request) as events,
            trio.open_nursery() as nursery,
        ):
            into, received = trio.open_memory_channel[ChunkEvent](0)
            nursery.start_soon(_pump, events, into)
            await self._respond(received, scope, receive, send)
            nursery.cancel_scope.cancel()

    async def _respond(
        self, events: trio.MemoryReceiveChannel[ChunkEvent], scope: Scope, receive: Receive, send: Send
    ) -> None:
        event = await _receive(events)
        if isinstance(event, GenerationError):
            await from_generation_error(event).response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await self._send_body(send, self._encoder.start())
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
        """The next event (None once they ended), with a keep-alive comment for every quiet interval."""
        while True:
            with trio.move_on_after(self._keepalive_s):
                return await _receive(events)
            await self._send_body(send, sse.KEEP_ALIVE)

    @staticmethod
    async def _send_body(send: Send, frames: bytes) -> None:
        await send({"type": "http.response.body", "body": frames, "more_body": True})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `limit` bytes.

    (Starlette's `max_body_size` answers in plain text, not in our error shape.)
    """
    too_large = ApiError(413, f"The request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


class ChatRoutes:
    def __init__(self, backend: Backend, *, keepalive_s: float, max_body_bytes: int) -> None:
        self._backend = backend
        self._keepalive_s = keepalive_s
        self._max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/v1/cancel/{request_id}", self.cancel, methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        body = parse_chat_request(await read_body(request, self._max_body_bytes))
        if body.model not in {card.id for card in self._backend.models()}:
            raise ApiError(
                404,
                f"The model '{body.model}' does not exist or is not served here",
                param="model",
                code="model_not_found",
            )
        generate = to_generate_request(body, new_request_id())
        created = int(time.time())
        if body.stream:
            encoder = StreamEncoder(
                generate.request_id, body.model, created, include_usage=body.include_usage
            )
            return ChatStream(self._backend, generate, encoder, keepalive_s=self._keepalive_s)
        collector = CompletionCollector(generate.request_id, body.model, created)
        finished = False
        async with sse.cancel_on_disconnect(request.receive), self._backend.open_stream(generate) as events:
            async for event in events:
                collector.feed(event)
            finished = True
        if not finished:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(collector.result())

    async def cancel(self, request: Request) -> Response:
        request_id = RequestId(request.path_params["request_id"])
        if not await self._backend.cancel(request_id):
            raise ApiError(
                404, f"No request '{request_id}' is in flight", param="request_id", code="request_not_found"
            )
        return JSONResponse({"id": request_id, "cancelled": True})
