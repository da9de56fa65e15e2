"""What any node asks the leader: place (or preview) and delete instances; `shoal run --model X`.

The asking node reads the model's shape itself (from its `ShapeCache`, resolving the model on a
miss) and, to place it, hashes its files into a manifest and serves them to the cluster
(`Describer`, `node.cluster_files`): the leader never resolves a model, and the nodes it places the
model on fetch the files from this one. A preview hashes nothing: it sends the manifest only when
one is known already. Every answer is an outcome of `protocol.control_wire`; one that comes back
from the network as anything else is `Unavailable`, like a leader that did not answer.
"""

from __future__ import annotations

import logging
from typing import Protocol, assert_never

import trio

from node.cluster_files import Described
from node.leader_control import LeaderControl
from node.model_shapes import ShapeCache
from node.net.mesh import RequestError
from protocol.cluster import ClusterState
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    DELETE_OUTCOMES,
    PLACE_OUTCOMES,
    ControlMessage,
    ControlWireError,
    DeleteInstance,
    DeleteOutcome,
    Exists,
    Invalid,
    NotFound,
    Placed,
    PlaceInstance,
    PlaceOutcome,
    Unavailable,
    decode_control,
    encode_control,
)
from protocol.election import Decision
from protocol.ids import NodeId
from protocol.model_files import instance_view

log = logging.getLogger("shoal.instances")

ENSURE_ATTEMPTS = 600
"""`ensure` asks at most this many times, about once a second (or at each cluster change): about
10 minutes of a cluster without a leader."""


class AskingCluster(Protocol):
    """What an asking node reads of the cluster (`node.cluster.ClusterService`)."""

    @property
    def me(self) -> NodeId: ...
    @property
    def decision(self) -> Decision: ...
    @property
    def state(self) -> ClusterState: ...
    async def wait_changed(self) -> None: ...


class Requester(Protocol):
    async def request(self, peer_id: str, payload: bytes, protocol: str = ...) -> bytes: ...


class Describer(Protocol):
    """Hashes and serves the models this node places (`node.cluster_files.ClusterFiles`)."""

    async def describe(self, source: str) -> Described: ...
    def known(self, source: str) -> Described | None: ...


class InstanceRequests:
    def __init__(
        self,
        cluster: AskingCluster,
        mesh: Requester,
        leader: LeaderControl,
        shapes: ShapeCache,
        files: Describer | None = None,
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.leader = leader
        self.shapes = shapes
        self.files = files
        """None: place requests carry no manifest, and each stage node resolves the source itself."""

    async def _ask(self, request: PlaceInstance | DeleteInstance) -> ControlMessage:
        """The leader's answer: this node's own when it leads, else over the control protocol."""
        leader = self.cluster.decision.leader
        if leader is None:
            return Unavailable(kind="no_leader", reason="no leader yet: the cluster is still forming")
        if leader == self.cluster.me:
            if isinstance(request, PlaceInstance):
                return await self.leader.place(request)
            return await self.leader.delete(request)
        try:
            payload = await self.mesh.request(leader, encode_control(request), protocol=CONTROL_PROTOCOL)
            return decode_control(payload)
        except (RequestError, ControlWireError) as exc:
            return Unavailable(kind="no_answer", reason=f"the leader {leader} did not answer: {exc}")

    async def place(self, source: str, nodes: int | None, *, preview: bool) -> PlaceOutcome:
        try:
            shape = await self.shapes.get(source)
            described = await self._describe(source, preview=preview)
        except (ValueError, OSError) as exc:  # the model does not resolve, or its files are unreadable
            served = [r for r in self.cluster.state.instances().values() if r.model == source]
            if served and not preview:  # named by its id here, held by another node: it runs already
                return Exists(instance=instance_view(served[0]))
            return NotFound(kind="model", reason=str(exc))
        request = PlaceInstance(
            model=shape.model,
            source=source,
            shape=shape,
            nodes=nodes,
            preview=preview,
            manifest=described.manifest if described else None,
            hub_repo=described.hub_repo if described else "",
        )
        answer = await self._ask(request)
        if isinstance(answer, PLACE_OUTCOMES):
            return answer
        return Unavailable(kind="no_answer", reason=f"the leader answered {answer.type!r} to a place request")

    async def _describe(self, source: str, *, preview: bool) -> Described | None:
        if self.files is None:
            return None
        return self.files.known(source) if preview else await self.files.describe(source)

    async def delete(self, instance_id: str) -> DeleteOutcome:
        answer = await self._ask(DeleteInstance(instance_id=instance_id))
        if isinstance(answer, DELETE_OUTCOMES):
            return answer
        return Unavailable(
            kind="no_answer", reason=f"the leader answered {answer.type!r} to a delete request"
        )

    def _served(self, model: str) -> bool:
        return any(record.model == model for record in self.cluster.state.instances().values())

    async def ensure(self, source: str) -> None:
        """For `shoal run --model X`: once there is a leader, make sure an instance of X exists."""
        try:
            shape = await self.shapes.get(source)
        except ValueError as exc:
            log.error("cannot serve %r: %s", source, exc)
            return
        for attempt in range(ENSURE_ATTEMPTS):
            if self._served(shape.model):
                return
            if self.cluster.decision.leader is not None:
                outcome = await self.place(source, None, preview=False)
                match outcome:
                    case Placed() | Exists():
                        return
                    case NotFound() | Invalid():
                        log.error("cannot place %s: %s", shape.model, outcome.reason)
                        return
                    case Unavailable():
                        log.debug(
                            "placement of %s not done yet (attempt %d): %s",
                            shape.model,
                            attempt,
                            outcome.reason,
                        )
                    case _:
                        assert_never(outcome)
            with trio.move_on_after(1.0):
                await self.cluster.wait_changed()
