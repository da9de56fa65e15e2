"""The web dashboard: `GET /` and its files (`api/web/`, package data), and the live view it shows.

- `GET /`, `GET /web/{file}`: the page, plain HTML, CSS and JS modules (no build step, nothing from
  the internet); only the suffixes in `ASSET_TYPES` are served, and only from inside `api/web/`.
- `GET /v1/cluster/events`: server-sent events, one `data:` event with the dashboard's state
  whenever it changes (checked every `PUSH_INTERVAL_S`), a `: keep-alive` comment when it doesn't.
- `GET /v1/dashboard/state`: the same state once, for pages that cannot keep a stream open.
- `GET /v1/dashboard/models`: the models this node can place, with size and fit.

The state is `GET /v1/cluster`'s view plus each instance's state (`api.dashboard_state`). The page
sets a Content-Security-Policy that allows scripts from this origin only: even an escaping bug in
how it renders model output could not run an inline script.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from api import sse
from api.backend import Backend
from api.dashboard_state import instance_states, placeable_models
from api.errors import ApiError

WEB_DIR = Path(__file__).resolve().parent / "web"
ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
"""Every file the dashboard serves carries these; `no-cache` revalidates, so an upgraded node's page
is never mixed with an old one's modules."""
PUSH_INTERVAL_S = 1.0
"""How often the pushed state is rebuilt and compared: the failure detector's own tick is ~0.5-1 s,
so a dead node shows within about two seconds of the node deciding it."""
PUSH_KEEPALIVE_S = 10.0
"""A comment after this long without a change, well inside proxies' idle timeouts (see `api.app`)."""


async def _read(path: Path) -> bytes:
    return await trio.to_thread.run_sync(path.read_bytes)


class DashboardRoutes:
    def __init__(self, backend: Backend, *, push_interval_s: float = PUSH_INTERVAL_S) -> None:
        self._backend = backend
        self._push_interval_s = push_interval_s

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/web/{name:path}", self.asset, methods=["GET"]),
            Route("/v1/cluster/events", self.events, methods=["GET"]),
            Route("/v1/dashboard/state", self.state, methods=["GET"]),
            Route("/v1/dashboard/models", self.models, methods=["GET"]),
        ]

    async def index(self, request: Request) -> Response:
        return Response(
            await _read(WEB_DIR / "index.html"), media_type=ASSET_TYPES[".html"], headers=PAGE_HEADERS
        )

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        path = (WEB_DIR / name).resolve()
        if not path.is_relative_to(WEB_DIR) or path.suffix not in ASSET_TYPES or not path.is_file():
            raise ApiError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(await _read(path), media_type=ASSET_TYPES[path.suffix], headers=PAGE_HEADERS)

    async def snapshot(self) -> dict[str, Any]:
        """The cluster view, each instance's state, and this node's clock (to age the view)."""
        view = self._backend.cluster()
        states = instance_states(view)
        return {
            "cluster": view.model_dump(mode="json"),
            "instance_states": {iid: status.model_dump(mode="json") for iid, status in states.items()},
            "time": time.time(),
        }

    async def state(self, request: Request) -> Response:
        return JSONResponse(await self.snapshot())

    async def events(self, request: Request) -> Response:
        return _Push(self.snapshot, self._push_interval_s)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await placeable_models(self._backend)})


class _Push(Response):
    """An SSE stream of `snapshot()`, sent when it changed (ignoring its `time`), until the client goes."""

    def __init__(self, snapshot: Callable[[], Awaitable[dict[str, Any]]], interval_s: float) -> None:
        self.status_code = 200
        self.media_type = sse.MEDIA_TYPE
        self.init_headers(sse.HEADERS)
        self._snapshot = snapshot
        self._interval_s = interval_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with sse.cancel_on_disconnect(receive):
            last: Any = None
            quiet_since = trio.current_time()
            while True:
                snapshot = await self._snapshot()
                moved = {k: v for k, v in snapshot.items() if k != "time"}
                if moved != last:
                    last, quiet_since = moved, trio.current_time()
                    await send({"type": "http.response.body", "body": sse.data(snapshot), "more_body": True})
                elif trio.current_time() - quiet_since >= PUSH_KEEPALIVE_S:
                    quiet_since = trio.current_time()
                    await send({"type": "http.response.body", "body": sse.KEEP_ALIVE, "more_body": True})
                await trio.sleep(self._interval_s)
