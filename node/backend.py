"""The node's implementation of the API's `Backend`: routes each request to its model's runner."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict
from typing import Any

from api.backend import ModelCard
from node.cluster import ClusterService
from node.runner.supervisor import RunnerSupervisor
from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView
from protocol.events import ChunkEvent, GenerationError
from protocol.ids import ModelId, RequestId


class NodeBackend:
    def __init__(self, runners: Sequence[RunnerSupervisor], cluster: ClusterService) -> None:
        self._runners: dict[ModelId, RunnerSupervisor] = {r.spec.model_id: r for r in runners}
        self._created = int(time.time())
        self._cluster = cluster

    def cluster(self) -> ClusterView:
        return self._cluster.snapshot()

    def models(self) -> Sequence[ModelCard]:
        return [
            ModelCard(
                id=model_id,
                created=self._created,
                context_length=runner.ready_info.context_length if runner.ready_info else None,
            )
            for model_id, runner in self._runners.items()
        ]

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        runner = self._runners.get(request.model)
        if runner is None:
            return _single_event(
                GenerationError(
                    error_kind="invalid_request",
                    message=f"model {request.model!r} is not served by this node",
                    code="model_not_found",
                    param="model",
                )
            )
        return runner.open_stream(request)

    async def cancel(self, request_id: RequestId) -> bool:
        for runner in self._runners.values():
            if runner.has_request(request_id):
                return await runner.cancel(request_id)
        return False

    def health(self) -> dict[str, Any]:
        return {
            "runners": [runner.health() for runner in self._runners.values()],
            "cluster": asdict(self._cluster.stats),
            "mesh": asdict(self._cluster.mesh.stats),
        }


@asynccontextmanager
async def _single_event(event: ChunkEvent) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
    async def events() -> AsyncIterator[ChunkEvent]:
        yield event

    yield events()
