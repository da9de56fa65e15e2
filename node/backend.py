"""The node's implementation of the API's `Backend`.

A request goes to this node's runner when the model's instance starts here; otherwise over libp2p to
the node that holds the instance's first stage, whose events come straight back (never via the leader).
Instance requests are forwarded to the leader.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from api.backend import ModelCard
from node.cluster import ClusterService
from node.instances import InstanceManager
from node.leader_control import instance_view
from node.models import list_local_models
from node.models.shape import FLOAT_DTYPES, read_safetensors_header
from node.models.store import dir_size
from node.routing import GenerationServer
from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView, InstanceView, ModelFileView
from protocol.control_wire import DeleteOutcome, PlaceOutcome
from protocol.events import ChunkEvent, GenerationError
from protocol.ids import RequestId


class RemoteStreams(Protocol):
    def open_stream(
        self, entry_node: str, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]: ...

    async def cancel(self, request_id: RequestId) -> bool: ...


class NodeBackend:
    def __init__(self, cluster: ClusterService, instances: InstanceManager, remote: RemoteStreams) -> None:
        self._cluster = cluster
        self._instances = instances
        self._remote = remote
        self._created = int(time.time())
        self.serving: GenerationServer | None = None
        """What this node runs for its peers (`serve_generations`), once registered: its counts
        show in `/health`."""

    def cluster(self) -> ClusterView:
        return self._cluster.snapshot()

    def models(self) -> Sequence[ModelCard]:
        cards: dict[str, ModelCard] = {}
        for record in self._instances.records():
            runner = self._instances.local_runner(record.model)
            context = runner.ready_info.context_length if runner and runner.ready_info else None
            facts = folder_facts(runner.spec.model_path) if runner else ModelFacts()
            card = ModelCard(
                id=record.model,
                created=self._created,
                context_length=context,
                size_bytes=facts.size_bytes,
                family=facts.family,
                format=facts.format,
                parameter_count=facts.parameter_count,
                quantization=facts.quantization,
            )
            cards.setdefault(record.model, card)
        return list(cards.values())

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        entry = self._instances.entry_node(request.model)
        if entry is not None and entry != self._cluster.me:
            return self._remote.open_stream(entry, request)
        return self.open_local_stream(request)

    def open_local_stream(
        self, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        """Only this node's runners: what peers' forwarded requests get (they never hop twice)."""
        runner = self._instances.local_runner(request.model)
        if runner is not None:
            return runner.open_stream(request)
        entry = self._instances.entry_node(request.model)
        if entry is None:
            return _single_event(
                GenerationError(
                    error_kind="invalid_request",
                    message=f"model {request.model!r} is not served by this cluster",
                    code="model_not_found",
                    param="model",
                )
            )
        return _single_event(
            GenerationError(
                error_kind="server_error",
                message=f"model {request.model!r} is not running on this node (yet); retry shortly",
                code="model_loading",
            )
        )

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel a request this node accepted, wherever it runs."""
        return await self.cancel_local(request_id) or await self._remote.cancel(request_id)

    async def cancel_local(self, request_id: RequestId) -> bool:
        for runner in self._instances.runners():
            if runner.has_request(request_id):
                return await runner.cancel(request_id)
        return False

    def instances(self) -> Sequence[InstanceView]:
        return [instance_view(record) for record in self._instances.records()]

    async def place_instance(self, model: str, nodes: int | None, *, preview: bool) -> PlaceOutcome:
        return await self._instances.request_instance(model, nodes, preview=preview)

    async def delete_instance(self, instance_id: str) -> DeleteOutcome:
        return await self._instances.delete_instance(instance_id)

    async def local_models(self) -> Sequence[ModelFileView]:
        found = await trio.to_thread.run_sync(list_local_models, self._instances.data_dir)
        return [ModelFileView(name=m.name, model_type=m.model_type, size_bytes=m.size_bytes) for m in found]

    def health(self) -> dict[str, Any]:
        return {
            "runners": [runner.health() for runner in self._instances.runners()],
            "cluster": asdict(self._cluster.stats),
            "mesh": asdict(self._cluster.mesh.stats),
            "generations_for_peers": asdict(self.serving.stats) if self.serving else {},
        }


@dataclass(frozen=True)
class ModelFacts:
    """What a model card says of the model's folder (see `ModelCard`); None where unreadable."""

    size_bytes: int | None = None
    family: str | None = None
    format: str | None = None
    parameter_count: int | None = None
    quantization: str | None = None


@functools.lru_cache(maxsize=64)
def folder_facts(folder: Path) -> ModelFacts:
    """Read once per folder (config.json and the safetensors headers, never a tensor: a few ms), so
    that `models()`, which every request calls, stays a dictionary lookup afterwards."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        tensors: dict[str, dict[str, Any]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            tensors.update(read_safetensors_header(path))
    except (OSError, ValueError):  # ModelShapeError is a ValueError
        return ModelFacts()
    if not isinstance(config, dict):
        return ModelFacts()
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    params = 0
    floats: Counter[str] = Counter()
    for name, info in tensors.items():
        module, _, kind = name.rpartition(".")
        elements = 1
        for dim in info["shape"]:
            elements *= int(dim)
        if f"{module}.scales" in tensors and kind in ("scales", "biases"):
            continue  # a quantized matrix's scales and biases are not weights of their own
        own = quant.get(module) if isinstance(quant, dict) else None
        module_bits = own.get("bits") if isinstance(own, dict) else bits
        if f"{module}.scales" in tensors and isinstance(module_bits, int) and module_bits > 0:
            elements = elements * 32 // module_bits  # uint32 words packing 32/bits weights each
        elif info["dtype"] in FLOAT_DTYPES:
            floats[info["dtype"]] += elements
        params += elements
    quantization: str | None
    if isinstance(bits, int):
        quantization = "MXFP4" if isinstance(quant, dict) and quant.get("mode") == "mxfp4" else f"Q{bits}"
    else:
        quantization = floats.most_common(1)[0][0] if floats else None
    model_type = config.get("model_type")
    return ModelFacts(
        size_bytes=dir_size(folder),
        family=model_type if isinstance(model_type, str) else None,
        format="safetensors" if tensors else None,
        parameter_count=params or None,
        quantization=quantization,
    )


@asynccontextmanager
async def _single_event(event: ChunkEvent) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
    async def events() -> AsyncIterator[ChunkEvent]:
        yield event

    yield events()
