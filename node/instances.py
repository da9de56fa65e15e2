"""Instances: the leader places models on nodes; every node runs the runners its stages need.

- Any node asks for an instance (`POST /v1/instances`, `shoal run --model X`): it resolves the model
  itself (to read its shape) and sends a `PlaceInstance` to the leader over the control protocol.
- The leader alone decides (`protocol.placement.place`) and writes the instance record; it also
  re-places an instance whose node died, on the survivors, when it still fits.
- Every node reconciles its runners with the records that name it: start what is new, stop what went.
A leader change keeps instances: records live in the replicated state, not in the leader.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from node.cluster import ClusterService
from node.models import ResolvedModel, resolve_model
from node.models.shape import model_shape
from node.net.mesh import Mesh, RequestError
from node.runner.fastpath import runner_environment
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from node.stages import StageRoute, run_entry, run_stage_process
from protocol.cluster import NotLeaderError
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.cluster_view import InstanceView, StageView
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    ControlAnswer,
    ControlWireError,
    DeleteInstance,
    PlaceInstance,
    StageAddress,
    StageAddressAnswer,
    decode_control,
    encode_control,
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.membership import Status
from protocol.placement import ModelShape, PlacementError, place

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.instances")

PLACEMENT_HEADROOM = 0.1
"""Fraction of a node's available memory placement leaves free (OS, activations, other programs)."""


@dataclass(frozen=True)
class InstanceOptions:
    data_dir: Path
    runtime_dtype_bytes: int | None
    """4 on the CPU (activations, and weights the kernels cannot hold, are float32 there); None keeps
    the stored dtype (GPU)."""
    kernels: bool
    """Whether runners keep 4/8-bit and 16-bit weights as stored on the CPU kernels (placement
    then counts those at their stored size)."""
    runner_spec: Callable[[ModelId, Path], RunnerSpec]
    """How this node runs a model it was given: the runner settings of `shoal run`'s flags."""


@dataclass
class _Local:
    record: InstanceRecord
    runner: RunnerSupervisor | None
    """This node's runner: a 1-stage instance's, or a pipeline's first stage (once stages answer)."""
    scope: trio.CancelScope
    stage_address: str | None = None
    """HOST:PORT of this node's (non-first) pipeline stage process, once it is ready."""


def _reachable_host(addrs: list[str]) -> str:
    """The IP peers reach us on, from our p2p multiaddrs (/ip4/IP/...): a non-loopback one if any."""
    ips = [a.split("/")[2] for a in addrs if a.startswith("/ip4/") and a.split("/")[2] != "0.0.0.0"]
    public = [ip for ip in ips if not ip.startswith("127.")]
    return (public or ips or ["127.0.0.1"])[0]


def instance_view(record: InstanceRecord) -> InstanceView:
    stages = tuple(
        StageView(node_id=s.node, start_layer=s.start_layer, end_layer=s.end_layer) for s in record.stages
    )
    return InstanceView(id=record.instance_id, model=record.model, stages=stages)


def _new_instance_id(model: str) -> InstanceId:
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[-40:] or "model"
    return InstanceId(f"{slug}-{secrets.token_hex(3)}")


class InstanceManager:
    def __init__(self, cluster: ClusterService, mesh: Mesh, options: InstanceOptions) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.options = options
        self._local: dict[InstanceId, _Local] = {}
        self._shapes: dict[str, ModelShape] = {}
        self._nursery: trio.Nursery | None = None

    # --- reads for the backend ---------------------------------------------------------------
    def runners(self) -> list[RunnerSupervisor]:
        return [local.runner for local in self._local.values() if local.runner is not None]

    def local_runner(self, model: str) -> RunnerSupervisor | None:
        for local in self._local.values():
            first = local.record.stages[0].node == self.cluster.me
            if local.record.model == model and first and local.runner is not None:
                return local.runner
        return None

    def records(self) -> list[InstanceRecord]:
        return sorted(self.cluster.state.instances().values(), key=lambda r: r.instance_id)

    def entry_node(self, model: str) -> NodeId | None:
        """The node that takes requests for `model`: the first stage of its instance."""
        for record in self.records():
            if record.model == model:
                return record.stages[0].node
        return None

    # --- the service -------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.mesh.set_request_handler(self._answer_control, protocol=CONTROL_PROTOCOL)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._reconcile()
                if self.cluster.is_leader:
                    await self._repair()
                with trio.move_on_after(1.0):  # also re-check periodically: deaths come from ticks
                    await self.cluster.wait_changed()

    async def _reconcile(self) -> None:
        """Make the local runners match the records that give this node the first stage."""
        assert self._nursery is not None
        wanted = {
            iid: record
            for iid, record in self.cluster.state.instances().items()
            if any(stage.node == self.cluster.me for stage in record.stages)
        }
        for iid in [iid for iid, local in self._local.items() if wanted.get(iid) != local.record]:
            log.info("stopping the runner of instance %s", iid)
            self._local.pop(iid).scope.cancel()
        for iid, record in wanted.items():
            if iid in self._local:
                continue
            resolved = await self._resolve(record.source or record.model)
            if resolved is None or self.cluster.state.instances().get(iid) != record:
                continue
            if len(record.stages) > 1:
                scope = trio.CancelScope()
                local = _Local(record, None, scope)
                self._local[iid] = local
                mine = next(s for s in record.stages if s.node == self.cluster.me)
                if mine is record.stages[0]:
                    self._nursery.start_soon(self._run_entry, local, resolved.path)
                else:
                    self._nursery.start_soon(self._run_stage, local, resolved.path, mine)
                log.info(
                    "instance %s: running layers [%d, %d) of %s here",
                    iid,
                    mine.start_layer,
                    mine.end_layer,
                    record.model,
                )
                continue
            runner = RunnerSupervisor(self.options.runner_spec(ModelId(record.model), resolved.path))
            scope = trio.CancelScope()
            self._local[iid] = _Local(record, runner, scope)
            self._nursery.start_soon(self._run_runner, runner, scope)
            log.info("instance %s: running %s here", iid, record.model)

    @staticmethod
    async def _run_runner(runner: RunnerSupervisor, scope: trio.CancelScope) -> None:
        with scope:
            await InstanceManager._serve(runner)

    @staticmethod
    async def _serve(runner: RunnerSupervisor) -> None:
        try:
            await runner.run()
        finally:
            # Stopped because the instance went away or changed: requests still streaming from this
            # runner get their terminal error now instead of waiting forever.
            runner.fail_in_flight("the model's instance was stopped or re-placed on this node")

    # --- pipelines ---------------------------------------------------------------------------
    async def _run_stage(self, local: _Local, path: Path, stage: StageAssignment) -> None:
        """Run this node's stage process of a pipeline until the instance goes away or changes."""
        spec = self.options.runner_spec(local.record.model, path)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        env.update(runner_environment(env, enabled=spec.fast_path))

        def publish(address: str | None) -> None:
            local.stage_address = address

        with local.scope:
            host = _reachable_host(self.mesh.addrs())
            await run_stage_process(
                path, stage, host=host, env=env, publish=publish, instance=local.record.instance_id
            )

    async def _run_entry(self, local: _Local, path: Path) -> None:
        """The first stage: the runner in pipeline mode, with the later stages' current addresses."""
        record = local.record
        base = self.options.runner_spec(record.model, path)
        host = _reachable_host(self.mesh.addrs())

        def runner_for(route: tuple[str, ...]) -> RunnerSupervisor:
            return RunnerSupervisor(
                dataclasses.replace(base, pipeline=(record.stages[0].end_layer, host, route))
            )

        def publish(runner: RunnerSupervisor | None) -> None:
            local.runner = runner

        with local.scope:
            await run_entry(StageRoute(self.mesh, record), runner_for, self._serve, publish)

    def _answer_stage_address(self, question: StageAddress) -> StageAddressAnswer:
        local = self._local.get(InstanceId(question.instance_id))
        if local is None or question.nodes != tuple(s.node for s in local.record.stages):
            return StageAddressAnswer(address=None)
        if not any(
            s.node == self.cluster.me
            and (s.start_layer, s.end_layer) == (question.start_layer, question.end_layer)
            for s in local.record.stages
        ):
            return StageAddressAnswer(address=None)
        return StageAddressAnswer(address=local.stage_address)

    async def _resolve(self, source: str) -> ResolvedModel | None:
        try:
            return await trio.to_thread.run_sync(resolve_model, source, self.options.data_dir)
        except ValueError as exc:  # ModelResolveError: reported, the instance stays unserved here
            log.error("cannot resolve model %r: %s", source, exc)
            return None

    async def shape_of(self, source: str) -> tuple[ResolvedModel, ModelShape]:
        resolved = await trio.to_thread.run_sync(resolve_model, source, self.options.data_dir)
        if source not in self._shapes:
            self._shapes[source] = await trio.to_thread.run_sync(
                lambda: model_shape(
                    resolved.name,
                    resolved.path,
                    runtime_dtype_bytes=self.options.runtime_dtype_bytes,
                    kernels=self.options.kernels,
                )
            )
        return resolved, self._shapes[source]

    # --- the leader's side -------------------------------------------------------------------
    async def _answer_control(self, peer_id: str, payload: bytes) -> bytes:
        try:
            message = decode_control(payload)
        except ControlWireError as exc:
            return encode_control(ControlAnswer(status=400, error=str(exc)))
        if isinstance(message, PlaceInstance):
            return encode_control(await self.place(message))
        if isinstance(message, DeleteInstance):
            return encode_control(await self.delete(message))
        if isinstance(message, StageAddress):
            return encode_control(self._answer_stage_address(message))
        return encode_control(ControlAnswer(status=400, error="not a control request"))

    async def place(self, request: PlaceInstance) -> ControlAnswer:
        if not self.cluster.is_leader:
            return ControlAnswer(status=409, error="this node is not the leader")
        for record in self.records():
            if record.model == request.model and not request.preview:
                return ControlAnswer(status=200, instance=instance_view(record))
        try:
            plan = place(
                request.shape,
                sorted(self.cluster.alive_memory().items()),
                headroom=PLACEMENT_HEADROOM,
                nodes_wanted=request.nodes,
            )
        except PlacementError as exc:
            return ControlAnswer(status=422, error=str(exc))
        self._shapes.setdefault(request.source, request.shape)
        record = InstanceRecord(
            _new_instance_id(request.model), ModelId(request.model), plan.stages, request.source
        )
        if not request.preview:
            try:
                await self.cluster.put_instance(record)
            except NotLeaderError:
                return ControlAnswer(status=409, error="this node is no longer the leader")
            log.info(
                "placed instance %s of %s on %d node(s)", record.instance_id, record.model, len(record.stages)
            )
        return ControlAnswer(
            status=200 if request.preview else 201,
            instance=instance_view(record),
            stage_bytes=plan.bytes_per_stage,
        )

    async def delete(self, request: DeleteInstance) -> ControlAnswer:
        if not self.cluster.is_leader:
            return ControlAnswer(status=409, error="this node is not the leader")
        record = self.cluster.state.instances().get(InstanceId(request.instance_id))
        if record is None:
            return ControlAnswer(status=404, error=f"no instance {request.instance_id!r}")
        try:
            await self.cluster.remove_instance(record.instance_id)
        except NotLeaderError:
            return ControlAnswer(status=409, error="this node is no longer the leader")
        return ControlAnswer(status=200, instance=instance_view(record))

    async def _repair(self) -> None:
        """Re-place instances that lost a node, on the nodes alive now (when the model still fits)."""
        view = self.cluster.view
        for record in self.records():
            lost = [
                s.node
                for s in record.stages
                if s.node != self.cluster.me and view.status(s.node) in (Status.DEAD, Status.LEFT)
            ]
            if not lost:
                continue
            source = record.source or record.model
            try:
                _, shape = await self.shape_of(source)
                plan = place(shape, sorted(self.cluster.alive_memory().items()), headroom=PLACEMENT_HEADROOM)
            except (ValueError, PlacementError) as exc:
                log.warning("instance %s lost %s and cannot be re-placed: %s", record.instance_id, lost, exc)
                continue
            replaced = InstanceRecord(record.instance_id, record.model, plan.stages, record.source)
            if replaced != record and self.cluster.is_leader:
                await self.cluster.put_instance(replaced)
                log.info("re-placed instance %s on %s", record.instance_id, [s.node for s in plan.stages])

    # --- what any node asks the leader -------------------------------------------------------
    async def ask_leader(self, request: PlaceInstance | DeleteInstance) -> ControlAnswer:
        leader = self.cluster.decision.leader
        if leader is None:
            return ControlAnswer(status=503, error="no leader yet: the cluster is still forming")
        if leader == self.cluster.me:
            return await (self.place(request) if isinstance(request, PlaceInstance) else self.delete(request))
        try:
            answer = decode_control(
                await self.mesh.request(leader, encode_control(request), protocol=CONTROL_PROTOCOL)
            )
        except (RequestError, ControlWireError) as exc:
            return ControlAnswer(status=503, error=f"the leader {leader} did not answer: {exc}")
        return answer if isinstance(answer, ControlAnswer) else ControlAnswer(status=502, error="bad answer")

    async def request_instance(self, source: str, nodes: int | None, *, preview: bool) -> ControlAnswer:
        try:
            resolved, shape = await self.shape_of(source)
        except ValueError as exc:
            return ControlAnswer(status=404, error=str(exc))
        return await self.ask_leader(
            PlaceInstance(model=resolved.name, source=source, shape=shape, nodes=nodes, preview=preview)
        )

    async def ensure_instance(self, source: str) -> None:
        """For `shoal run --model X`: once there is a leader, make sure an instance of X exists."""
        try:
            resolved, _ = await self.shape_of(source)
        except ValueError as exc:
            log.error("cannot serve %r: %s", source, exc)
            return
        for attempt in range(600):  # about 10 minutes of a cluster without a leader at most
            if self.entry_node(resolved.name) is not None:
                return
            if self.cluster.decision.leader is not None:
                answer = await self.request_instance(source, None, preview=False)
                if answer.status in (200, 201):
                    return
                if answer.status in (404, 422):
                    log.error("cannot place %s: %s", resolved.name, answer.error)
                    return
                log.debug(
                    "placement of %s not done yet (attempt %d): %s", resolved.name, attempt, answer.error
                )
            with trio.move_on_after(1.0):
                await self.cluster.wait_changed()
