"""One attempt at a request: on this node's runner, or on the entry node that holds its instance.

`node.serving.failover` decides where each attempt goes and when to try again; this module only
opens it there, and never calls back up: backend -> failover -> attempts -> a runner, or a peer's
entry (`node.serving.routing.RemoteGenerations`). A request for an instance that starts here but
has no runner yet (its files still coming, its later stages loading) waits for the runner, up to
`load_wait_s`, unless no node can get the model's files (`files_unavailable`): then it ends at once
with that reason, which failover passes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import trio

from node.cluster.service import ClusterService
from node.control.instances import InstanceManager
from node.files.cluster import files_unavailable
from node.runner.supervisor import RunnerSupervisor
from protocol.chat import GenerateRequest
from protocol.events import (
    MODEL_FILES_UNAVAILABLE,
    MODEL_LOADING,
    MODEL_NOT_FOUND,
    ChunkEvent,
    GenerationError,
)
from protocol.ids import NodeId, RequestId

Events = AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]
"""An opened request: its events, until its terminal one."""


class RemoteStreams(Protocol):
    """Requests sent to a peer's entry (`node.serving.routing.RemoteGenerations`)."""

    def open_stream(self, entry_node: str, request: GenerateRequest) -> Events: ...

    async def cancel(self, request_id: RequestId) -> bool: ...


class Attempts:
    """Opens and cancels single attempts; see the module docstring."""

    def __init__(
        self,
        cluster: ClusterService,
        instances: InstanceManager,
        remote: RemoteStreams,
        *,
        load_wait_s: float,
    ) -> None:
        self._cluster = cluster
        self._instances = instances
        self._remote = remote
        self._load_wait_s = load_wait_s
        """How long a request waits for an instance placed here to start (`NodeConfig.load_wait_s`)."""

    def open_on(self, entry: NodeId | None, request: GenerateRequest) -> Events:
        """One attempt on `entry` (None: this node, which says why it has none)."""
        if entry is not None and entry != self._cluster.me:
            return self._remote.open_stream(entry, request)
        return self.open_local(request)

    def open_local(self, request: GenerateRequest) -> Events:
        """Only this node's runners: what peers' forwarded requests get (they never hop twice)."""
        runner = self._instances.local_runner(request.model)
        if runner is not None:
            return runner.open_stream(request)
        entry = self._instances.entry_node(request.model)
        if entry is None:
            return _single_event(
                GenerationError(
                    error_kind="invalid_request",
                    message=f"model {request.model!r} is not served by this cluster",
                    code=MODEL_NOT_FOUND,
                    param="model",
                )
            )
        return self._open_once_loaded(request)

    @asynccontextmanager
    async def _open_once_loaded(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        """Enter this node's runner for the model once it has one, waiting up to `load_wait_s`; past
        that, or as soon as this node takes no requests for the model any more, the one
        `model_loading` error; as soon as no node can get the model's files, the
        `model_files_unavailable` error. Cancellable."""
        runner: RunnerSupervisor | GenerationError | None = None
        with trio.move_on_after(self._load_wait_s):
            runner = await self._runner_once_started(request.model)
        if not isinstance(runner, RunnerSupervisor):
            loading = GenerationError(
                error_kind="server_error",
                message=f"model {request.model!r} is not running on this node (yet); retry shortly",
                code=MODEL_LOADING,
            )
            async with _single_event(runner or loading) as events:
                yield events
            return
        async with runner.open_stream(request) as events:
            yield events

    async def _runner_once_started(self, model: str) -> RunnerSupervisor | GenerationError | None:
        """This node's runner for `model` as soon as there is one; None once this node is no entry of
        `model` (its instance deleted or moved); the error once no node can get its files (rechecked
        at each reconcile, which follows every cluster change). Unbounded: the caller bounds it."""
        while (runner := self._instances.local_runner(model)) is None:
            if self._cluster.me not in self._instances.entry_nodes(model):
                return None
            if (why := files_unavailable(self._cluster, model)) is not None:
                return GenerationError(
                    error_kind="server_error",
                    message=f"model {model!r} cannot run: {why}",
                    code=MODEL_FILES_UNAVAILABLE,
                )
            await self._instances.wait_hosted_changed()
        return runner

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel an attempt in flight, here or on the entry it was sent to."""
        return await self.cancel_local(request_id) or await self._remote.cancel(request_id)

    async def cancel_local(self, request_id: RequestId) -> bool:
        for runner in self._instances.runners():
            if runner.has_request(request_id):
                return await runner.cancel(request_id)
        return False


@asynccontextmanager
async def _single_event(event: ChunkEvent) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
    async def events() -> AsyncIterator[ChunkEvent]:
        yield event

    yield events()
