"""What any node asks the leader: place (or preview) and delete instances; `shoal run --model X`.

The asking node reads the model's shape itself (from its `ShapeCache`, resolving the model on a
miss) and, to place it, hashes its files into a manifest and serves them to the cluster
(`Describer`, `node.files.cluster`): the leader never resolves a model, and the nodes it places the
model on fetch the files from this one. A preview hashes nothing: it sends the manifest only when
one is known already. Every answer is an outcome of `protocol.control_wire`; one that comes back
from the network as anything else is `Unavailable`, like a leader that did not answer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol, assert_never

import trio

from node.cluster.reader import ClusterReader
from node.control.finder import ModelFinder
from node.control.leader import LeaderControl
from node.control.shapes import ShapeCache
from node.files.cluster import Described
from node.models import ModelResolveError
from node.net.mesh import RequestError
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    DELETE_OUTCOMES,
    PLACE_OUTCOMES,
    ControlMessage,
    ControlWireError,
    Deleted,
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
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.model_files import instance_view
from protocol.placement import ModelShape
from protocol.sharding import ShardingChoice

log = logging.getLogger("shoal.instances")

VISIBLE_WAIT_S = 2.0
"""After the leader answers a change, the asking node answers its client once its own state shows
it (read-your-writes: its next `GET /v1/instances` agrees), or after this long: gossip brings the
record in ~10 ms, and a lost message is healed by the next anti-entropy round (every second)."""
ENSURE_ATTEMPTS = 600
"""`ensure` asks at most this many times, about once a second (or at each cluster change): about
10 minutes of a cluster without a leader."""

LONE_ASK_WAIT_S = 10.0
"""How long `shoal run --model NAME` (a name only the cluster may hold) waits for a first peer
before asking a cluster of itself alone: a node started with `--peer` on a loaded machine may see
its first gossip after its 3 s startup grace."""


class AskingCluster(ClusterReader, Protocol):
    """What an asking node reads of the cluster (`node.cluster.service.ClusterService`)."""

    @property
    def decision(self) -> Decision: ...
    def alive_memory(self) -> dict[NodeId, int]: ...
    async def wait_changed(self) -> None: ...


class Requester(Protocol):
    async def request(self, peer_id: str, payload: bytes, protocol: str = ...) -> bytes: ...


class Describer(Protocol):
    """Hashes and serves the models this node places (`node.files.cluster.ClusterFiles`)."""

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
        finder: ModelFinder | None = None,
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.leader = leader
        self.shapes = shapes
        self.files = files
        """None: place requests carry no manifest, and each stage node resolves the source itself."""
        self.finder = finder
        """Models this node cannot resolve, from the peers that hold them by name; None: no asking."""

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

    async def read_model(self, source: str, *, preview: bool) -> tuple[ModelShape, Described | None]:
        """The shape `source` is placed with and, unless a preview finds none known, its files.

        What this node resolves itself (the built-in, a path, a model of its data dir) comes first;
        any other name (one the cluster shows, a repo id) from the node that holds it under that
        name (`node.control.finder`), else resolved here (a repo id is downloaded). Raises
        `ValueError` (the model does not resolve) or `OSError` (its files are unreadable)."""
        return await self._read_model(source, preview=preview, asked=not await self._resolves_here(source))

    async def _resolves_here(self, source: str) -> bool:
        return self.finder is None or await self.finder.resolves_here(source)

    async def _read_model(
        self, source: str, *, preview: bool, asked: bool
    ) -> tuple[ModelShape, Described | None]:
        """`read_model` once the caller knows whether `source` is asked of the cluster (`asked`)."""
        if asked and self.finder is not None and (found := await self.finder.find(source)) is not None:
            return found.shape, Described(found.manifest, found.hub_repo, found.model)
        try:
            shape = await self.shapes.get(source)
        except ValueError as exc:
            if asked:
                raise ValueError(f"{exc}; nor does any node of the cluster hold {source!r}") from exc
            raise
        described = await self._describe(source, preview=preview)
        if described is not None and described.name and described.name != shape.model:
            shape = dataclasses.replace(shape, model=ModelId(described.name))  # a clashing name
        return shape, described

    async def place(
        self,
        source: str,
        nodes: int | None,
        *,
        preview: bool,
        replicas: int | None = None,
        sharding: ShardingChoice = "pipeline",
    ) -> PlaceOutcome:
        try:
            shape, described = await self.read_model(source, preview=preview)
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
            replicas=replicas,
            sharding=sharding,
        )
        answer = await self._ask(request)
        if isinstance(answer, Placed | Exists) and not preview:
            await self._until_seen(answer.instance.id, present=True)
        if isinstance(answer, PLACE_OUTCOMES):
            return answer
        return Unavailable(kind="no_answer", reason=f"the leader answered {answer.type!r} to a place request")

    async def _describe(self, source: str, *, preview: bool) -> Described | None:
        if self.files is None:
            return None
        return self.files.known(source) if preview else await self.files.describe(source)

    async def delete(self, instance_id: str) -> DeleteOutcome:
        answer = await self._ask(DeleteInstance(instance_id=instance_id))
        if isinstance(answer, Deleted):
            await self._until_seen(answer.instance.id, present=False)
        if isinstance(answer, DELETE_OUTCOMES):
            return answer
        return Unavailable(
            kind="no_answer", reason=f"the leader answered {answer.type!r} to a delete request"
        )

    async def _until_seen(self, instance_id: str, *, present: bool) -> None:
        """Return once this node's state has `instance_id` (`present`) or has it no more, at most
        `VISIBLE_WAIT_S` later; at once on the leader, which wrote it."""
        with trio.move_on_after(VISIBLE_WAIT_S):
            while (InstanceId(instance_id) in self.cluster.state.instances()) != present:
                await self.cluster.wait_changed()

    def _served(self, model: str) -> int:
        return sum(record.model == model for record in self.cluster.state.instances().values())

    async def _ensure_shape(self, source: str) -> ModelShape:
        """The shape `ensure` places `source` with: read here at once, or for a name only the
        cluster may hold, asked once the cluster has a leader (it has formed). `ModelResolveError`
        when neither this node nor any other has it, or it cannot be read."""
        try:
            if not await self._resolves_here(source):
                return await self._asked_shape(source)
            return await self.shapes.get(source)
        except (ValueError, OSError) as exc:
            raise ModelResolveError(f"cannot serve {source!r}: {exc}") from exc

    async def _asked_shape(self, source: str) -> ModelShape:
        """The shape of a name only the cluster may hold: asked once the cluster has formed, and
        again whenever another peer comes alive, until `LONE_ASK_WAIT_S` after the start. The
        leader's gossip may come before the holder's, and one pass over the peers alive then would
        find nobody holding it. `ValueError` when nobody does by then."""
        give_up_at = trio.current_time() + LONE_ASK_WAIT_S
        await self._until_formed()
        asked_of: frozenset[NodeId] | None = None
        missing: ValueError | None = None
        for _wait in range(ENSURE_ATTEMPTS):
            if (alive := frozenset(self.cluster.view.alive())) != asked_of:
                asked_of = alive
                try:
                    return (await self._read_model(source, preview=False, asked=True))[0]
                except ValueError as exc:
                    missing = exc
            if trio.current_time() >= give_up_at:
                break
            with trio.move_on_after(1.0):
                await self.cluster.wait_changed()
        assert missing is not None
        raise missing

    async def _until_formed(self) -> None:
        """Until the cluster can be asked: a leader, and a peer alive, or `LONE_ASK_WAIT_S` passed
        (a node alone). A node whose first gossip comes late elects itself after the startup grace
        and, asking at once, would ask nobody and stop."""
        lone_from = trio.current_time() + LONE_ASK_WAIT_S
        for _wait in range(ENSURE_ATTEMPTS):
            if self.cluster.decision.leader is not None and (
                self.cluster.view.alive() or trio.current_time() >= lone_from
            ):
                return
            with trio.move_on_after(1.0):
                await self.cluster.wait_changed()

    async def ensure(self, source: str, replicas: int = 1, sharding: ShardingChoice = "pipeline") -> None:
        """For `shoal run --model X --replicas N`: once there is a leader, make sure X has N instances.
        While fewer fit, it asks again each time the number of live nodes changes (one joined: room
        for another), within the same `ENSURE_ATTEMPTS`; while none fits, it says so and waits the
        same way. Raises `ModelResolveError` when X can never be served (it does not resolve, its
        import fails, its files are unreadable): `shoal run` then stops with exit 2 and the reason."""
        shape = await self._ensure_shape(source)
        asked_with: int | None = None
        """How many nodes were alive when the leader last placed what fit."""
        for attempt in range(ENSURE_ATTEMPTS):
            if self._served(shape.model) >= replicas:
                return
            alive = len(self.cluster.alive_memory())
            if self.cluster.decision.leader is not None and alive != asked_with:
                outcome = await self.place(
                    source,
                    None,
                    preview=False,
                    replicas=replicas if replicas > 1 else None,
                    sharding=sharding,
                )
                match outcome:
                    case Placed() | Exists():
                        if replicas == 1:
                            return
                        asked_with = alive
                    case Invalid(kind="does_not_fit"):
                        log.warning(
                            "%s does not fit the nodes alive now (%s); waiting for more nodes to join",
                            shape.model,
                            outcome.reason,
                        )
                        asked_with = alive
                    case NotFound() | Invalid():
                        raise ModelResolveError(f"cannot place {shape.model}: {outcome.reason}")
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
        log.warning("gave up asking for %s after %d attempts", shape.model, ENSURE_ATTEMPTS)
