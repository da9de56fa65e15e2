"""Generations across nodes: a request accepted on any node runs on its instance's entry node.

- `serve_generations(mesh, open_stream, cancel)`: this node runs generations for its peers. For
  each channel on `GENERATE_PROTOCOL` it reads one `RemoteGenerate`, enters `open_stream(request)`
  (this node's own runner) and sends every event back as it comes, plus a `KeepAlive` whenever it
  has been silent for `keepalive_interval_s`. A `RemoteCancel` frame calls `cancel(request_id)`, so the
  runner's own `Finish(cancelled)` goes back; the requester closing its side, resetting or
  vanishing (or that Finish not coming within `cancel_grace_s`) leaves the stream's context,
  which cancels the generation in the runner.
- `RemoteGenerations(mesh).open_stream(entry_node_id, request)`: the requester's side, with the
  semantics of `RunnerSupervisor.open_stream`: it yields the entry node's events up to the
  terminal one, and leaving the context early sends `RemoteCancel` and closes the channel. It never
  raises for a peer's failure and never hangs: a node that is not connected, dies (connection
  closed), sends garbage or stays silent (not even a keep-alive) for `idle_timeout_s` ends the
  stream with one `GenerationError(server_error, code="node_unavailable")` naming the node.

Events go point to point between the two nodes, never through the leader or gossip. The
`open_stream` given to `serve_generations` must run requests locally: one that routes again could
loop.

Timing: a dead entry node is noticed at once (the connection closes); a frozen one after
`idle_timeout_s` (3 s) of silence, well before py-libp2p's ping monitor drops it (~3 s + a ping)
and within the 5 s a client may wait.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import trio

from node.net.channel import Channel, ChannelClosed, ChannelError, ChannelTimeout
from node.net.mesh import Mesh
from protocol.chat import GenerateRequest
from protocol.events import NODE_UNAVAILABLE, REQUEST_TOO_LARGE, ChunkEvent, GenerationError, is_terminal
from protocol.generate_wire import (
    GENERATE_PROTOCOL,
    MAX_MESSAGE_BYTES,
    Event,
    GenerateWireError,
    KeepAlive,
    RemoteCancel,
    RemoteGenerate,
    decode_entry_message,
    decode_requester_message,
    encode,
)
from protocol.ids import RequestId

log = logging.getLogger("shoal.routing")

_KEEP_ALIVE = encode(KeepAlive())
_CANCEL = encode(RemoteCancel())


@dataclass(frozen=True)
class RoutingConfig:
    keepalive_interval_s: float = 1.0
    """Entry node: a KeepAlive after this long without a frame (runner starting, long prefill,
    slow decode: 4-bit models decode at ~0.3 tok/s on a weak CPU). Costs 17 bytes per second."""
    idle_timeout_s: float = 3.0
    """Requester: this long without any frame (3 keep-alive periods, so one late keep-alive on a
    loaded node is no false alarm) means the entry node is frozen. Also bounds opening the channel.
    A client thus hears of a frozen node within ~3 s, of a dead one at once."""
    request_timeout_s: float = 5.0
    """Entry node: the RemoteGenerate frame must arrive this soon after the channel opens."""
    cancel_grace_s: float = 2.0
    """Entry node, after a RemoteCancel: how long it keeps streaming so that the runner's own
    `Finish(cancelled)` reaches the requester, before it leaves the stream (which cancels anyway)."""
    close_timeout_s: float = 1.0
    """Requester: sending RemoteCancel and closing on an early exit, even inside a cancelled scope."""


OpenStream = Callable[[GenerateRequest], AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]]
"""Runs a generation on this node, with `RunnerSupervisor.open_stream`'s contract."""
CancelRequest = Callable[[RequestId], Awaitable[bool]]
"""Cancels a running generation so that it ends with `Finish(cancelled)` (`RunnerSupervisor.cancel`)."""


# --- the entry node's side -----------------------------------------------------------------------
@dataclass
class ServerStats:
    served: int = 0
    """Generations started for peers."""
    active: int = 0
    requester_gone: int = 0
    """Generations left before their end because the requester closed, cancelled or vanished."""
    bad_requests: int = 0
    """Channels dropped because the first frame was missing, late or not a valid RemoteGenerate."""


class GenerationServer:
    """Serves `GENERATE_PROTOCOL`; made and registered by `serve_generations`."""

    def __init__(self, open_stream: OpenStream, cancel: CancelRequest | None, config: RoutingConfig) -> None:
        self.open_stream = open_stream
        self.cancel = cancel
        self.config = config
        self.stats = ServerStats()

    async def serve(self, peer_id: str, channel: Channel) -> None:
        try:
            message = decode_requester_message(await channel.receive(self.config.request_timeout_s))
        except (ChannelError, GenerateWireError) as exc:
            self.stats.bad_requests += 1
            log.debug("dropped a generate channel from %s: %s", peer_id, exc)
            await channel.reset()
            return
        if not isinstance(message, RemoteGenerate):
            self.stats.bad_requests += 1
            await channel.reset()
            return
        self.stats.served += 1
        self.stats.active += 1
        try:
            finished = await self._stream(channel, message.request)
        finally:
            self.stats.active -= 1
        if not finished:
            self.stats.requester_gone += 1
            await channel.reset()

    async def _stream(self, channel: Channel, request: GenerateRequest) -> bool:
        """Stream the generation's events; True once the terminal event went out."""
        generation = trio.CancelScope()
        sender = _Sender(channel, trio.current_time())
        finished = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_alive, sender, generation)
            nursery.start_soon(self._watch_requester, channel, request.request_id, generation)
            with generation:
                try:
                    async with self.open_stream(request) as events:
                        async for event in events:
                            await sender.send(encode(Event(event=event)))
                            if is_terminal(event):
                                finished = True
                                break
                except ChannelError as exc:
                    log.debug("requester of %s is gone: %s", request.request_id, exc)
            nursery.cancel_scope.cancel()
        return finished

    async def _keep_alive(self, sender: _Sender, generation: trio.CancelScope) -> None:
        interval = self.config.keepalive_interval_s
        while True:
            due = sender.last_sent + interval
            if trio.current_time() < due:
                await trio.sleep_until(due)
                continue
            try:
                # Shielded: cancelled mid-write (the stream just ended) it would tear the frame
                # after the terminal event, and the channel would be reset instead of closed.
                with trio.CancelScope(shield=True), trio.move_on_after(self.config.request_timeout_s):
                    await sender.send(_KEEP_ALIVE)
            except ChannelError:
                generation.cancel()
                return

    async def _watch_requester(
        self, channel: Channel, request_id: RequestId, generation: trio.CancelScope
    ) -> None:
        """Leave the generation when the requester goes away; pass a RemoteCancel on to the runner."""
        while True:
            try:
                message = decode_requester_message(await channel.receive())
            except (ChannelError, GenerateWireError) as exc:  # closed, reset, lost, garbage
                log.debug("requester of %s: %s", request_id, exc)
                generation.cancel()
                return
            if not isinstance(message, RemoteCancel):
                generation.cancel()  # a second RemoteGenerate: a protocol violation
                return
            if self.cancel is None:
                generation.cancel()
                return
            generation.deadline = min(generation.deadline, trio.current_time() + self.config.cancel_grace_s)
            await self.cancel(request_id)


class _Sender:
    """Sends frames and remembers when the last one went out (for the keep-alive timer)."""

    def __init__(self, channel: Channel, now: float) -> None:
        self.channel = channel
        self.last_sent = now

    async def send(self, frame: bytes) -> None:
        self.last_sent = trio.current_time()
        await self.channel.send(frame)


def serve_generations(
    mesh: Mesh,
    open_stream: OpenStream,
    cancel: CancelRequest | None = None,
    config: RoutingConfig | None = None,
) -> GenerationServer:
    """Serve peers' generations from `open_stream` (which must run them on this node) from now on.

    Without `cancel`, a requester's `RemoteCancel` leaves the stream at once (the runner is cancelled
    all the same), and the requester's stream ends with a `node_unavailable` error instead of
    `Finish(cancelled)`.
    """
    server = GenerationServer(open_stream, cancel, config or RoutingConfig())
    mesh.set_channel_handler(GENERATE_PROTOCOL, server.serve, max_frame_bytes=MAX_MESSAGE_BYTES)
    return server


# --- the requester's side ------------------------------------------------------------------------
def _unavailable(node_id: str, why: str) -> GenerationError:
    return GenerationError(
        error_kind="server_error", message=f"node {node_id} is unavailable: {why}", code=NODE_UNAVAILABLE
    )


class _RemoteStream:
    """Iterates one remote generation's events; stops after its terminal event.

    `__anext__` may be cancelled at any point (the API pumps it from another task and cancels
    the wait): nothing is lost, the channel buffers whole frames.
    """

    def __init__(self, node_id: str, channel: Channel | None, idle_timeout_s: float) -> None:
        self.node_id = node_id
        self.channel = channel
        self.idle_timeout_s = idle_timeout_s
        self.finished = False
        self.failed = False
        self._pending: ChunkEvent | None = None

    def fail_with(self, event: ChunkEvent) -> None:
        """Yield `event` next and end (used when the request never got off the ground)."""
        self._pending = event

    def __aiter__(self) -> _RemoteStream:
        return self

    async def __anext__(self) -> ChunkEvent:
        if self.finished:
            raise StopAsyncIteration
        if self._pending is not None or self.channel is None:
            self.finished = self.failed = True
            return self._pending or _unavailable(self.node_id, "no channel")
        while True:
            try:
                message = decode_entry_message(await self.channel.receive(self.idle_timeout_s))
            except ChannelTimeout:
                return self._broke_off(f"no answer for {self.idle_timeout_s:.0f} s")
            except ChannelClosed:
                return self._broke_off("the stream broke off before the generation finished")
            except ChannelError as exc:
                return self._broke_off(f"lost the connection ({exc})")
            except GenerateWireError as exc:
                return self._broke_off(f"it sent an undecodable message ({exc})")
            if isinstance(message, Event):
                self.finished = is_terminal(message.event)
                return message.event

    def _broke_off(self, why: str) -> GenerationError:
        self.finished = self.failed = True
        return _unavailable(self.node_id, why)


class RemoteGenerations:
    """Runs generations on other nodes' runners over `GENERATE_PROTOCOL`."""

    def __init__(self, mesh: Mesh, config: RoutingConfig | None = None) -> None:
        self.mesh = mesh
        self.config = config or RoutingConfig()
        self._in_flight: dict[RequestId, _RemoteStream] = {}

    def open_stream(
        self, entry_node_id: str, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        """Run `request` on `entry_node_id`'s runner; the same contract as `Backend.open_stream`.

        Entering never raises for the peer's failure: the stream then yields one
        `GenerationError(server_error, code="node_unavailable")` (or `invalid_request` when the
        request is over the wire's size cap). Entering takes at most `idle_timeout_s`.
        """
        return self._open_stream(entry_node_id, request)

    @asynccontextmanager
    async def _open_stream(
        self, node_id: str, request: GenerateRequest
    ) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        try:
            payload = encode(RemoteGenerate(request=request))
        except GenerateWireError as exc:
            stream = _RemoteStream(node_id, None, self.config.idle_timeout_s)
            stream.fail_with(
                GenerationError(error_kind="invalid_request", message=str(exc), code=REQUEST_TOO_LARGE)
            )
            yield stream
            return
        channel, why = await self._start(node_id, payload)
        stream = _RemoteStream(node_id, channel, self.config.idle_timeout_s)
        if channel is None:
            stream.fail_with(_unavailable(node_id, why))
            yield stream
            return
        self._in_flight[request.request_id] = stream
        try:
            yield stream
        finally:
            if self._in_flight.get(request.request_id) is stream:
                del self._in_flight[request.request_id]
            await self._finish(stream, channel)

    async def _start(self, node_id: str, payload: bytes) -> tuple[Channel | None, str]:
        """Open a channel and send the request, within `idle_timeout_s`; (None, why) on failure."""
        channel: Channel | None = None
        try:
            with trio.fail_after(self.config.idle_timeout_s):
                channel = await self.mesh.open_channel(
                    node_id, GENERATE_PROTOCOL, max_frame_bytes=MAX_MESSAGE_BYTES
                )
                await channel.send(payload)
            return channel, ""
        except trio.TooSlowError:
            why = f"no answer within {self.config.idle_timeout_s:.0f} s"
        except ChannelError as exc:
            why = str(exc)
        except BaseException:  # cancelled (the client left): don't leave a half-open channel
            if channel is not None:
                await channel.reset()
            raise
        if channel is not None:
            await channel.reset()
        return None, why

    async def _finish(self, stream: _RemoteStream, channel: Channel) -> None:
        if stream.failed:
            await channel.reset()
            return
        if not stream.finished:  # an early exit: tell the entry node to stop, even when cancelled
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.close_timeout_s):
                try:
                    await channel.send(_CANCEL)
                except ChannelError:
                    await channel.reset()
        await channel.aclose()

    async def cancel(self, request_id: RequestId) -> bool:
        """Ask the entry node to cancel; the stream then ends with `Finish(reason="cancelled")`.

        False when no such remote generation is running or the entry node can't be told.
        """
        stream = self._in_flight.get(request_id)
        if stream is None or stream.finished or stream.channel is None:
            return False
        try:
            with trio.fail_after(self.config.close_timeout_s):
                await stream.channel.send(_CANCEL)
        except (ChannelError, trio.TooSlowError):
            return False
        return True


__all__ = [
    "CancelRequest",
    "GenerationServer",
    "OpenStream",
    "RemoteGenerations",
    "RoutingConfig",
    "serve_generations",
]
