"""API keys: with one set, every request but the open ones must carry it.

The key comes as `Authorization: Bearer KEY` (what the OpenAI and Ollama clients send) or
`x-api-key: KEY` (the Anthropic client), compared in constant time. A request without it gets a
401 in the shape of the surface its path belongs to, before any handler runs, so it reads no body
and changes nothing. Nodes forward requests to each other over the mesh (admitted by the cluster
secret), never with the user's key, so the key never leaves the node it was sent to.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiError
from api.surface import Surface, surface_for

OPEN_ROUTES = (("GET", "/health"), ("HEAD", "/health"), ("GET", "/"), ("HEAD", "/"))
"""Exact (method, path) pairs anyone may ask: liveness probes, and the dashboard's page, on which a
user types the key that its own requests then carry."""
OPEN_PREFIXES = (("GET", "/web/"), ("GET", "/v1/files/"), ("HEAD", "/v1/files/"))
"""The dashboard's static files: the same for everyone, holding nothing about the cluster. Model files
(`api.files`): peers sign each request with the cluster key instead, never holding the user's key."""


def presented_key(headers: Headers) -> str | None:
    """The key a request carries, in either header; None without one."""
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return headers.get("x-api-key") or None


def is_open(method: str, path: str) -> bool:
    return (method, path) in OPEN_ROUTES or any(
        method == m and path.startswith(prefix) for m, prefix in OPEN_PREFIXES
    )


class ApiKeyGuard:
    """ASGI middleware in front of the whole app; `key=None` lets everything through."""

    def __init__(self, app: ASGIApp, key: str | None, surfaces: Sequence[Surface]) -> None:
        self._app = app
        self._key = None if key is None else key.encode()
        self._surfaces = surfaces

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None or is_open(scope["method"], scope["path"]):
            return True
        given = presented_key(Headers(scope=scope))
        return given is not None and hmac.compare_digest(given.encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._authorized(scope):
            await self._app(scope, receive, send)
            return
        error = ApiError(
            401,
            "Missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="invalid_api_key",
        )
        surface = surface_for(scope["path"], self._surfaces)
        await surface.error_response(error)(scope, receive, send)
