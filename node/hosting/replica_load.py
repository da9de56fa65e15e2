"""This node's side of choosing a replica: the load it reports of the instances it is the entry of,
the requests it has open to each entry, and the order `protocol.replicas` makes of them.

`DispatchCounts` counts, per model and entry node, the streams open through this node: those it
sent to a peer's entry (`CountedRemote`) and those its own runners take, from its clients or its
peers (`CountedRunner`). A stream counts from the moment it is entered, before any wait, so the next request's
choice already sees it. `ReplicaLoads.own_load` is the `NodeLoad` record this node gossips (with
each heartbeat, when it changed); `ReplicaLoads.entry_nodes` is `InstanceManager.entry_nodes`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, _AsyncGeneratorContextManager, asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

from node.cluster.reader import ClusterReader
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.chat import GenerateRequest
from protocol.cluster_records import EntryLoad, InstanceRecord, NodeLoad
from protocol.events import ChunkEvent
from protocol.ids import NodeId, RequestId
from protocol.record_limits import MAX_ENTRY_LOADS, MAX_ERROR_CHARS
from protocol.replicas import order_replicas, replicas_of

if TYPE_CHECKING:
    from node.serving.backend import RemoteStreams

T = TypeVar("T")


class DispatchCounts:
    """Streams open through this node, per (model, entry node), and how many were ever opened."""

    def __init__(self) -> None:
        self._open: Counter[tuple[str, NodeId]] = Counter()
        self._opened: Counter[tuple[str, NodeId]] = Counter()

    def open_to(self, model: str) -> dict[NodeId, int]:
        return {node: n for (m, node), n in self._open.items() if m == model and n > 0}

    def active(self, model: str, node: NodeId) -> int:
        return self._open[(model, node)]

    def opened(self, model: str, node: NodeId) -> int:
        return self._opened[(model, node)]

    def opened_to(self, model: str) -> dict[NodeId, int]:
        return {node: n for (m, node), n in self._opened.items() if m == model}

    @asynccontextmanager
    async def track(
        self, model: str, node: NodeId, stream: AbstractAsyncContextManager[T]
    ) -> AsyncIterator[T]:
        """`stream`, counted while it is open (from before it is entered until it is left)."""
        key = (model, node)
        self._open[key] += 1
        self._opened[key] += 1
        try:
            async with stream as events:
                yield events
        finally:
            self._open[key] -= 1


class CountedRemote:
    """`RemoteStreams` whose every stream counts in `counts` against its entry node."""

    def __init__(self, remote: RemoteStreams, counts: DispatchCounts) -> None:
        self._remote = remote
        self._counts = counts

    def open_stream(
        self, entry_node: str, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        inner = self._remote.open_stream(entry_node, request)
        return self._counts.track(request.model, NodeId(entry_node), inner)

    async def cancel(self, request_id: RequestId) -> bool:
        return await self._remote.cancel(request_id)


class CountedRunner(RunnerSupervisor):
    """A runner whose every stream (a client's of this node, or a peer's) counts in `counts`."""

    def __init__(self, spec: RunnerSpec, counts: DispatchCounts, me: NodeId) -> None:
        super().__init__(spec)
        self._counts = counts
        self._me = me

    def open_stream(
        self, request: GenerateRequest
    ) -> _AsyncGeneratorContextManager[AsyncIterator[ChunkEvent]]:
        return self._counts.track(self.spec.model_id, self._me, super().open_stream(request))


class ReplicaLoads:
    def __init__(
        self,
        cluster: ClusterReader,
        records: Callable[[], list[InstanceRecord]],
        local_runner: Callable[[str], RunnerSupervisor | None],
    ) -> None:
        self.cluster = cluster
        self.counts = DispatchCounts()
        self._records = records
        self._local_runner = local_runner

    def counted(self, remote: RemoteStreams) -> CountedRemote:
        """`remote`, each of its streams counted against its entry node."""
        return CountedRemote(remote, self.counts)

    def runner(self, spec: RunnerSpec) -> RunnerSupervisor:
        """A runner whose streams count as this entry's load (`HostedInstances`' runner factory)."""
        return CountedRunner(spec, self.counts, self.cluster.me)

    def own_load(self) -> NodeLoad:
        """The instances this node is the entry of, as they are now: ready, requests in them."""
        me = self.cluster.me
        entries = []
        for record in self._records():
            if record.stages[0].node != me:
                continue
            runner = self._local_runner(record.model)
            health = runner.health() if runner is not None else None
            entries.append(
                EntryLoad(
                    record.instance_id,
                    runner=health.state if health is not None else None,
                    active=self.counts.active(record.model, me),
                    queued=health.queued_requests if health is not None else 0,
                    served=self.counts.opened(record.model, me),
                    error=(health.error or "")[:MAX_ERROR_CHARS] if health is not None else "",
                )
            )
        return NodeLoad(tuple(entries[:MAX_ENTRY_LOADS]))

    def entry_nodes(self, model: str) -> list[NodeId]:
        """The entry nodes of `model`'s instances, best first (`protocol.replicas.order_replicas`)."""
        me = self.cluster.me
        loads = {**self.cluster.state.loads(), me: self.own_load()}
        alive = self.cluster.view.live()  # a suspect still takes requests: suspicion is only a hint
        counts = self.counts
        found = replicas_of(
            model, self._records(), loads, alive, me, counts.open_to(model), counts.opened_to(model)
        )
        return [replica.entry for replica in order_replicas(found, me)]
