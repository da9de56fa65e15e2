"""The pipeline stages this node hosts for the instances placed on it (`node.pipeline.stage` is the
stage process itself; this module starts and watches those processes).

A later stage runs `node.pipeline.stage` in its own process, restarted after a backoff whenever it
exits, on the same port when it can, so the entry's route stays valid; its address answers the
`StageAddress` questions of the entry and of the stage before. The entry asks every later stage
where it listens and runs the runner in pipeline mode with that route. It keeps asking: a stage
that had to move (its port was taken while it restarted) gets the runner restarted with the new
route, with no user action.

Each later stage's node asks the node of the next stage (for the last stage: the entry, which
answers with its driver's port) where it listens, and writes the answer to its stage process's
stdin whenever it changes: a stage sends only where the mesh says, never where a frame says.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import trio

from node.children.supervisor import SILENT_KILL_S, ChildFailed, Launch, keep_restarting, running
from node.net.mesh import RequestError
from node.pipeline.stage_wire import (
    READY_MAX_BYTES,
    NextHop,
    decode_ready,
    encode_next_hop,
    follower_command,
    stage_command,
)
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.control_wire import (
    CONTROL_PROTOCOL,
    ControlWireError,
    StageAddress,
    StageAddressAnswer,
    decode_control,
    encode_control,
)
from protocol.framing import FrameError

log = logging.getLogger("shoal.instances")

STAGE_READY_TIMEOUT = 300.0
"""How long a stage process may take to load its layers, and the entry node to collect addresses."""
ADDRESS_POLL = 0.5
"""Seconds between questions while a stage is not ready yet."""
ROUTE_CHECK_INTERVAL = 2.0
"""Seconds between checks that a known route still holds (the entry's, of each stage; a stage
node's, of the next hop): one small request per stage."""
STAGE_STOP_GRACE = 5.0
"""How long a stage process gets to exit after SIGTERM before SIGKILL."""


class StageMesh(Protocol):
    """What stages need of the mesh (`node.net.mesh.Mesh`): our addresses, and questions to peers."""

    def addrs(self) -> list[str]: ...
    async def request(self, peer_id: str, payload: bytes, protocol: str = ...) -> bytes: ...


def reachable_host(addrs: list[str]) -> str:
    """The IP peers reach us on, from our p2p multiaddrs (/ip4/IP/...): a non-loopback one if any."""
    ips = [a.split("/")[2] for a in addrs if a.startswith("/ip4/") and a.split("/")[2] != "0.0.0.0"]
    public = [ip for ip in ips if not ip.startswith("127.")]
    return (public or ips or ["127.0.0.1"])[0]


def next_stage(record: InstanceRecord, stage: StageAssignment) -> StageAssignment:
    """Where `stage` sends its output: the next stage, or from the last one the entry's driver."""
    at = record.stages.index(stage)
    return record.stages[(at + 1) % len(record.stages)]


def _label(record: InstanceRecord, stage: StageAssignment) -> str:
    if record.sharding == "tensor":
        return f"tensor rank {record.stages.index(stage)} of {len(record.stages)}"
    return f"stage [{stage.start_layer}, {stage.end_layer})"


def answer_stage_address(
    question: StageAddress, record: InstanceRecord | None, me: str, address: str | None
) -> StageAddressAnswer:
    """`address` (this node's stage of `record`) if the question is about that very stage, else None."""
    if record is None or question.nodes != tuple(s.node for s in record.stages):
        return StageAddressAnswer(address=None)
    if not any(
        s.node == me and (s.start_layer, s.end_layer) == (question.start_layer, question.end_layer)
        for s in record.stages
    ):
        return StageAddressAnswer(address=None)
    return StageAddressAnswer(address=address)


class StageRoute:
    """The entry's questions to the later stages' nodes: where does your stage listen?"""

    def __init__(self, mesh: StageMesh, record: InstanceRecord) -> None:
        self.mesh = mesh
        self.record = record

    async def ask(self, stage: StageAssignment) -> str | None:
        """One question; None when the stage is not ready or its node does not answer."""
        question = StageAddress(
            instance_id=self.record.instance_id,
            start_layer=stage.start_layer,
            end_layer=stage.end_layer,
            nodes=tuple(s.node for s in self.record.stages),
        )
        try:
            answer = decode_control(
                await self.mesh.request(stage.node, encode_control(question), protocol=CONTROL_PROTOCOL)
            )
        except (RequestError, ControlWireError) as exc:
            log.debug("stage node %s did not answer: %s", stage.node, exc)
            return None
        return answer.address if isinstance(answer, StageAddressAnswer) else None

    async def collect(self) -> tuple[str, ...]:
        """Every later stage's address, in layer order, waiting for those not ready yet."""
        route: list[str] = []
        for stage in self.record.stages[1:]:
            while (address := await self.ask(stage)) is None:
                await trio.sleep(ADDRESS_POLL)
            route.append(address)
        return tuple(route)

    async def wait_moved(self, route: tuple[str, ...]) -> None:
        """Return once a stage answers with another address than `route` has for it."""
        while True:
            await trio.sleep(ROUTE_CHECK_INTERVAL)
            for stage, known in zip(self.record.stages[1:], route, strict=True):
                address = await self.ask(stage)
                if address is not None and address != known:
                    log.info(
                        "instance %s: %s moved from %s to %s",
                        self.record.instance_id,
                        _label(self.record, stage),
                        known,
                        address,
                    )
                    return


async def run_stage_process(
    path: Path,
    route: StageRoute,
    stage: StageAssignment,
    *,
    host: str,
    env: Mapping[str, str],
    publish: Callable[[str | None], None],
) -> None:
    """Keep this node's stage process of `route.record` running (until cancelled), fed its next
    hop; `publish` gets its HOST:PORT, or None while down. A restart asks for the same port; one
    that failed to start takes any. A tensor-parallel rank's process (`node.tensor.follower`) needs
    no next hop: rank 0 dials it and says who else is in the group."""
    port = 0
    record = route.record
    instance, label, tensor = record.instance_id, _label(record, stage), record.sharding == "tensor"
    ahead = next_stage(record, stage)

    async def run_once() -> None:
        nonlocal port
        if tensor:
            rank, size = record.stages.index(stage), len(record.stages)
            command = follower_command(
                path, rank=rank, size=size, host=host, port=port, parent_pid=os.getpid()
            )
            first: bytes | None = None
        else:
            command = stage_command(
                path,
                start=stage.start_layer,
                end=stage.end_layer,
                host=host,
                port=port,
                parent_pid=os.getpid(),
                next_from_stdin=True,
            )
            first = encode_next_hop(NextHop(address=None))  # its first frame: no next hop known yet
        launch = Launch(command, env, READY_MAX_BYTES, spec_frame=first, stop_grace_s=STAGE_STOP_GRACE)
        try:
            async with running(launch) as child:
                try:
                    port = decode_ready(bytes(await child.handshake(STAGE_READY_TIMEOUT))).port
                except (ChildFailed, FrameError) as exc:
                    log.error("instance %s: %s failed: %s", instance, label, exc)
                    port = 0  # the port may have been taken meanwhile: take any, the entry follows
                    return
                publish(f"{host}:{port}")
                log.info("instance %s: %s listens on %s:%d", instance, label, host, port)
                async with trio.open_nursery() as nursery:
                    if not tensor:
                        nursery.start_soon(feed_next_hop, child.send, functools.partial(route.ask, ahead))
                    try:
                        frozen = await child.watch()
                    except FrameError as exc:  # only heartbeats come after the ready frame
                        log.error("instance %s: %s wrote no frames (%s); stopping it", instance, label, exc)
                        await child.stop(0.0)
                    else:
                        if frozen:
                            log.warning(
                                "instance %s: %s sent no heartbeat for %.0f s (frozen); killed it",
                                instance,
                                label,
                                SILENT_KILL_S,
                            )
                    code = await child.wait()
                    nursery.cancel_scope.cancel()
                log.warning("instance %s: stage process exited (%s)", instance, code)
        finally:
            publish(None)
            log.info("instance %s: %s stopped", instance, label)

    await keep_restarting(run_once, lambda _result, _delay: True)


async def feed_next_hop(
    send: Callable[[bytes], Awaitable[bool]], ask: Callable[[], Awaitable[str | None]]
) -> None:
    """Write the next hop to the stage process (`send`: `Child.send`) whenever the mesh's answer
    changes, until cancelled or the process is gone (`send` returns False). An unknown answer keeps
    the last address (a refused dial retries and re-reads it) and is asked again sooner, so a
    driver or stage that restarted is soon followed."""
    known: str | None = None
    while True:
        address = await ask()
        if address is not None and address != known:
            if not await send(encode_next_hop(NextHop(address=address))):
                return
            log.info("next hop: %s", address)
            known = address
        await trio.sleep(ROUTE_CHECK_INTERVAL if address is not None else ADDRESS_POLL)


async def run_entry(
    route: StageRoute,
    spec: RunnerSpec,
    host: str,
    runner: Callable[[RunnerSpec], RunnerSupervisor],
    serve: Callable[[RunnerSupervisor], Awaitable[None]],
    publish: Callable[[RunnerSupervisor | None], None],
) -> None:
    """The first stage: the runner (`spec` in pipeline mode, the later stages dialing back to `host`;
    in tensor mode, rank 0 dialing the other ranks) for the current route, restarted whenever the
    route changes."""
    iid = route.record.instance_id
    end = route.record.stages[0].end_layer
    while True:
        addresses: tuple[str, ...] = ()
        with trio.move_on_after(STAGE_READY_TIMEOUT):
            addresses = await route.collect()
        if not addresses:
            log.error("instance %s: its stages did not all become ready; not serving it", iid)
            return
        log.info("instance %s: stages at %s", iid, ", ".join(addresses))
        if route.record.sharding == "tensor":
            current = runner(dataclasses.replace(spec, tensor=addresses))
        else:
            current = runner(dataclasses.replace(spec, pipeline=(end, host, addresses)))
        publish(current)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve, current)
                await route.wait_moved(addresses)
                nursery.cancel_scope.cancel()
        finally:
            publish(None)
