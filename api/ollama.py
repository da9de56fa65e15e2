"""Ollama's API at the root: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version` and `HEAD /` (the liveness probe Ollama tools send; `GET /` is left for a dashboard).

A handler validates the body (`api.ollama_schema`), builds the `GenerateRequest`
(`api.ollama_request`) and hands it to `api.streaming` with the Ollama encoder or collector
(`api.ollama_encode`). Streams are NDJSON unless the body says `"stream": false`. Every error, on
these routes and on any other `/api/` path, is Ollama's `{"error": "..."}` with its status.
A model may be named with Ollama's default tag: `name:latest` is `name` (unless a model has that id).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend, ModelCard
from api.errors import ApiError, parse_body
from api.ollama_encode import (
    NDJSON,
    OLLAMA,
    SYSTEM_CLOCK,
    Clock,
    Kind,
    OllamaCollector,
    OllamaEncoder,
    load_answer,
    ndjson_line,
)
from api.ollama_models import running, show, tags, version
from api.ollama_request import chat_request, generate_request
from api.ollama_schema import ChatBody, GenerateBody, GenerationBody, ShowBody
from api.streaming import EventStream, collect
from api.surface import CLIENT_GONE, Limits, read_body, require_model, surface_route
from protocol.chat import GenerateRequest
from protocol.ids import new_request_id

REQUEST_ID_PREFIX = "ollama-"
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def served_model(backend: Backend, name: str) -> ModelCard:
    """The card `name` refers to, or the surface's 404 naming it."""
    ids = {card.id for card in backend.models()}
    untagged = name.removesuffix(":latest")
    return require_model(backend, untagged if name not in ids and untagged in ids else name)


class OllamaRoutes:
    def __init__(self, backend: Backend, limits: Limits, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._backend = backend
        self._limits = limits
        self._clock = clock
        self._served: dict[str, list[str]] = {}
        """Path -> methods of the routes below, for the 405s of the catch-all."""

    def routes(self) -> list[Route]:
        routes = [
            surface_route(OLLAMA, "/api/chat", self.chat, methods=["POST"]),
            surface_route(OLLAMA, "/api/generate", self.generate, methods=["POST"]),
            surface_route(OLLAMA, "/api/tags", self.tags, methods=["GET"]),
            surface_route(OLLAMA, "/api/show", self.show, methods=["POST"]),
            surface_route(OLLAMA, "/api/ps", self.ps, methods=["GET"]),
            surface_route(OLLAMA, "/api/version", self.version, methods=["GET"]),
        ]
        self._served = {route.path: sorted(route.methods or ()) for route in routes}
        return [
            *routes,
            Route("/", self.alive, methods=["HEAD"]),
            # Last: whatever else is under /api/ (Starlette takes a full match before a method mismatch).
            Route("/api/{path:path}", self.unknown, methods=ANY_METHOD),
        ]

    async def chat(self, request: Request) -> Response:
        started = self._clock.monotonic_ns()
        body = parse_body(ChatBody, await read_body(request, self._limits.max_body_bytes))
        card = served_model(self._backend, body.model)
        if not body.messages:
            return self._loaded("chat", body)
        generate = chat_request(body, new_request_id(REQUEST_ID_PREFIX), card.id)
        return await self._answer(request, "chat", body, generate, started)

    async def generate(self, request: Request) -> Response:
        started = self._clock.monotonic_ns()
        body = parse_body(GenerateBody, await read_body(request, self._limits.max_body_bytes))
        card = served_model(self._backend, body.model)
        if body.is_load:
            return self._loaded("generate", body)
        generate = generate_request(body, new_request_id(REQUEST_ID_PREFIX), card.id)
        return await self._answer(request, "generate", body, generate, started)

    async def _answer(
        self, request: Request, kind: Kind, body: GenerationBody, generate: GenerateRequest, started: int
    ) -> Response:
        thinking = body.show_thinking
        if body.stream:
            encoder = OllamaEncoder(
                kind,
                body.model,
                self._clock,
                started_ns=started,
                show_thinking=thinking,
            )
            return EventStream(
                self._backend, generate, encoder, surface=OLLAMA, keepalive_s=self._limits.keepalive_s
            )
        collector = OllamaCollector(kind, body.model, self._clock, started_ns=started, show_thinking=thinking)
        if not await collect(self._backend, generate, request.receive, collector.feed):
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(collector.result())

    def _loaded(self, kind: Kind, body: GenerationBody) -> Response:
        answer = load_answer(kind, body.model, self._clock)
        return Response(ndjson_line(answer), media_type=NDJSON) if body.stream else JSONResponse(answer)

    async def tags(self, request: Request) -> Response:
        return JSONResponse(tags(list(self._backend.models())))

    async def show(self, request: Request) -> Response:
        body = parse_body(ShowBody, await read_body(request, self._limits.max_body_bytes))
        name = body.model or body.name
        if name is None:
            raise ApiError(
                400, "Missing required parameter: 'model'", param="model", code="missing_required_parameter"
            )
        return JSONResponse(show(served_model(self._backend, name)))

    async def ps(self, request: Request) -> Response:
        return JSONResponse(running(list(self._backend.models())))

    async def version(self, request: Request) -> Response:
        return JSONResponse(version())

    async def alive(self, request: Request) -> Response:
        return Response(status_code=200)

    async def unknown(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        allowed = self._served.get(path)
        if allowed is None:
            known = ", ".join(self._served)
            error = ApiError(404, f"Shoal does not serve {method} {path}; its Ollama API is {known}")
            return OLLAMA.error_response(error)
        response = OLLAMA.error_response(ApiError(405, f"Method {method} is not allowed on {path}"))
        response.headers["allow"] = ", ".join(allowed)
        return response
