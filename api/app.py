"""The ASGI application: `create_app(backend)` wires the route groups to one `Backend`.

Serve it with hypercorn's trio worker; the handlers use trio directly.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware

from api.auth import ApiKeyGuard
from api.backend import Backend
from api.chat import ChatRoutes
from api.cluster import ClusterRoutes
from api.dashboard import DashboardRoutes
from api.errors import EXCEPTION_HANDLERS
from api.files import FileRoutes, FileSource
from api.instances import InstanceRoutes
from api.messages import MessagesRoutes
from api.messages_encode import ANTHROPIC
from api.metrics import MetricsRoutes
from api.models import ModelRoutes
from api.ollama import OllamaRoutes
from api.ollama_encode import OLLAMA
from api.responses import ResponsesRoutes
from api.surface import Limits

KEEPALIVE_S = 10.0
"""Send an SSE comment after this long without an event: well under the 30-60 s at which proxies and
clients commonly drop an idle connection, and rare enough to cost nothing."""

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Larger request bodies get a 413. A full 128k-token conversation is about 0.5-1 MiB of JSON;
the runner wire's frame limit (`protocol.runner_wire.MAX_FRAME_BYTES`, 16 MiB) must stay above this."""


def create_app(
    backend: Backend,
    *,
    keepalive_s: float = KEEPALIVE_S,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    files: FileSource | None = None,
) -> Starlette:
    """The HTTP API over `backend`: OpenAI chat completions, Claude Messages, OpenAI Responses and
    Ollama, one generation path in four encodings. Errors answer in the shape of the surface asked
    (OpenAI's for routes no surface claims). With `api_key`, every route but the open ones
    (`api.auth.OPEN_ROUTES`) needs it. With `files`, peers download model files here (`api.files`:
    signed with the cluster key, which is why they need no API key)."""
    limits = Limits(keepalive_s=keepalive_s, max_body_bytes=max_body_bytes)
    metrics = MetricsRoutes(backend)
    backend = metrics.backend  # every generation streams through it, so every surface is counted
    surfaces = (ChatRoutes, MessagesRoutes, ResponsesRoutes, OllamaRoutes)
    routes = [
        *(route for cls in surfaces for route in cls(backend, limits).routes()),
        *metrics.routes(),
        *ModelRoutes(backend).routes(),
        *ClusterRoutes(backend).routes(),
        *InstanceRoutes(backend).routes(),
        *DashboardRoutes(backend).routes(),
        *(FileRoutes(files).routes() if files is not None else []),
    ]
    guard = Middleware(ApiKeyGuard, key=api_key, surfaces=(ANTHROPIC, OLLAMA))
    return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, middleware=[guard])
