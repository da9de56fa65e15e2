"""Claude Messages: `POST /v1/messages`, `POST /v1/messages/count_tokens` (being built: issue 11)."""

from __future__ import annotations

from starlette.routing import Route

from api.backend import Backend
from api.surface import Limits


class MessagesRoutes:
    def __init__(self, backend: Backend, limits: Limits) -> None:
        self._backend = backend
        self._limits = limits

    def routes(self) -> list[Route]:
        return []
