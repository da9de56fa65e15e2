"""The small interface the node hands the API: the API never reaches into node internals."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView, InstanceView
from protocol.control_wire import DeleteOutcome, PlaceOutcome
from protocol.events import ChunkEvent
from protocol.ids import ModelId, RequestId


class ModelCard(BaseModel):
    """A model this node can serve right now."""

    model_config = ConfigDict(frozen=True)
    id: ModelId
    created: int
    owned_by: str = "shoal"
    context_length: int | None = None
    """None while the model is still loading."""


class Backend(Protocol):
    def models(self) -> Sequence[ModelCard]:
        """The models that requests may name."""
        ...

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        """Start a generation and iterate over its events.

        The iterator ends after one terminal event (`Finish` or `GenerationError`). Leaving the context
        before that, with or without an exception (the client hung up: usually `trio.Cancelled`, maybe
        inside an exception group), cancels the generation in the runner. Entering may be cancelled too.

        The API reads the first event before it answers: a `GenerationError` of kind `invalid_request`
        there becomes an HTTP 400 (one of kind `server_error`, a 503), so report bad prompts first.
        The API iterates from a child task of the one that entered the context, and the iterator may
        be an async generator or a memory channel alike.
        """
        ...

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel an in-flight generation; False when no such request is running."""
        ...

    def instances(self) -> Sequence[InstanceView]:
        """The model instances of the whole cluster."""
        ...

    async def place_instance(self, model: str, nodes: int | None, *, preview: bool) -> PlaceOutcome:
        """Ask the leader to place `model` (on `nodes` nodes if given); `preview` only plans."""
        ...

    async def delete_instance(self, instance_id: str) -> DeleteOutcome: ...

    def cluster(self) -> ClusterView:
        """This node's current picture of the cluster, for `GET /v1/cluster`."""
        ...

    def health(self) -> dict[str, Any]:
        """A JSON-ready picture of the node's runners for `GET /health`."""
        ...
