"""The node's implementation of the API's `Backend`.

A request goes to this node's runner when the model's instance starts here; otherwise over libp2p to
the node that holds the instance's first stage, whose events come straight back (never via the leader).
A request for an instance that starts here but has no runner yet (its files still coming, its later
stages loading) waits for the runner, up to `load_wait_s`, unless no node can get the model's files
(`files_unavailable`): then it ends at once with that reason, failover included.
Instance requests are forwarded to the leader.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict
from typing import Protocol

import trio

from api.backend import ModelCard
from node.cluster.service import ClusterService
from node.control.instances import InstanceManager
from node.control.leader import instance_view
from node.files.cluster import files_unavailable, placeable
from node.models import list_local_models
from node.runner.supervisor import RunnerSupervisor
from node.serving.failover import Failover, FailoverConfig
from node.serving.model_cards import ModelCards
from node.serving.routing import GenerationServer
from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView, InstanceView, ModelFileView
from protocol.control_wire import DeleteOutcome, PlaceOutcome
from protocol.events import (
    MODEL_FILES_UNAVAILABLE,
    MODEL_LOADING,
    MODEL_NOT_FOUND,
    ChunkEvent,
    GenerationError,
)
from protocol.health import NodeHealth
from protocol.held_models import ClusterModelsView, node_models
from protocol.ids import NodeId, RequestId

CARDS_REFRESH_S = 10.0
"""At least this often the model cards' facts are read again: a generation_config.json a card
lacked may have arrived (`node.serving.model_sampling.RETRY_S` paces the search for it)."""


class RemoteStreams(Protocol):
    def open_stream(
        self, entry_node: str, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]: ...

    async def cancel(self, request_id: RequestId) -> bool: ...


class NodeBackend:
    def __init__(
        self,
        cluster: ClusterService,
        instances: InstanceManager,
        remote: RemoteStreams,
        *,
        load_wait_s: float,
        failover: FailoverConfig | None = None,
    ) -> None:
        self._cluster = cluster
        self._instances = instances
        self._remote = instances.loads.counted(remote)
        """Every request sent to a peer's entry counts against it (replica choice:
        `node.hosting.replica_load`)."""
        self._load_wait_s = load_wait_s
        """How long a request waits for an instance placed here to start (`NodeConfig.load_wait_s`)."""
        self._failover = Failover(self._open_on, instances.entry_nodes, self._cancel_running, failover)
        """Every request this node accepts; it goes on elsewhere when its instance breaks off."""
        self._created = int(time.time())
        self._cards = ModelCards(instances.data_dir)
        self.serving: GenerationServer | None = None
        """What this node runs for its peers (`serve_generations`), once registered: its counts
        show in `/health`."""

    def cluster(self) -> ClusterView:
        return self._cluster.snapshot()

    def cluster_models(self) -> ClusterModelsView:
        state = self._cluster.state
        members = self._cluster.snapshot().members
        known = self._instances.files.held()
        nodes = node_models(members, state.holdings(), state.instances().values(), known, state.transfers())
        return ClusterModelsView(self=self._cluster.me, nodes=nodes)

    def models(self) -> Sequence[ModelCard]:
        cards: dict[str, ModelCard] = {}
        for record in self._instances.records():
            runner = self._instances.local_runner(record.model)
            folder = runner.spec.model_path if runner else None
            context = runner.ready_info.context_length if runner and runner.ready_info else None
            facts = self._cards.facts(folder)
            card = ModelCard(
                id=record.model,
                created=self._created,
                context_length=context,
                size_bytes=facts.size_bytes,
                family=facts.family,
                format=facts.format,
                parameter_count=facts.parameter_count,
                quantization=facts.quantization,
                sampling_defaults=self._cards.defaults(record.manifest, folder),
            )
            cards.setdefault(record.model, card)
        return list(cards.values())

    async def keep_cards(self) -> None:
        """What `models()` shows beyond the records, read off the event loop (`model_cards`): at
        once, then after each change of what this node hosts or `CARDS_REFRESH_S` at the latest."""
        while True:
            sources = []
            for record in self._instances.records():
                runner = self._instances.local_runner(record.model)
                sources.append((record.manifest, runner.spec.model_path if runner else None))
            await self._cards.refresh(sources)
            with trio.move_on_after(CARDS_REFRESH_S):
                await self._instances.wait_hosted_changed()

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        return self._failover.open_stream(request)

    def _open_on(
        self, entry: NodeId | None, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        """One attempt of `node.serving.failover`: on `entry` (None: this node, which says why it
        has none)."""
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
                    code=MODEL_NOT_FOUND,
                    param="model",
                )
            )
        return self._open_once_loaded(request)

    @asynccontextmanager
    async def _open_once_loaded(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        """Enter this node's runner for the model once it has one, waiting up to `load_wait_s` (the
        instance's files moving here, its later stages loading); past that, or as soon as this node
        takes no requests for the model any more, the one `model_loading` error; as soon as no node
        can get the model's files, the `model_files_unavailable` error, which failover passes on.
        Cancellable."""
        runner: RunnerSupervisor | GenerationError | None = None
        with trio.move_on_after(self._load_wait_s):
            runner = await self._runner_once_started(request.model)
        if not isinstance(runner, RunnerSupervisor):
            loading = GenerationError(
                error_kind="server_error",
                message=f"model {request.model!r} is not running on this node (yet); retry shortly",
                code=MODEL_LOADING,
            )
            async with _single_event(runner or loading) as events:
                yield events
            return
        async with runner.open_stream(request) as events:
            yield events

    async def _runner_once_started(self, model: str) -> RunnerSupervisor | GenerationError | None:
        """This node's runner for `model` as soon as there is one; None once this node is no entry of
        `model` (its instance deleted or moved); the error once no node can get its files (rechecked
        at each reconcile, which follows every cluster change). Unbounded: the caller bounds it."""
        while (runner := self._instances.local_runner(model)) is None:
            if self._cluster.me not in self._instances.entry_nodes(model):
                return None
            if (why := files_unavailable(self._cluster, model)) is not None:
                return GenerationError(
                    error_kind="server_error",
                    message=f"model {model!r} cannot run: {why}",
                    code=MODEL_FILES_UNAVAILABLE,
                )
            await self._instances.wait_hosted_changed()
        return runner

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel a request this node accepted, wherever it runs (or between two attempts)."""
        return await self._failover.cancel(request_id) or await self._cancel_running(request_id)

    async def _cancel_running(self, request_id: RequestId) -> bool:
        return await self.cancel_local(request_id) or await self._remote.cancel(request_id)

    async def cancel_local(self, request_id: RequestId) -> bool:
        for runner in self._instances.runners():
            if runner.has_request(request_id):
                return await runner.cancel(request_id)
        return False

    def instances(self) -> Sequence[InstanceView]:
        return [instance_view(record) for record in self._instances.records()]

    async def place_instance(
        self, model: str, nodes: int | None, *, preview: bool, replicas: int | None = None
    ) -> PlaceOutcome:
        return await self._instances.request_instance(model, nodes, preview=preview, replicas=replicas)

    async def delete_instance(self, instance_id: str) -> DeleteOutcome:
        return await self._instances.delete_instance(instance_id)

    async def local_models(self) -> Sequence[ModelFileView]:
        data_dir = self._instances.data_dir
        found = await trio.to_thread.run_sync(lambda: placeable(list_local_models(data_dir), data_dir))
        return [ModelFileView(name=m.name, model_type=m.model_type, size_bytes=m.size_bytes) for m in found]

    def health(self) -> NodeHealth:
        return NodeHealth(
            runners=tuple(runner.health() for runner in self._instances.runners()),
            cluster=asdict(self._cluster.stats),
            mesh=asdict(self._cluster.mesh.stats),
            generations_for_peers=asdict(self.serving.stats) if self.serving else {},
        )


@asynccontextmanager
async def _single_event(event: ChunkEvent) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
    async def events() -> AsyncIterator[ChunkEvent]:
        yield event

    yield events()
