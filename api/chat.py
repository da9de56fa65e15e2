"""`POST /v1/chat/completions` (streamed and not) and `POST /v1/cancel/{request_id}`.

A handler validates the body, builds a `GenerateRequest` and hands it to `api.streaming` with the
chat-completion encoder (`api.completions`).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend
from api.completions import ChatCollector, ChatEncoder
from api.errors import ApiError
from api.schemas import parse_chat_request, to_generate_request
from api.streaming import EventStream, collect
from api.surface import CLIENT_GONE, OPENAI, Limits, read_body, require_model
from protocol.ids import RequestId, new_request_id


class ChatRoutes:
    def __init__(self, backend: Backend, limits: Limits) -> None:
        self._backend = backend
        self._limits = limits

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/v1/cancel/{request_id}", self.cancel, methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        body = parse_chat_request(await read_body(request, self._limits.max_body_bytes))
        require_model(self._backend, body.model)
        generate = to_generate_request(body, new_request_id("chatcmpl-"))
        created = int(time.time())
        if body.stream:
            encoder = ChatEncoder(generate.request_id, body.model, created, include_usage=body.include_usage)
            return EventStream(
                self._backend, generate, encoder, surface=OPENAI, keepalive_s=self._limits.keepalive_s
            )
        collector = ChatCollector(generate.request_id, body.model, created)
        if not await collect(self._backend, generate, request.receive, collector.feed):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(collector.result())

    async def cancel(self, request: Request) -> Response:
        request_id = RequestId(request.path_params["request_id"])
        if not await self._backend.cancel(request_id):
            raise ApiError(
                404, f"No request '{request_id}' is in flight", param="request_id", code="request_not_found"
            )
        return JSONResponse({"id": request_id, "cancelled": True})
