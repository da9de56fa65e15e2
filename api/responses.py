"""OpenAI Responses: `POST /v1/responses` (streamed and not) and `POST /v1/responses/input_tokens`.

A handler validates the body (`api.responses_schema`), builds the `GenerateRequest`
(`api.responses_input`) and hands it to `api.streaming` with the Responses encoder or collector
(`api.responses_encode`). Nothing is stored: a response id names the request in flight, which
`POST /v1/cancel/{id}` stops, and nothing after it ends.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend
from api.responses_encode import RESPONSES, ResponsesCollector, ResponsesEncoder, failure
from api.responses_input import to_generate_request
from api.responses_output import ResponseAssembler
from api.responses_schema import ResponsesRequest, parse_responses_request
from api.streaming import EventStream, collect
from api.surface import CLIENT_GONE, Limits, read_body, require_model, surface_route
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, Finish
from protocol.ids import new_request_id


class ResponsesRoutes:
    def __init__(self, backend: Backend, limits: Limits) -> None:
        self._backend = backend
        self._limits = limits

    def routes(self) -> list[Route]:
        return [
            surface_route(RESPONSES, "/v1/responses", self.create, methods=["POST"]),
            surface_route(RESPONSES, "/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
        ]

    async def _request(
        self, request: Request, *, count_only: bool
    ) -> tuple[ResponsesRequest, GenerateRequest]:
        body = parse_responses_request(await read_body(request, self._limits.max_body_bytes))
        require_model(self._backend, body.model)
        return body, to_generate_request(body, new_request_id("resp_"), count_only=count_only)

    async def create(self, request: Request) -> Response:
        body, generate = await self._request(request, count_only=False)
        assembler = ResponseAssembler(generate.request_id, body.model, int(time.time()), body.echo())
        if body.stream:
            encoder = ResponsesEncoder(assembler)
            return EventStream(
                self._backend, generate, encoder, surface=RESPONSES, keepalive_s=self._limits.keepalive_s
            )
        collector = ResponsesCollector(assembler)
        if not await collect(self._backend, generate, request.receive, collector.feed):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(collector.result())

    async def input_tokens(self, request: Request) -> Response:
        """The prompt's token count, through the same path a generation takes (`count_only`)."""
        _, generate = await self._request(request, count_only=True)
        last: list[ChunkEvent] = []

        def keep(event: ChunkEvent) -> None:
            last[:] = [event]

        if not await collect(self._backend, generate, request.receive, keep):
            return Response(status_code=CLIENT_GONE)
        end = last[0] if last else None
        if not isinstance(end, Finish):
            raise failure(end)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": end.usage.prompt_tokens})
