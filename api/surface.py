"""What every HTTP surface (OpenAI chat, Claude Messages, OpenAI Responses, Ollama) shares.

A surface is an encoding of the one generation path: it reads the body (`read_body`, one size
limit), checks the model (`require_model`), builds a `GenerateRequest`, and renders the backend's
events. `Surface` holds what differs between them beside the events: the media type of its streams,
the frame a quiet stream gets, and the shape of its error bodies. `surface_route` makes every
`ApiError` a handler raises answer in that shape, with its status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api import sse
from api.backend import Backend, ModelCard
from api.errors import ApiError, unexpected

CLIENT_GONE = 499
"""Status for a response nobody will read (nginx's "client closed request"); never reaches the wire."""

ErrorBody = Callable[[ApiError], Any]
"""A surface's JSON error body for one error."""


def openai_error_body(error: ApiError) -> Any:
    return error.body()


@dataclass(frozen=True)
class Surface:
    """The non-event differences between the HTTP APIs Shoal speaks."""

    name: str
    media_type: str = sse.MEDIA_TYPE
    error_body: ErrorBody = openai_error_body
    paths: tuple[str, ...] = ()
    """The path prefixes it owns, so that errors raised before a handler (a missing API key) answer
    in its shape; OpenAI's is the default for every other path."""
    stream_headers: Mapping[str, str] = field(default_factory=lambda: dict(sse.HEADERS))

    def error_response(self, error: ApiError) -> Response:
        return JSONResponse(self.error_body(error), status_code=error.status)


OPENAI = Surface("openai")


def surface_for(path: str, surfaces: Sequence[Surface]) -> Surface:
    """The surface whose `paths` hold `path`; OpenAI's when none does."""
    return next((s for s in surfaces if any(path.startswith(p) for p in s.paths)), OPENAI)


@dataclass(frozen=True)
class Limits:
    """The request limits every surface applies (defaults and reasons in `api.app`)."""

    keepalive_s: float
    max_body_bytes: int


Handler = Callable[[Request], Awaitable[Response]]


def surface_route(surface: Surface, path: str, handler: Handler, *, methods: list[str]) -> Route:
    """A Starlette route whose errors answer in `surface`'s shape (an unexpected one is a logged 500)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return surface.error_response(exc)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE)
        except Exception as exc:
            return surface.error_response(unexpected(request, exc))

    return Route(path, endpoint, methods=methods)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `limit` bytes.

    (Starlette's `max_body_size` answers in plain text, not in the surface's error shape.)
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


def require_model(backend: Backend, model: str, *, param: str = "model") -> ModelCard:
    """The card of the model a request names, or a 404 naming it."""
    for card in backend.models():
        if card.id == model:
            return card
    raise ApiError(
        404, f"The model '{model}' does not exist or is not served here", param=param, code="model_not_found"
    )
