"""Keeps one runner process per model alive and multiplexes requests over its pipes.

The node's trio loop only moves frames; MLX runs in the child (started, handed its spec, stopped
and restarted by `node.children`). When the child dies (crash, OOM, SIGKILL) every in-flight
request gets a `server_error` event at once and a fresh runner starts.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING

import trio

from node.children.supervisor import Child, ChildFailed, Launch, keep_restarting, running
from node.cpu.fastpath import runner_environment
from node.pipeline.link_auth import LINK_ENV
from protocol.chat import GenerateRequest
from protocol.events import (
    RUNNER_UNAVAILABLE,
    TOO_MANY_REQUESTS,
    ChunkEvent,
    Finish,
    GenerationError,
    is_terminal,
)
from protocol.health import RunnerHealth, RunnerState
from protocol.ids import RequestId
from protocol.runner_wire import (
    MAX_FRAME_BYTES,
    Cancel,
    FrameError,
    Generate,
    LoadFailed,
    Ready,
    RequestEvent,
    RunnerMessage,
    RunnerSpec,
    Start,
    decode_message,
    encode_frame,
)

if TYPE_CHECKING:
    # libp2p pulls in trio-typing, whose stubs shadow trio's own types for the type checker.
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.runner")


RUNNER_COMMAND = (sys.executable, "-m", "node.runner")
"""No arguments: the runner reads its `RunnerSpec` from the first frame on its stdin."""


def child_environment(spec: RunnerSpec) -> dict[str, str]:
    """A runner's (or stage process's) environment: offline, unbuffered, the harmony vocab, the
    BLAS settings of `node.cpu.fastpath`, and the instance's stage link key."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if spec.vocab_dir is not None:
        env["TIKTOKEN_ENCODINGS_BASE"] = str(spec.vocab_dir)
    env.update(runner_environment(env, enabled=spec.fast_path))
    if spec.stage_link:
        env[LINK_ENV] = spec.stage_link
    return env


class ChannelEvents:
    """Iterates one request's events from a memory channel and stops after its terminal event."""

    def __init__(self, receive: trio.MemoryReceiveChannel[ChunkEvent]) -> None:
        self._receive = receive
        self.finished = False

    def __aiter__(self) -> ChannelEvents:
        return self

    async def __anext__(self) -> ChunkEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self._receive.receive()
        self.finished = is_terminal(event)
        return event


def _error(message: str) -> GenerationError:
    return GenerationError(error_kind="server_error", message=message, code=RUNNER_UNAVAILABLE)


def _overloaded(spec: RunnerSpec) -> GenerationError:
    return GenerationError(
        error_kind="overloaded",
        message=(
            f"model {spec.model_id} is busy: {spec.max_concurrent} requests are running and "
            f"{spec.max_queued} waiting; retry later"
        ),
        code=TOO_MANY_REQUESTS,
    )


def _deliver(send: trio.MemorySendChannel[ChunkEvent], event: ChunkEvent) -> None:
    """Hand an event to a request's stream; a client that already left just misses it."""
    with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        send.send_nowait(event)


class RunnerSupervisor:
    def __init__(self, spec: RunnerSpec) -> None:
        self.spec = spec
        self.state: RunnerState = "starting"
        self.ready_info: Ready | None = None
        self.failure: str | None = None
        self.restarts = 0
        self.cancelled = 0
        """Generations the runner reports as stopped by a cancel (client gone, /v1/cancel)."""
        self._ready = trio.Event()
        self._in_flight: dict[RequestId, trio.MemorySendChannel[ChunkEvent]] = {}
        self._child: Child | None = None

    # --- the service -------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the runner and restart it whenever it dies; returns only if the model can't load."""
        task_status.started()
        await keep_restarting(self._run_once, self._again)

    def _again(self, exit_code: int | None, delay: float) -> bool:
        """After the runner ended: fail what was in flight, and say whether to start it again."""
        self.fail_in_flight(f"the model runner stopped unexpectedly (exit code {exit_code})")
        if self.state == "failed":
            log.error("model %s cannot be served: %s", self.spec.model_id, self.failure)
            return False
        self.state, self._ready, self.restarts = "restarting", trio.Event(), self.restarts + 1
        log.warning(
            "runner for %s exited (code %s); restarting in %.1fs", self.spec.model_id, exit_code, delay
        )
        return True

    async def _run_once(self) -> int | None:
        launch = Launch(
            RUNNER_COMMAND,
            child_environment(self.spec),
            MAX_FRAME_BYTES,
            spec_frame=encode_frame(Start(spec=self.spec)),
            stop_grace_s=self.spec.exit_grace_s,
        )
        async with running(launch) as child:
            self._child = child
            log.info("runner for %s started (pid %d)", self.spec.model_id, child.pid)
            try:
                self._on_message(decode_message(bytes(await child.handshake(timeout=None))))
                while (frame := await child.receive_frame()) is not None:
                    self._on_message(decode_message(bytes(frame)))
            except ChildFailed:
                pass  # it died while loading: its exit code says the rest
            except FrameError:
                log.exception("runner for %s sent a bad frame; restarting it", self.spec.model_id)
            finally:
                self._child = None
        return child.returncode

    def _on_message(self, message: RunnerMessage) -> None:
        if isinstance(message, RequestEvent):
            send = self._in_flight.get(message.request_id)
            if send is None:
                return
            if is_terminal(message.event):
                del self._in_flight[message.request_id]
                if isinstance(message.event, Finish) and message.event.reason == "cancelled":
                    self.cancelled += 1
            _deliver(send, message.event)
        elif isinstance(message, Ready):
            self.state, self.ready_info = "ready", message
            log.info(
                "model %s ready (%s, context %d tokens)",
                self.spec.model_id,
                message.model_type,
                message.context_length,
            )
            self._ready.set()
        elif isinstance(message, LoadFailed):
            self.state, self.failure = "failed", message.message
            self._ready.set()

    def fail_in_flight(self, message: str) -> None:
        """End every in-flight request with a server_error (the runner died or is being stopped)."""
        in_flight, self._in_flight = self._in_flight, {}
        for send in in_flight.values():
            _deliver(send, _error(message))

    async def _send(self, message: RunnerMessage) -> bool:
        """False when the runner is gone: its pump notices and fails the requests."""
        child = self._child
        return child is not None and await child.send(encode_frame(message))

    # --- what the API uses -------------------------------------------------------------------
    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        send, receive = trio.open_memory_channel[ChunkEvent](math.inf)
        stream = ChannelEvents(receive)
        with send, receive:
            with trio.move_on_after(self.spec.ready_timeout_s):
                await self._ready.wait()
            if self.state != "ready":
                reason = (
                    self.failure or f"the model runner is not ready after {self.spec.ready_timeout_s:.0f}s"
                )
                send.send_nowait(_error(f"model {self.spec.model_id} is unavailable: {reason}"))
                yield stream
                return
            if len(self._in_flight) >= self.spec.max_concurrent + self.spec.max_queued:
                send.send_nowait(_overloaded(self.spec))
                yield stream
                return
            self._in_flight[request.request_id] = send
            if not await self._send(Generate(request=request)):
                self._in_flight.pop(request.request_id, None)
                send.send_nowait(_error("the model runner stopped unexpectedly"))
            try:
                yield stream
            finally:
                if not stream.finished and request.request_id in self._in_flight:
                    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                        await self._send(Cancel(request_id=request.request_id))

    async def cancel(self, request_id: RequestId) -> bool:
        if request_id not in self._in_flight:
            return False
        return await self._send(Cancel(request_id=request_id))

    def has_request(self, request_id: RequestId) -> bool:
        return request_id in self._in_flight

    @property
    def _batch_capacity(self) -> int:
        """Requests the runner decodes at once; the rest of those in flight wait in its queue (it
        admits whenever a place frees). A pipeline runs one request at a time."""
        return (
            1 if self.spec.pipeline is not None or self.spec.tensor is not None else self.spec.max_concurrent
        )

    @property
    def ring_port(self) -> int | None:
        """Pipeline mode: where the running driver accepts its last stage; None while not ready."""
        return self.ready_info.ring_port if self.state == "ready" and self.ready_info else None

    def health(self) -> RunnerHealth:
        return RunnerHealth(
            model=self.spec.model_id,
            state=self.state,
            pid=self._child.pid if self._child is not None else None,
            restarts=self.restarts,
            active_requests=len(self._in_flight),
            queued_requests=max(0, len(self._in_flight) - self._batch_capacity),
            cancelled=self.cancelled,
            context_length=self.ready_info.context_length if self.ready_info else None,
            error=self.failure,
        )
