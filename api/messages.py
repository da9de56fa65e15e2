"""Claude Messages: `POST /v1/messages` (streamed and not) and `POST /v1/messages/count_tokens`.

A handler validates the body (`api.messages_schema`), builds a `GenerateRequest`
(`api.messages_request`) and hands it to `api.streaming` with the Messages encoder or collector
(`api.messages_encode`); every error answers in Anthropic's shape. The `x-api-key`,
`anthropic-version` and `anthropic-beta` headers are accepted and not checked (no API auth yet).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend
from api.messages_encode import ANTHROPIC, MessagesCollector, MessagesEncoder, TokenCounter
from api.messages_request import to_generate_request
from api.messages_schema import parse_count_request, parse_messages_request
from api.streaming import EventStream, collect
from api.surface import CLIENT_GONE, Limits, read_body, require_model, surface_route
from protocol.ids import new_request_id

MESSAGE_ID_PREFIX = "msg_"


class MessagesRoutes:
    def __init__(self, backend: Backend, limits: Limits) -> None:
        self._backend = backend
        self._limits = limits

    def routes(self) -> list[Route]:
        return [
            surface_route(ANTHROPIC, "/v1/messages", self.create, methods=["POST"]),
            surface_route(ANTHROPIC, "/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def create(self, request: Request) -> Response:
        body = parse_messages_request(await read_body(request, self._limits.max_body_bytes))
        require_model(self._backend, body.model)
        generate = to_generate_request(body, new_request_id(MESSAGE_ID_PREFIX))
        if body.stream:
            encoder = MessagesEncoder(generate.request_id, body.model, show_thinking=body.shows_thinking)
            return EventStream(
                self._backend, generate, encoder, surface=ANTHROPIC, keepalive_s=self._limits.keepalive_s
            )
        collector = MessagesCollector(generate.request_id, body.model, show_thinking=body.shows_thinking)
        if not await collect(self._backend, generate, request.receive, collector.feed):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(collector.result())

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, counted by the runner on the generation path (`count_only`)."""
        body = parse_count_request(await read_body(request, self._limits.max_body_bytes))
        require_model(self._backend, body.model)
        generate = to_generate_request(body, new_request_id(MESSAGE_ID_PREFIX), count_only=True)
        counter = TokenCounter()
        if not await collect(self._backend, generate, request.receive, counter.feed):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(counter.result())
