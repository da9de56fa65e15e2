"""A node's reconcile of what it runs, in one process: no runner processes, trio's MockClock."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

import pytest
import trio
import trio.testing

from node.files import FetchError
from node.hosting.instances import RESOLVE_RETRY, HostedInstances, plan_reconcile
from node.hosting.stages import answer_stage_address
from node.models import ModelResolveError, ResolvedModel
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.control_wire import StageAddress
from protocol.ids import InstanceId, ModelId, NodeId

ME, OTHER = NodeId("me"), NodeId("other")


def record(iid: str, *nodes: NodeId, model: str = "") -> InstanceRecord:
    stages = tuple(StageAssignment(node, i, i + 1) for i, node in enumerate(nodes or (ME,)))
    return InstanceRecord(InstanceId(iid), ModelId(model or f"model-{iid}"), stages)


class FakeRunner(RunnerSupervisor):
    """Runs until cancelled, without a process; says when it started and stopped."""

    live: ClassVar[set[str]] = set()

    async def run(self, *, task_status: object = None) -> None:
        FakeRunner.live.add(self.spec.model_id)
        try:
            await trio.sleep_forever()
        finally:
            FakeRunner.live.discard(self.spec.model_id)


class NoMesh:
    def addrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1"]

    async def request(self, peer_id: str, payload: bytes, protocol: str = "") -> bytes:
        raise AssertionError("a 1-stage instance asks nobody")


def spec(model: ModelId, path: Path) -> RunnerSpec:
    return RunnerSpec(model_id=model, model_path=path)


def hosted(resolve: Callable[[str], Awaitable[ResolvedModel]]) -> HostedInstances:
    """A node whose stage folders come from `resolve(record's model)`, as `ClusterFiles.folder_for`
    gives them (a local copy, or files fetched from peers)."""

    async def folder(record: InstanceRecord, stage: StageAssignment) -> Path:
        return (await resolve(record.source or record.model)).path

    FakeRunner.live = set()
    return HostedInstances(ME, NoMesh(), spec, folder, runner=FakeRunner, rand=lambda: 0.5)


def run(main: Callable[[], Awaitable[None]]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_plan_stops_what_went_or_changed_and_starts_what_is_new() -> None:
    a, b, c = record("a"), record("b"), record("c", OTHER)
    b2 = record("b", OTHER, ME)
    running = {a.instance_id: a, b.instance_id: b}
    records = {b2.instance_id: b2, c.instance_id: c, InstanceId("d"): record("d")}
    stop, start = plan_reconcile(ME, records, running)
    assert stop == ["a", "b"]  # a went away; b changed: stopped, then started as it is now
    assert start == [b2, record("d")]  # c does not name this node
    assert plan_reconcile(ME, running, running) == ([], [])


def test_a_slow_model_holds_up_no_other_instance() -> None:
    slow_may_finish = trio.Event()

    async def resolve(source: str) -> ResolvedModel:
        if source == "model-slow":
            await slow_may_finish.wait()  # an import or a download that takes minutes
        return ResolvedModel(source, Path("/models") / source, "folder")

    async def main() -> None:
        node = hosted(resolve)
        records = {InstanceId(r.instance_id): r for r in (record("slow"), record("quick"))}
        async with trio.open_nursery() as nursery:
            node.reconcile_nowait(records, nursery)
            await trio.testing.wait_all_tasks_blocked()
            assert FakeRunner.live == {"model-quick"}
            assert node.local_runner("model-quick") is not None and node.local_runner("model-slow") is None
            slow_may_finish.set()
            await trio.testing.wait_all_tasks_blocked()
            assert FakeRunner.live == {"model-quick", "model-slow"}
            node.reconcile_nowait({InstanceId("slow"): records[InstanceId("slow")]}, nursery)
            await trio.testing.wait_all_tasks_blocked()
            assert FakeRunner.live == {"model-slow"}  # quick's record went away: its runner stopped
            assert [r.spec.model_id for r in node.runners()] == ["model-slow"]
            nursery.cancel_scope.cancel()

    run(main)


def test_an_instance_that_goes_away_while_resolving_is_never_started() -> None:
    async def resolve(source: str) -> ResolvedModel:
        await trio.sleep(10)
        return ResolvedModel(source, Path("/m"), "folder")

    async def main() -> None:
        node = hosted(resolve)
        async with trio.open_nursery() as nursery:
            node.reconcile_nowait({InstanceId("a"): record("a")}, nursery)
            await trio.sleep(5)
            node.reconcile_nowait({}, nursery)
            await trio.sleep(20)
            assert FakeRunner.live == set() and node.runners() == []
            nursery.cancel_scope.cancel()

    run(main)


@pytest.mark.parametrize(
    "failure",
    [
        lambda source: ModelResolveError(f"model {source!r} not found"),
        lambda source: FetchError(f"{source}: no peer holds 'config.json'"),
        lambda source: OSError(28, "No space left on device"),
    ],
    ids=["does not resolve", "no peer has the files", "disk full"],
)
def test_files_this_node_cannot_get_are_asked_for_again_after_a_backoff_not_every_pass(
    caplog: pytest.LogCaptureFixture, failure: Callable[[str], Exception]
) -> None:
    attempts: list[float] = []
    files_arrive_at = 100.0

    async def resolve(source: str) -> ResolvedModel:
        attempts.append(trio.current_time())
        if trio.current_time() < files_arrive_at:
            raise failure(source)
        return ResolvedModel(source, Path("/m"), "folder")

    async def main() -> None:
        node = hosted(resolve)
        records = {InstanceId("a"): record("a")}
        async with trio.open_nursery() as nursery:
            for _ in range(150):  # the manager's loop: a pass at least once a second
                node.reconcile_nowait(records, nursery)
                await trio.sleep(1.0)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="shoal.instances"):
        run(main)
    assert RESOLVE_RETRY.min_s == 2.0
    assert attempts == pytest.approx([0, 2, 6, 14, 30, 62, 126])  # 2 s doubling; the last one works
    assert FakeRunner.live == set()  # cancelled with the nursery
    levels = [r.levelno for r in caplog.records if "cannot get the files" in r.getMessage()]
    assert levels == [logging.ERROR] + [logging.WARNING] * 5  # one ERROR, not one per pass


def test_a_stage_address_is_only_given_for_the_very_stage_asked_about() -> None:
    pipeline = record("p", OTHER, ME)
    nodes = (OTHER, ME)
    asked = StageAddress(instance_id="p", start_layer=1, end_layer=2, nodes=nodes)
    assert answer_stage_address(asked, pipeline, ME, "10.0.0.2:5000").address == "10.0.0.2:5000"
    assert answer_stage_address(asked, pipeline, ME, None).address is None  # not ready yet
    assert answer_stage_address(asked, None, ME, "10.0.0.2:5000").address is None  # not hosted here
    other_layers = asked.model_copy(update={"start_layer": 0, "end_layer": 1})
    assert answer_stage_address(other_layers, pipeline, ME, "10.0.0.2:5000").address is None
    stale = asked.model_copy(update={"nodes": (ME, OTHER)})  # the asker's record differs from ours
    assert answer_stage_address(stale, pipeline, ME, "10.0.0.2:5000").address is None


def test_a_waiter_wakes_when_the_runner_is_published_not_before() -> None:
    """What a request for a loading model waits on (`NodeBackend`): a reconcile, then the runner
    once the files are there (at 50 s); nothing in between wakes it."""
    files_ready = trio.Event()

    async def resolve(source: str) -> ResolvedModel:
        await files_ready.wait()
        return ResolvedModel(source, Path("/m"), "folder")

    async def main() -> None:
        node = hosted(resolve)
        woke: list[tuple[float, bool]] = []

        async def waiter() -> None:
            for _ in range(3):
                await node.wait_changed()
                woke.append((trio.current_time(), node.local_runner("model-a") is not None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            node.reconcile_nowait({InstanceId("a"): record("a")}, nursery)
            await trio.sleep(50)
            files_ready.set()
            await trio.sleep(10)
            node.reconcile_nowait({}, nursery)  # deleted: the runner goes
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert woke == [(0.0, False), (50.0, True), (60.0, False)]

    run(main)
