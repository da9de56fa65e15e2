"""The node's implementation of the API's `Backend`.

A request goes to this node's runner when the model's instance starts here; otherwise over libp2p to
the node that holds the instance's first stage, whose events come straight back (never via the leader):
`failover` runs it, each try opened by `attempts`. Instance requests are forwarded to the leader.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict

import trio

from api.backend import ModelCard
from node.cluster.service import ClusterService
from node.control.instances import InstanceManager
from node.control.leader import instance_view
from node.files.cluster import placeable
from node.models import list_local_models
from node.serving.attempts import Attempts, RemoteStreams
from node.serving.failover import Failover, FailoverConfig
from node.serving.model_cards import ModelCards
from node.serving.routing import GenerationServer
from protocol.chat import GenerateRequest
from protocol.cluster_view import ClusterView, InstanceView, ModelFileView
from protocol.control_wire import DeleteOutcome, PlaceOutcome
from protocol.events import (
    ChunkEvent,
)
from protocol.health import NodeHealth
from protocol.held_models import ClusterModelsView, node_models
from protocol.ids import RequestId
from protocol.sharding import ShardingChoice

CARDS_REFRESH_S = 10.0
"""At least this often the model cards' facts are read again: a generation_config.json a card
lacked may have arrived (`node.serving.model_sampling.RETRY_S` paces the search for it)."""


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
        # Every request sent to a peer's entry counts against it (replica choice: `replica_load`).
        counted = instances.loads.counted(remote)
        self.attempts = Attempts(cluster, instances, counted, load_wait_s=load_wait_s)
        """Single tries, here or on a peer; also what peers' forwarded requests run on."""
        attempts = self.attempts
        self._failover = Failover(attempts.open_on, instances.entry_nodes, attempts.cancel, failover)
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

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel a request this node accepted, wherever it runs (or between two attempts)."""
        return await self._failover.cancel(request_id) or await self.attempts.cancel(request_id)

    def instances(self) -> Sequence[InstanceView]:
        return [instance_view(record) for record in self._instances.records()]

    async def place_instance(
        self,
        model: str,
        nodes: int | None,
        *,
        preview: bool,
        replicas: int | None = None,
        sharding: ShardingChoice = "pipeline",
    ) -> PlaceOutcome:
        return await self._instances.request_instance(
            model, nodes, preview=preview, replicas=replicas, sharding=sharding
        )

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
