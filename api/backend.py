"""The small interface the node hands the API: the API never reaches into node internals."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView, InstanceView, ModelFileView
from protocol.control_wire import DeleteOutcome, PlaceOutcome
from protocol.events import ChunkEvent
from protocol.health import NodeHealth
from protocol.held_models import ClusterModelsView
from protocol.ids import ModelId, RequestId
from protocol.sampling import SamplingDefaults
from protocol.sharding import ShardingChoice


class ModelCard(BaseModel):
    """A model this node can serve right now."""

    model_config = ConfigDict(frozen=True)
    id: ModelId
    created: int
    owned_by: str = "shoal"
    context_length: int | None = None
    """None while the model is still loading."""
    # What the node read of the model's folder (Ollama's `/api/tags` and `/api/show` show them);
    # None where it does not know, e.g. a model that runs only on other nodes.
    size_bytes: int | None = None
    """The model's files as stored."""
    family: str | None = None
    """The architecture: config.json's `model_type` ("llama", "qwen3", "gpt_oss")."""
    format: str | None = None
    """How the weights are stored: "safetensors" (an mlx-lm folder)."""
    parameter_count: int | None = None
    """Weights, counting a quantized matrix at its dense size."""
    quantization: str | None = None
    """"Q4", "Q8", "MXFP4" for quantized weights, else the weights' float type ("BF16", "F32")."""
    sampling_defaults: SamplingDefaults | None = None
    """What the model recommends (its generation_config.json), which a request's omitted sampling
    fields get before the server's defaults (`protocol.sampling.resolve_sampling`); None where the
    node cannot tell (the model's files are only on other nodes)."""


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
        A stream whose first event takes longer than a keep-alive interval (entering may wait, e.g. for
        a model still loading) is answered 200 meanwhile, and a later error is an in-stream event.
        The API enters, iterates and leaves in one task, and the iterator may be an async generator or
        a memory channel alike.
        """
        ...

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel an in-flight generation; False when no such request is running."""
        ...

    def instances(self) -> Sequence[InstanceView]:
        """The model instances of the whole cluster."""
        ...

    async def place_instance(
        self,
        model: str,
        nodes: int | None,
        *,
        preview: bool,
        replicas: int | None = None,
        sharding: ShardingChoice = "pipeline",
    ) -> PlaceOutcome:
        """Ask the leader to place `model` (on `nodes` nodes if given; with `replicas`, that many
        instances on disjoint nodes, as many as fit; `sharding` as `InstanceRecord.sharding`, or "auto");
        `preview` only plans."""
        ...

    async def delete_instance(self, instance_id: str) -> DeleteOutcome: ...

    def cluster(self) -> ClusterView:
        """This node's current picture of the cluster, for `GET /v1/cluster`."""
        ...

    def cluster_models(self) -> ClusterModelsView:
        """The model files each node holds, as this node knows them, for `GET /v1/cluster/models`."""
        ...

    def health(self) -> NodeHealth:
        """The node's runners and counters, for `GET /health`."""
        ...

    async def local_models(self) -> Sequence[ModelFileView]:
        """The models in this node's data dir, which it can place by name (the dashboard lists them);
        async because it walks the folders."""
        ...
