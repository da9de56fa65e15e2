"""Keeps one runner process per model alive and multiplexes requests over its pipes.

The node's trio loop only moves frames; MLX runs in the child. When the child dies (crash, OOM,
SIGKILL) every in-flight request gets a `server_error` event at once and a fresh runner starts.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio

from node.cpu.fastpath import runner_environment
from protocol.backoff import RESTART, Backoff
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, Finish, GenerationError, is_terminal
from protocol.ids import ModelId, RequestId
from protocol.runner_wire import (
    Cancel,
    FrameError,
    Generate,
    LoadFailed,
    MessageDecoder,
    Ready,
    RequestEvent,
    RunnerMessage,
    encode_frame,
)

if TYPE_CHECKING:
    # libp2p pulls in trio-typing, whose stubs shadow trio's own types for the type checker.
    from trio_typing import TaskStatus

log = logging.getLogger("shoal.runner")

RunnerState = Literal["starting", "ready", "restarting", "failed"]


@dataclass(frozen=True)
class RunnerSpec:
    model_id: ModelId
    model_path: Path
    vocab_dir: Path | None = None
    prefill_step_size: int = 512
    max_concurrent: int = 8
    """Requests the runner decodes together in one batch; more wait in its queue."""
    max_queued: int = 32
    """Requests that may wait beyond `max_concurrent`; past that one gets `overloaded` (HTTP 429)."""
    prefix_cache_tokens: int = 8192
    """The runner's prefix cache budget in tokens, 0 = off (see `node.runner.prefix_cache`)."""
    ready_timeout_s: float = 300.0
    """How long a request waits for a (re)starting runner before it fails."""
    exit_grace_s: float = 2.0
    """How long a runner gets to exit after its stdin closes before it is killed."""
    fast_path: bool = True
    """Optimized BLAS and thread count for the runner on Linux CPUs (`node.cpu.fastpath`)."""
    pipeline: tuple[int, str, tuple[str, ...]] | None = None
    """Pipeline mode: (end layer k, host the last stage dials back, HOST:PORT of the later stages);
    the runner then holds layers [0, k) and drives the others (`node.runner.pipeline_mode`)."""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "node.runner", "--model-path", str(self.model_path)]
        cmd += ["--prefill-step-size", str(self.prefill_step_size)]
        cmd += ["--max-concurrent", str(self.max_concurrent)]
        cmd += ["--prefix-cache-tokens", str(self.prefix_cache_tokens)]
        if self.vocab_dir is not None:
            cmd += ["--vocab-dir", str(self.vocab_dir)]
        if self.pipeline is not None:
            end, host, stages = self.pipeline
            cmd += ["--pipeline-end", str(end), "--pipeline-host", host]
            cmd += ["--pipeline-stages", ",".join(stages)]
        return cmd


class _EventStream:
    """Iterates one request's events and stops after its terminal event."""

    def __init__(self, receive: trio.MemoryReceiveChannel[ChunkEvent]) -> None:
        self._receive = receive
        self.finished = False

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> ChunkEvent:
        if self.finished:
            raise StopAsyncIteration
        event = await self._receive.receive()
        self.finished = is_terminal(event)
        return event


def _error(message: str) -> GenerationError:
    return GenerationError(error_kind="server_error", message=message, code="runner_unavailable")


def _overloaded(spec: RunnerSpec) -> GenerationError:
    return GenerationError(
        error_kind="overloaded",
        message=(
            f"model {spec.model_id} is busy: {spec.max_concurrent} requests are running and "
            f"{spec.max_queued} waiting; retry later"
        ),
        code="too_many_requests",
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
        self._process: trio.Process | None = None
        self._send_lock = trio.Lock()

    # --- the service -------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the runner and restart it whenever it dies; returns only if the model can't load."""
        task_status.started()
        backoff = Backoff(RESTART)
        while True:
            backoff.started(trio.current_time())
            exit_code = await self._run_once()
            self.fail_in_flight(f"the model runner stopped unexpectedly (exit code {exit_code})")
            if self.state == "failed":
                log.error("model %s cannot be served: %s", self.spec.model_id, self.failure)
                return
            self.state, self._ready, self.restarts = "restarting", trio.Event(), self.restarts + 1
            delay = backoff.failed(trio.current_time())
            log.warning(
                "runner for %s exited (code %s); restarting in %.1fs", self.spec.model_id, exit_code, delay
            )
            await trio.sleep(delay)

    async def _run_once(self) -> int | None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if self.spec.vocab_dir is not None:
            env["TIKTOKEN_ENCODINGS_BASE"] = str(self.spec.vocab_dir)
        env.update(runner_environment(env, enabled=self.spec.fast_path))
        process = await trio.lowlevel.open_process(
            self.spec.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._process = process
        log.info("runner for %s started (pid %d)", self.spec.model_id, process.pid)
        try:
            await self._pump(process)
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(process)
            self._process = None
        return process.returncode

    async def _pump(self, process: trio.Process) -> None:
        assert process.stdout is not None
        decoder = MessageDecoder()
        while data := await process.stdout.receive_some(65536):
            try:
                messages = decoder.feed(data)
            except FrameError:
                log.exception("runner for %s sent a bad frame; restarting it", self.spec.model_id)
                return
            for message in messages:
                self._on_message(message)

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

    async def _stop(self, process: trio.Process) -> None:
        if process.stdin is not None:
            await process.stdin.aclose()
        with trio.move_on_after(self.spec.exit_grace_s):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()

    def fail_in_flight(self, message: str) -> None:
        """End every in-flight request with a server_error (the runner died or is being stopped)."""
        in_flight, self._in_flight = self._in_flight, {}
        for send in in_flight.values():
            _deliver(send, _error(message))

    async def _send(self, message: RunnerMessage) -> bool:
        process = self._process
        if process is None or process.stdin is None:
            return False
        async with self._send_lock:
            try:
                await process.stdin.send_all(encode_frame(message))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False  # the runner is gone; its pump notices and fails the requests
        return True

    # --- what the API uses -------------------------------------------------------------------
    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        send, receive = trio.open_memory_channel[ChunkEvent](math.inf)
        stream = _EventStream(receive)
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
        return 1 if self.spec.pipeline is not None else self.spec.max_concurrent

    def health(self) -> dict[str, Any]:
        return {
            "model": self.spec.model_id,
            "state": self.state,
            "pid": self._process.pid if self._process is not None else None,
            "restarts": self.restarts,
            "active_requests": len(self._in_flight),
            "queued_requests": max(0, len(self._in_flight) - self._batch_capacity),
            "cancelled": self.cancelled,
            "context_length": self.ready_info.context_length if self.ready_info else None,
            "error": self.failure,
        }
