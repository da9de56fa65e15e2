"""The leader's side of instances: place, preview and delete on request; re-place what lost a node.

Only the leader writes instance records: `protocol.placement` decides, the cluster state
replicates them, so a leader change keeps every instance. Each answer is an outcome of
`protocol.control_wire`, never an HTTP status. The leader never resolves a model: a place request
carries the shape and manifest the requesting node read, the record keeps them, and a repair (by
this leader or the next) re-places with the record's own. Placement prefers the nodes that hold the
model's files (their `NodeHoldings`). A model may have replicas: instances on disjoint sets of
nodes, placed as many as fit when a request asks for them, and re-placed like any instance, away
from the other replicas. Repair runs one task per instance that lost a node; one that cannot be
re-placed is tried again after a backoff, not on every pass of the loop. A request for "auto"
sharding is decided here, on the round trips the nodes measured (`protocol.auto_sharding`), and a
cluster with a secret refuses tensor sharding when the leader's tensor links cannot seal frames.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import secrets
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

import trio

from node.cluster.reader import ClusterReader
from protocol.auto_sharding import AutoChoice, choose_sharding, worst_round_trip
from protocol.backoff import Backoff, BackoffPolicy
from protocol.cluster import NotLeaderError
from protocol.cluster_records import InstanceRecord
from protocol.control_wire import (
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
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import Manifest
from protocol.membership import Status, View
from protocol.model_files import held_bytes, instance_view
from protocol.placement import ModelShape, Placement, PlacementError, place_replicas
from protocol.sharding import Sharding, ShardingChoice

log = logging.getLogger("shoal.instances")

PLACEMENT_HEADROOM = 0.1
"""Fraction of a node's available memory placement leaves free (OS, activations, other programs)."""
UNSEALED_TENSOR = (
    "this cluster has a secret, and the leader's tensor-parallel links cannot seal their frames "
    "(its native kernels were built without OpenSSL's libcrypto); use sharding 'pipeline'"
)
AUTO_MEASURE_WAIT_S = 5.0
"""How long an "auto" placement (not a preview) waits for a round trip its nodes have not measured
yet: a node that just joined is measured within a second or two, so `shoal run --sharding auto` on
nodes started together decides on figures, not on their absence. Well within a control request's
10 s."""
REPAIR_RETRY = BackoffPolicy(min_s=2.0, max_s=60.0)
"""An instance that cannot be re-placed (no room left, an unreadable model) waits 2 s, 4 s ... 60 s
between tries: a node joining or memory freeing up is picked up within a minute."""


class LeaderCluster(ClusterReader, Protocol):
    """What the leader reads and writes of the cluster (`node.cluster.service.ClusterService`)."""

    @property
    def is_leader(self) -> bool: ...
    def alive_memory(self) -> dict[NodeId, int]: ...
    async def put_instance(self, record: InstanceRecord) -> None: ...
    async def remove_instance(self, instance_id: InstanceId) -> None: ...
    async def wait_changed(self) -> None: ...


def new_instance_id(model: str) -> InstanceId:
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[-40:] or "model"
    return InstanceId(f"{slug}-{secrets.token_hex(3)}")


def lost_nodes(record: InstanceRecord, me: NodeId, view: View) -> list[NodeId]:
    """The nodes of `record` this node's failure detector calls dead or gone (never itself)."""
    return [
        s.node for s in record.stages if s.node != me and view.status(s.node) in (Status.DEAD, Status.LEFT)
    ]


def nodes_of(records: Iterable[InstanceRecord]) -> set[NodeId]:
    """Every node that runs a stage of one of `records` (a model's replicas: new ones go elsewhere)."""
    return {stage.node for record in records for stage in record.stages}


def _exists(running: list[InstanceRecord], requested: int | None) -> Exists:
    views = tuple(instance_view(r) for r in running)
    return Exists(instance=views[0], replicas=views, requested=requested)


def _resolved(sharding: ShardingChoice) -> Sharding:
    """`sharding` when it is one ("auto" is decided by `LeaderControl._auto` before this)."""
    return "tensor" if sharding == "tensor" else "pipeline"


def _not_leader(still: str = "") -> Unavailable:
    return Unavailable(kind="not_leader", reason=f"this node is {still}not the leader")


class LeaderControl:
    def __init__(
        self,
        cluster: LeaderCluster,
        *,
        rand: Callable[[], float] = random.random,
        unsealed_tensor: bool = False,
    ) -> None:
        self.cluster = cluster
        self._unsealed_tensor = unsealed_tensor
        """The cluster has a secret, and tensor-parallel links here cannot seal their frames."""
        self._rand = rand
        self._repairing: set[InstanceId] = set()
        self._retries: dict[InstanceId, Backoff] = {}

    def _records(self) -> list[InstanceRecord]:
        return sorted(self.cluster.state.instances().values(), key=lambda r: r.instance_id)

    def _plan(
        self,
        shape: ModelShape,
        manifest: Manifest | None,
        nodes: int | None = None,
        *,
        count: int = 1,
        exclude: Collection[NodeId] = (),
        sharding: Sharding = "pipeline",
    ) -> list[Placement]:
        """Where `count` instances of `shape` go on the nodes alive now but `exclude`, each on nodes
        of its own, holders of `manifest`'s files first: as many as fit (PlacementError: none)."""
        held = held_bytes(manifest, self.cluster.state.holdings()) if manifest is not None else {}
        memory = sorted(self.cluster.alive_memory().items())
        return place_replicas(
            shape,
            memory,
            count,
            exclude=exclude,
            headroom=PLACEMENT_HEADROOM,
            nodes_wanted=nodes,
            held=held,
            sharding=sharding,
        )

    async def place(self, request: PlaceInstance) -> PlaceOutcome:
        """One instance per model (`Exists` when it runs), or with `replicas`, the missing ones."""
        if not self.cluster.is_leader:
            return _not_leader()
        running = [r for r in self._records() if r.model == request.model]
        if request.replicas is None and running and not request.preview:
            return Exists(instance=instance_view(running[0]))
        missing = 1 if request.replicas is None else request.replicas - len(running)
        if missing <= 0:
            return _exists(running, request.replicas)
        exclude = nodes_of(running) if request.replicas is not None else set()
        if request.sharding == "tensor" and self._unsealed_tensor:
            return Invalid(kind="unsupported", reason=UNSEALED_TENSOR)
        chosen = await self._auto(request, exclude) if request.sharding == "auto" else None
        try:
            plans = self._plan(
                request.shape,
                request.manifest,
                request.nodes,
                count=missing,
                exclude=exclude,
                sharding=chosen.sharding if chosen else _resolved(request.sharding),
            )
        except PlacementError as exc:
            if request.replicas is None or not running:
                return Invalid(kind="does_not_fit", reason=str(exc))
            log.info("no further replica of %s fits: %s", request.model, exc)
            return _exists(running, request.replicas)
        records = [
            InstanceRecord(
                new_instance_id(request.model),
                ModelId(request.model),
                plan.stages,
                request.source,
                request.manifest,
                request.shape,
                request.hub_repo,
                plan.sharding,
            )
            for plan in plans
        ]
        if not request.preview:
            try:
                for record in records:
                    await self.cluster.put_instance(record)
            except NotLeaderError:
                return _not_leader("no longer ")
            for record in records:
                log.info(
                    "placed instance %s of %s on %d node(s)",
                    record.instance_id,
                    record.model,
                    len(record.stages),
                )
        if request.replicas is not None and len(records) < missing:
            log.info("placed %d of the %d missing replicas of %s", len(records), missing, request.model)
        replicas = tuple(instance_view(r) for r in [*running, *records]) if request.replicas else ()
        return Placed(
            instance=instance_view(records[0]),
            stage_bytes=plans[0].bytes_per_stage,
            preview=request.preview,
            replicas=replicas,
            requested=request.replicas,
            sharding_reason=chosen.reason if chosen else "",
        )

    async def _auto(self, request: PlaceInstance, exclude: Collection[NodeId]) -> AutoChoice:
        """Tensor or pipeline for an "auto" request: the rule on a tensor plan's nodes, if one fits,
        once they measured their round trips (waited for up to `AUTO_MEASURE_WAIT_S`)."""
        if self._unsealed_tensor:
            return AutoChoice("pipeline", f"pipeline: {UNSEALED_TENSOR.split(';')[0]}")
        try:
            plan = self._plan(
                request.shape, request.manifest, request.nodes, exclude=exclude, sharding="tensor"
            )[0]
        except PlacementError as exc:
            return AutoChoice("pipeline", f"pipeline: no tensor-parallel placement ({exc})")
        nodes = [stage.node for stage in plan.stages]
        with trio.move_on_after(0 if request.preview else AUTO_MEASURE_WAIT_S):
            while worst_round_trip(self._links(), nodes) is None:
                await self.cluster.wait_changed()
        choice = choose_sharding(request.shape, len(nodes), worst_round_trip(self._links(), nodes))
        log.info("sharding for %s: %s", request.model, choice.reason)
        return choice

    def _links(self) -> dict[NodeId, dict[NodeId, int]]:
        """The round trips (us) each node measured to the others, from their profiles."""
        return {node: {t.node: t.us for t in p.links} for node, p in self.cluster.state.profiles().items()}

    async def delete(self, request: DeleteInstance) -> DeleteOutcome:
        if not self.cluster.is_leader:
            return _not_leader()
        record = self.cluster.state.instances().get(InstanceId(request.instance_id))
        if record is None:
            return NotFound(kind="instance", reason=f"no instance {request.instance_id!r}")
        try:
            await self.cluster.remove_instance(record.instance_id)
        except NotLeaderError:
            return _not_leader("no longer ")
        return Deleted(instance=instance_view(record))

    # --- repair ------------------------------------------------------------------------------
    def repair_nowait(self, nursery: trio.Nursery) -> None:
        """Start re-placing each instance that lost a node, unless under way or waiting to retry."""
        now = trio.current_time()
        records = self._records()
        for gone in set(self._retries) - {r.instance_id for r in records}:
            del self._retries[gone]
        for record in records:
            lost = lost_nodes(record, self.cluster.me, self.cluster.view)
            retry = self._retries.get(record.instance_id)
            if not lost or record.instance_id in self._repairing or (retry and not retry.due(now)):
                continue
            self._repairing.add(record.instance_id)
            nursery.start_soon(self._repair, record, lost)

    async def _repair(self, record: InstanceRecord, lost: list[NodeId]) -> None:
        """Re-place `record` on the nodes alive now, if it still fits and nobody changed it meanwhile."""
        iid = record.instance_id
        try:
            if record.shape is None:
                raise PlacementError("the record carries no model shape (it was placed by an older node)")
            others = [r for r in self._records() if r.model == record.model and r.instance_id != iid]
            plan = self._plan(
                record.shape, record.manifest, exclude=nodes_of(others), sharding=record.sharding
            )[0]
            replaced = dataclasses.replace(record, stages=plan.stages)
            if self.cluster.state.instances().get(iid) == record and replaced != record:
                await self.cluster.put_instance(replaced)
                log.info("re-placed instance %s on %s", iid, [s.node for s in plan.stages])
            self._retries.pop(iid, None)
        except NotLeaderError:
            pass  # the new leader repairs it
        except PlacementError as exc:
            retry = self._retries.setdefault(iid, Backoff(REPAIR_RETRY, rand=self._rand))
            delay = retry.failed(trio.current_time())
            log.warning(
                "instance %s lost %s and cannot be re-placed: %s (trying again in %.0fs)",
                iid,
                lost,
                exc,
                delay,
            )
        finally:
            self._repairing.discard(iid)
