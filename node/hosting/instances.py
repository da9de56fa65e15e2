"""What this node runs: its part of every instance placed on it, kept in step with the records.

`reconcile_nowait` compares the records that name this node with what runs here and returns at
once: it stops what went away or changed, and starts one task per new instance. That task gets the
model's files (this node's own copy, or those its stage needs fetched from the peers that hold them:
`node.files.cluster`), then runs the instance's runner, or this node's pipeline stage
(`node.hosting.stages`); a slow transfer holds up no other instance. Files that cannot be had (no
peer holds them, a transfer failed, the disk is full) are tried again after a backoff, not on every
pass of the caller's loop; the reason shows in the log and, for a transfer, in the cluster view.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from node.files import FetchError
from node.hosting.stages import (
    StageMesh,
    StageRoute,
    answer_stage_address,
    reachable_host,
    run_entry,
    run_stage_process,
)
from node.runner.supervisor import RunnerSpec, RunnerSupervisor, child_environment
from protocol.backoff import Backoff, BackoffPolicy
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.control_wire import StageAddress, StageAddressAnswer
from protocol.ids import InstanceId, ModelId, NodeId

log = logging.getLogger("shoal.instances")

RESOLVE_RETRY = BackoffPolicy(min_s=2.0, max_s=300.0)
"""Files this node cannot get (no peer holds them, a transfer failed, no network) are tried again at
2 s, 4 s ... then every 5 minutes: a holder that joins later is found, and the log gets a line per
try, not per second."""
ModelFolder = Callable[[InstanceRecord, StageAssignment], Awaitable[Path]]
"""The folder this node runs its stage of an instance from, fetched first when needed
(`ClusterFiles.folder_for`); raises `ValueError`, `OSError` or `FetchError` when it cannot."""


def plan_reconcile(
    me: NodeId, records: Mapping[InstanceId, InstanceRecord], running: Mapping[InstanceId, InstanceRecord]
) -> tuple[list[InstanceId], list[InstanceRecord]]:
    """(instances to stop, records to start) so that what runs matches the records naming `me`;
    a changed record is both: stopped, then started as it is now."""
    wanted = {iid: r for iid, r in records.items() if any(s.node == me for s in r.stages)}
    stop = [iid for iid, record in running.items() if wanted.get(iid) != record]
    start = [record for iid, record in wanted.items() if iid not in running or iid in stop]
    return stop, start


async def serve_runner(runner: RunnerSupervisor) -> None:
    """Run `runner`; once it stops, requests still streaming from it get their terminal error."""
    try:
        await runner.run()
    finally:
        runner.fail_in_flight("the model's instance was stopped or re-placed on this node")


@dataclass
class _Hosted:
    record: InstanceRecord
    scope: trio.CancelScope
    runner: RunnerSupervisor | None = None
    """This node's runner: a 1-stage instance's, or a pipeline's first stage (once stages answer)."""
    stage_address: str | None = None
    """HOST:PORT of this node's (non-first) pipeline stage process, once it is ready."""
    host: str | None = None
    """The IP this node's stages listen on (pipeline instances): its driver's too."""

    def address(self) -> str | None:
        """Where this node's stage accepts its previous one: the stage process, or on the entry
        the driver (the last stage dials it back), once it is ready."""
        if self.stage_address is not None or self.runner is None or self.host is None:
            return self.stage_address
        port = self.runner.ring_port
        return None if port is None else f"{self.host}:{port}"


class HostedInstances:
    def __init__(
        self,
        me: NodeId,
        mesh: StageMesh,
        runner_spec: Callable[[ModelId, Path], RunnerSpec],
        folder: ModelFolder,
        *,
        runner: Callable[[RunnerSpec], RunnerSupervisor] = RunnerSupervisor,
        rand: Callable[[], float] = random.random,
        stage_links: Callable[[InstanceId], str] = lambda _instance: "",
    ) -> None:
        self.me = me
        self._stage_links = stage_links
        """The key of an instance's stage links, for its runner and stage processes."""
        self._mesh = mesh
        self._runner_spec = runner_spec
        self._folder_for = folder
        self._runner = runner
        self._rand = rand
        self._hosted: dict[InstanceId, _Hosted] = {}
        self._changed = trio.Event()

    # --- reads -------------------------------------------------------------------------------
    def runners(self) -> list[RunnerSupervisor]:
        return [hosted.runner for hosted in self._hosted.values() if hosted.runner is not None]

    def local_runner(self, model: str) -> RunnerSupervisor | None:
        """The runner taking requests for `model` here: this node holds its instance's first stage."""
        for hosted in self._hosted.values():
            first = hosted.record.stages[0].node == self.me
            if hosted.record.model == model and first and hosted.runner is not None:
                return hosted.runner
        return None

    async def wait_changed(self) -> None:
        """Returns after the next reconcile (the caller's loop runs one at each cluster change, at
        least once a second) or when a runner comes or goes here: a request waiting for its model to
        load rechecks then."""
        await self._changed.wait()

    def answer_stage_address(self, question: StageAddress) -> StageAddressAnswer:
        hosted = self._hosted.get(InstanceId(question.instance_id))
        if hosted is None:
            return StageAddressAnswer(address=None)
        return answer_stage_address(question, hosted.record, self.me, hosted.address())

    # --- keeping in step ---------------------------------------------------------------------
    def reconcile_nowait(self, records: Mapping[InstanceId, InstanceRecord], nursery: trio.Nursery) -> None:
        """Stop what no record names here any more, start (in `nursery`) what is new; never waits."""
        running = {iid: hosted.record for iid, hosted in self._hosted.items()}
        stop, start = plan_reconcile(self.me, records, running)
        for iid in stop:
            log.info("stopping the runner of instance %s", iid)
            self._hosted.pop(iid).scope.cancel()
        for record in start:
            hosted = _Hosted(record, trio.CancelScope())
            self._hosted[record.instance_id] = hosted
            nursery.start_soon(self._host, hosted)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _publish(self, hosted: _Hosted, runner: RunnerSupervisor | None) -> None:
        """`runner` takes `hosted`'s requests from now on (None: none does)."""
        hosted.runner = runner
        self._notify()

    async def _host(self, hosted: _Hosted) -> None:
        """Get the model's files, then run this node's part of the instance until its scope is cancelled."""
        with hosted.scope:
            record = hosted.record
            mine = next(s for s in record.stages if s.node == self.me)
            path = await self._folder(record, mine)
            spec = self._runner_spec(record.model, path)
            if len(record.stages) == 1:
                log.info("instance %s: running %s here", record.instance_id, record.model)
                runner = self._runner(spec)
                self._publish(hosted, runner)
                await serve_runner(runner)
                return
            if record.sharding == "tensor":
                log.info(
                    "instance %s: running tensor rank %d of %d of %s here (this node holds the whole "
                    "model's files: every tensor holds a slice of each rank)",
                    record.instance_id,
                    record.stages.index(mine),
                    len(record.stages),
                    record.model,
                )
            else:
                log.info(
                    "instance %s: running layers [%d, %d) of %s here",
                    record.instance_id,
                    mine.start_layer,
                    mine.end_layer,
                    record.model,
                )
            host = hosted.host = reachable_host(self._mesh.addrs())
            spec = replace(spec, stage_link=self._stage_links(record.instance_id))
            route = StageRoute(self._mesh, record)
            if mine is record.stages[0]:
                publish = functools.partial(self._publish, hosted)
                await run_entry(route, spec, host, self._runner, serve_runner, publish)
                return

            def publish_address(address: str | None) -> None:
                hosted.stage_address = address

            env = child_environment(spec)  # a stage runs as a runner would: offline, its BLAS settings
            await run_stage_process(path, route, mine, host=host, env=env, publish=publish_address)

    async def _folder(self, record: InstanceRecord, stage: StageAssignment) -> Path:
        """The stage's folder, asked for again after each failure's backoff until it is there."""
        backoff = Backoff(RESOLVE_RETRY, rand=self._rand)
        while True:
            backoff.started(trio.current_time())
            try:
                return await self._folder_for(record, stage)
            except (ValueError, OSError, FetchError) as exc:  # reported; the stage waits here
                delay = backoff.failed(trio.current_time())
                report = log.error if backoff.failures == 1 else log.warning
                report(
                    "instance %s: cannot get the files of %s here: %s (trying again in %.0fs)",
                    record.instance_id,
                    record.model,
                    exc,
                    delay,
                )
                await trio.sleep(delay)
