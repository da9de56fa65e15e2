"""`GET /v1/cluster`: the answering node's picture of the cluster (members, leader, instances);
`GET /v1/cluster/models`: the model files each node holds (what `shoal models` shows)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend


class ClusterRoutes:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def routes(self) -> list[Route]:
        return [Route("/v1/cluster", self.cluster), Route("/v1/cluster/models", self.models)]

    async def cluster(self, request: Request) -> Response:
        return JSONResponse(self._backend.cluster().model_dump(mode="json"))

    async def models(self, request: Request) -> Response:
        return JSONResponse(self._backend.cluster_models().model_dump(mode="json"))
