"""Failover: a generation whose instance breaks off goes on elsewhere, and its client never knows.

`Failover.open_stream(request)` has the contract of `Backend.open_stream`. It runs the request on
the model's best entry node (`entries(model)`, best first; `open_on(entry, request)` runs one
attempt there). When an attempt ends with an error that `fails_over` accepts (the entry node
unreachable or gone, its runner dead or stopped, a pipeline stage broken off), it sends the request
again with `resume`, the tokens the client already has (`Delivered`): to the next entry not tried
yet, or, once every one was, to the best again after a short backoff (the leader re-placing the
instance, a runner restarting, a model loading). The runner that takes it feeds those tokens
through its parser without emitting their events, after a prefill of the prompt and them (greedy),
or decoding them again one step each (seeded: the sampler's key then is where it was; see
`node.runner.engine.Admitted`), so the stream just goes on: no error, no repeated or missing text,
the tokens of an uninterrupted run. Prefill progress is passed on only before any output.

Bounds: an instance must take the request over (send its first event) within `timeout_s` of the
break-off, else the stream ends with the last error, as it would without failover. A request that
breaks `max_breaks` times in a row without a new token (one that kills every runner it reaches)
ends with its error too. Never failed over: client errors, context-length errors, a full queue on
the first attempt, cancellation, and a model whose files no node can get (`model_files_unavailable`:
the entry node says so at once, rather than this waiting out `timeout_s` for nothing).
`cancel(request_id)` reaches the attempt in flight (its runner ends it with `Finish(cancelled)`), or
ends a request between attempts at once.

Each attempt after the first runs under its own request id (`<id>.<n>`): a runner that is still
dropping an abandoned attempt never mistakes the new one for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence, Set
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

import trio

from node.config import NodeConfig
from node.runner.supervisor import ChannelEvents
from protocol.backoff import Backoff, BackoffPolicy
from protocol.chat import GenerateRequest, Resume
from protocol.events import (
    MODEL_LOADING,
    MODEL_NOT_FOUND,
    NODE_UNAVAILABLE,
    PIPELINE_FAILED,
    RUNNER_UNAVAILABLE,
    TOO_MANY_REQUESTS,
    UNFINISHED,
    ChunkEvent,
    ErrorCode,
    Finish,
    GenerationError,
    OutputEvent,
    PrefillProgress,
    TerminalEvent,
    Usage,
)
from protocol.ids import ModelId, NodeId, RequestId

log = logging.getLogger("shoal.failover")

MAX_BREAKS = 3
"""Break-offs in a row without a new token before the error goes to the client: a request that
makes every runner it reaches crash (out of memory) must not take the cluster down one by one."""
RETRY = BackoffPolicy(min_s=0.2, max_s=2.0)
"""Between rounds over the entries: soon at first (a replica or a restarted runner is ready at
once), then every 2 s at most, cheap for the entries (a refused dial, a local check)."""

BREAK_CODES: frozenset[ErrorCode] = frozenset({NODE_UNAVAILABLE, RUNNER_UNAVAILABLE, PIPELINE_FAILED})
"""The instance broke off or cannot be reached: another one, or this one restarted, may take over."""
WAIT_CODES: frozenset[ErrorCode] = frozenset({MODEL_LOADING, MODEL_NOT_FOUND, TOO_MANY_REQUESTS})
"""Once failing over only: the instance is being re-placed (its record gone for a moment, then its
runner loading: `node.serving.backend`) or its queue is full (`node.runner.supervisor`); wait and retry."""


def fails_over(error: GenerationError, *, failing_over: bool) -> bool:
    """Whether the request should go to another attempt rather than end with `error`."""
    if error.code in BREAK_CODES:
        return True
    return failing_over and error.code in WAIT_CODES


def choose_entry(entries: Sequence[NodeId], tried: Set[NodeId | None]) -> tuple[NodeId | None, bool]:
    """The entry for the next attempt, and whether to pause before it: the best entry not tried
    since the last pause; once every one was, pause, then start again from the best. None: no entry
    is known (between a record's removal and the re-placement): this node answers why."""
    fresh = [entry for entry in entries if entry not in tried]
    if fresh:
        return fresh[0], False
    return (entries[0] if entries else None), bool(tried)


@dataclass
class Delivered:
    """What the client has of a generation: the tokens behind its output events, and how many of
    those events came after the last token's (the `Resume` that continues it exactly)."""

    tokens: list[int] = field(default_factory=list)
    group: int = 0
    """Output events since (and with) the last one that carried tokens."""
    prompt_tokens: int = 0
    """From the first prefill report (for the usage of a request cancelled between attempts)."""
    progress: int = -1
    """The last prefill figure passed on: later attempts' reports are passed on only past it."""

    def add(self, event: OutputEvent) -> None:
        if event.tokens:
            self.tokens.extend(event.tokens)
            self.group = 1
        else:
            self.group += 1

    def resume(self) -> Resume | None:
        """None while the client has no output: the request then simply starts again."""
        return Resume(tokens=tuple(self.tokens), events=self.group) if self.tokens else None

    def passes(self, event: PrefillProgress) -> bool:
        """Whether to pass a prefill report on: only before any output, and only rising."""
        if self.tokens or event.processed_tokens <= self.progress:
            return False
        self.progress = event.processed_tokens
        self.prompt_tokens = self.prompt_tokens or event.total_tokens
        return True


@dataclass(frozen=True)
class FailoverConfig:
    timeout_s: float = NodeConfig.failover_timeout_s
    """`shoal run --failover-timeout`; the reason for the default is in `NodeConfig`."""
    max_breaks: int = MAX_BREAKS
    retry: BackoffPolicy = RETRY


OpenOn = Callable[[NodeId | None, GenerateRequest], AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]]
"""One attempt on an entry node (None: this node, which answers why it cannot run it)."""
Entries = Callable[[ModelId], Sequence[NodeId]]
CancelRunning = Callable[[RequestId], Awaitable[bool]]


@dataclass
class _Generation:
    request: GenerateRequest
    delivered: Delivered = field(default_factory=Delivered)
    attempts: int = 0
    cancelled: bool = False
    scope: trio.CancelScope | None = None
    """The current attempt's or pause's: cancelling it aborts that."""
    running: bool = False
    """An attempt has taken the request (its runner can be told to cancel)."""

    @property
    def attempt_id(self) -> RequestId:
        rid = self.request.request_id
        return rid if self.attempts <= 1 else RequestId(f"{rid}.{self.attempts}")

    def next_request(self) -> GenerateRequest:
        self.attempts += 1
        if self.attempts == 1:
            return self.request
        update = {"request_id": self.attempt_id, "resume": self.delivered.resume()}
        return self.request.model_copy(update=update)

    def cancelled_finish(self) -> Finish:
        usage = Usage(
            prompt_tokens=self.delivered.prompt_tokens, completion_tokens=len(self.delivered.tokens)
        )
        return Finish(reason="cancelled", usage=usage)


@dataclass
class _Outcome:
    terminal: TerminalEvent | None = None
    """None: aborted (cancelled, or nobody took the request over in time)."""
    taken: bool = False
    progressed: bool = False
    """New tokens reached the client."""


class Failover:
    """Runs every request this node accepts; see the module docstring."""

    def __init__(
        self,
        open_on: OpenOn,
        entries: Entries,
        cancel_running: CancelRunning,
        config: FailoverConfig | None = None,
    ) -> None:
        self._open_on = open_on
        self._entries = entries
        self._cancel_running = cancel_running
        self.config = config or FailoverConfig()
        self._active: dict[RequestId, _Generation] = {}
        self.failovers = 0
        """Break-offs failed over (each counted once, however many attempts it took)."""

    def open_stream(self, request: GenerateRequest) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        return self._open(request)

    @asynccontextmanager
    async def _open(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        generation = _Generation(request)
        self._active[request.request_id] = generation
        send, receive = trio.open_memory_channel[ChunkEvent](0)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run, generation, send)
                try:
                    yield ChannelEvents(receive)
                finally:
                    nursery.cancel_scope.cancel()  # leaving early cancels the attempt in flight
        finally:
            if self._active.get(request.request_id) is generation:
                del self._active[request.request_id]

    async def cancel(self, request_id: RequestId) -> bool:
        """Cancel a request this node accepted; False when it knows no such request."""
        generation = self._active.get(request_id)
        if generation is None:
            return False
        generation.cancelled = True
        if generation.running and await self._cancel_running(generation.attempt_id):
            return True  # its runner ends it with Finish(cancelled)
        if generation.scope is not None:
            generation.scope.cancel()  # between attempts, or not reachable: end it here
        return True

    async def _run(self, generation: _Generation, send: trio.MemorySendChannel[ChunkEvent]) -> None:
        async with send:
            await send.send(await self._generate(generation, send))

    async def _generate(
        self, generation: _Generation, send: trio.MemorySendChannel[ChunkEvent]
    ) -> TerminalEvent:
        """Attempts until one ends the request; its terminal event (or the failover's own)."""
        model = generation.request.model
        tried: set[NodeId | None] = set()
        backoff = Backoff(self.config.retry)
        deadline = math.inf  # while failing over: when to give up
        breaks = 0
        error: GenerationError | None = None
        while True:
            if generation.cancelled:
                return generation.cancelled_finish()
            if error is not None and trio.current_time() >= deadline:
                return self._given_up(error)
            entry, pause = choose_entry(self._entries(model), tried)
            if pause:
                await self._pause(generation, backoff.failed(trio.current_time()), deadline)
                tried.clear()
                continue
            tried.add(entry)
            outcome = await self._attempt(entry, generation, send, deadline)
            ended = outcome.terminal
            if generation.cancelled:
                return ended if isinstance(ended, Finish) else generation.cancelled_finish()
            if ended is None:
                assert error is not None  # only a failover attempt has a deadline
                return self._given_up(error)
            if isinstance(ended, Finish) or not fails_over(ended, failing_over=error is not None):
                return ended
            if outcome.taken:
                backoff.succeeded()
                breaks = 0 if outcome.progressed else breaks + 1
            if breaks >= self.config.max_breaks:
                log.warning(
                    "request %s broke off %d times without a new token; giving up: %s",
                    generation.request.request_id,
                    breaks,
                    ended.message,
                )
                return ended
            if error is None or outcome.taken:  # a new break-off: a new bound
                self.failovers += 1
                deadline = trio.current_time() + self.config.timeout_s
                tried = {entry}
                log.warning(
                    "request %s broke off on %s after %d tokens (%s); failing over",
                    generation.request.request_id,
                    entry or "this node",
                    len(generation.delivered.tokens),
                    ended.message,
                )
            error = ended

    async def _attempt(
        self,
        entry: NodeId | None,
        generation: _Generation,
        send: trio.MemorySendChannel[ChunkEvent],
        deadline: float,
    ) -> _Outcome:
        """One attempt on `entry`: pass its events on until its terminal one, which it returns."""
        request = generation.next_request()
        outcome = _Outcome()
        with trio.CancelScope(deadline=deadline) as scope:
            generation.scope = scope
            try:
                async with self._open_on(entry, request) as events:
                    async for event in events:
                        if not outcome.taken and not isinstance(event, GenerationError):
                            outcome.taken = generation.running = True
                            scope.deadline = math.inf  # taken over: no bound on the generation
                            if request.resume is not None:
                                log.info(
                                    "request %s taken over by %s after %d tokens",
                                    generation.request.request_id,
                                    entry or "this node",
                                    len(request.resume.tokens),
                                )
                        if isinstance(event, Finish | GenerationError):
                            outcome.terminal = event
                            break
                        if isinstance(event, PrefillProgress):
                            if generation.delivered.passes(event):
                                await send.send(event)
                            continue
                        await send.send(event)
                        generation.delivered.add(event)
                        outcome.progressed = outcome.progressed or bool(event.tokens)
            finally:
                generation.scope, generation.running = None, False
        if outcome.terminal is None and not scope.cancelled_caught:
            outcome.terminal = UNFINISHED  # against the contract; never resumed blindly
        return outcome

    @staticmethod
    async def _pause(generation: _Generation, delay: float, deadline: float) -> None:
        with trio.CancelScope(deadline=min(trio.current_time() + delay, deadline)) as scope:
            generation.scope = scope
            try:
                await trio.sleep_forever()
            finally:
                generation.scope = None

    def _given_up(self, error: GenerationError) -> GenerationError:
        why = f"{error.message}; no instance took the request over within {self.config.timeout_s:g} s"
        return error.model_copy(update={"message": why})


__all__ = [
    "BREAK_CODES",
    "WAIT_CODES",
    "Delivered",
    "Failover",
    "FailoverConfig",
    "choose_entry",
    "fails_over",
]
