"""Instances: the leader places models on nodes; every node runs its part of the instances naming it.

One module per job, composed here:
- `node.control.leader`: the leader places, previews and deletes instances, and re-places one whose
  node died on the survivors, when it still fits;
- `node.control.requests`: what any node asks the leader (`POST /v1/instances`, `shoal run --model X`);
- `node.hosting.instances`: this node's reconcile of what it runs, one task per instance;
- `node.hosting.stages`: the pipeline stages it hosts, and their `StageAddress` answers;
- `node.control.shapes`: model resolution and the shape cache;
- `node.control.finder`: a model placed by a name only a peer holds, and the answers to such asks;
- `node.files.cluster`: the model files this node serves, and those it fetches for its stages.
`InstanceManager.run` serves the control protocol and reconciles (and, on the leader, repairs) at
each cluster change and at least once a second. A leader change keeps instances: records live in
the replicated state, not in the leader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from node.cluster.service import ClusterService
from node.control.finder import ModelFinder
from node.control.leader import LeaderControl
from node.control.requests import InstanceRequests
from node.control.shapes import ModelFiles, ShapeCache
from node.files.cluster import ClusterFiles
from node.hosting.instances import HostedInstances
from node.hosting.replica_load import ReplicaLoads
from node.net.mesh import Mesh
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.cluster_records import InstanceRecord
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    ControlMessage,
    ControlWireError,
    DeleteInstance,
    DeleteOutcome,
    DescribeModel,
    Invalid,
    PlaceInstance,
    PlaceOutcome,
    StageAddress,
    decode_control,
    encode_control,
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.sharding import ShardingChoice

if TYPE_CHECKING:
    from trio_typing import TaskStatus

RECHECK_S = 1.0
"""Reconcile and repair at least this often: deaths come from the detector's ticks, not changes."""


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
    stage_links: Callable[[InstanceId], str] = lambda _instance: ""
    """The key of an instance's stage links (`node.pipeline.link_auth`), from the cluster key."""
    unsealed_tensor: bool = False
    """The cluster has a secret, so links must seal their frames, and this node's tensor-parallel
    links cannot (kernels built without OpenSSL): as leader it refuses tensor sharding."""


class InstanceManager:
    def __init__(
        self, cluster: ClusterService, mesh: Mesh, options: InstanceOptions, files: ClusterFiles
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.files = files
        self.data_dir = options.data_dir
        """Where this node's models live (`NodeBackend.local_models` lists them)."""
        model_files = ModelFiles(options.data_dir, options.runtime_dtype_bytes, options.kernels)
        self.shapes = ShapeCache(model_files.shape)
        self.leader = LeaderControl(cluster, unsealed_tensor=options.unsealed_tensor)
        self.finder = ModelFinder(
            cluster, mesh, files, model_files.folder_shape, self.shapes.get, options.data_dir
        )
        """Models placed by a name only a peer resolves, and this node's answers to such asks."""
        self.requests = InstanceRequests(cluster, mesh, self.leader, self.shapes, files, self.finder)
        self.loads = ReplicaLoads(cluster, self.records, self.local_runner)
        """Replica choice: the requests open to each entry, and what this node reports of its own."""
        self.hosted = HostedInstances(
            cluster.me,
            mesh,
            options.runner_spec,
            files.folder_for,
            runner=self.loads.runner,
            stage_links=options.stage_links,
        )
        cluster.report_load(self.loads.own_load)

    # --- reads for the backend ---------------------------------------------------------------
    def runners(self) -> list[RunnerSupervisor]:
        return self.hosted.runners()

    def local_runner(self, model: str) -> RunnerSupervisor | None:
        return self.hosted.local_runner(model)

    async def wait_hosted_changed(self) -> None:
        """Returns after the next reconcile here, or when a runner of this node comes or goes."""
        await self.hosted.wait_changed()

    def records(self) -> list[InstanceRecord]:
        return sorted(self.cluster.state.instances().values(), key=lambda r: r.instance_id)

    def entry_nodes(self, model: str) -> list[NodeId]:
        """The nodes that take requests for `model`, best first: the first stage of each of its
        instances: the ready ones by load (this node's own on ties), then those not ready, then those
        on nodes not alive (`protocol.replicas`). Failover tries the next when the first breaks off."""
        return self.loads.entry_nodes(model)

    def entry_node(self, model: str) -> NodeId | None:
        """The node that takes requests for `model` now: the best of `entry_nodes`."""
        nodes = self.entry_nodes(model)
        return nodes[0] if nodes else None

    # --- what the backend asks ---------------------------------------------------------------
    async def request_instance(
        self,
        source: str,
        nodes: int | None,
        *,
        preview: bool,
        replicas: int | None = None,
        sharding: ShardingChoice = "pipeline",
    ) -> PlaceOutcome:
        return await self.requests.place(source, nodes, preview=preview, replicas=replicas, sharding=sharding)

    async def delete_instance(self, instance_id: str) -> DeleteOutcome:
        return await self.requests.delete(instance_id)

    async def ensure_instance(
        self, source: str, replicas: int = 1, sharding: ShardingChoice = "pipeline"
    ) -> None:
        """For `shoal run --model X`: once there is a leader, make sure X has `replicas` instances."""
        await self.requests.ensure(source, replicas, sharding)

    # --- the service -------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.mesh.set_request_handler(self._answer_control, protocol=CONTROL_PROTOCOL)
        await self.files.offer_stored()
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self.hosted.reconcile_nowait(self.cluster.state.instances(), nursery)
                if self.cluster.is_leader:
                    self.leader.repair_nowait(nursery)
                with trio.move_on_after(RECHECK_S):
                    await self.cluster.wait_changed()

    async def _answer_control(self, peer_id: str, payload: bytes) -> bytes:
        try:
            message = decode_control(payload)
        except ControlWireError as exc:
            return encode_control(Invalid(kind="malformed", reason=str(exc)))
        answer: ControlMessage
        if isinstance(message, PlaceInstance):
            answer = await self.leader.place(message)
        elif isinstance(message, DeleteInstance):
            answer = await self.leader.delete(message)
        elif isinstance(message, StageAddress):
            answer = self.hosted.answer_stage_address(message)
        elif isinstance(message, DescribeModel):
            answer = await self.finder.answer(message)
        else:
            answer = Invalid(kind="malformed", reason=f"{message.type!r} is not a control request")
        return encode_control(answer)
