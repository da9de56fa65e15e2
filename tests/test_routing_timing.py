"""Generations across nodes (`node.serving.routing`), on trio's mock clock: keep-alives, the idle timeout and
the cancel grace against their configured periods.

Both sides are the real ones (`GenerationServer` on the entry node, `RemoteGenerations` on the
requester) over real `Channel`s; only the libp2p stream under each channel is an in-memory stand-in
that the test can freeze (nothing crosses, nothing closes) or reset (a killed node). Real nodes
and real meshes: tests/test_routing.py.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import trio
import trio.testing

from node.net.channel import Channel
from node.serving.routing import GenerationServer, RemoteGenerations, RoutingConfig
from protocol.chat import ChatMessage, GenerateRequest
from protocol.events import NODE_UNAVAILABLE, ChunkEvent, Finish, GenerationError, TextDelta, Usage
from protocol.generate_wire import KeepAlive, decode_entry_message
from protocol.ids import ModelId, RequestId

CONFIG = RoutingConfig()
REQUEST = GenerateRequest(
    request_id=RequestId("r1"), model=ModelId("m"), messages=(ChatMessage(role="user", content="hi"),)
)
DONE = Finish(reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))


class Wire:
    """Both directions of one stream; `frozen`: nothing is delivered (the entry node is stopped)."""

    def __init__(self) -> None:
        self.frozen = False
        self.to_requester: list[tuple[float, bytes]] = []
        """Every frame the entry node wrote, with the (mock) time it did."""
        self.ends = {side: trio.open_memory_channel[bytes](math.inf) for side in ("requester", "entry")}

    def stream(self, side: str) -> FakeStream:
        return FakeStream(self, side, "entry" if side == "requester" else "requester")


class FakeStream:
    """The part of libp2p's `INetStream` that `Channel` uses."""

    def __init__(self, wire: Wire, side: str, other: str) -> None:
        self._wire, self._side = wire, side
        self._send, self._receive = wire.ends[other][0], wire.ends[side][1]

    async def read(self, n: int) -> bytes:
        try:
            data = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return b""
        if self._wire.frozen:
            await trio.sleep_forever()  # held in the stopped node's buffers
        return data

    async def write(self, data: bytes) -> None:
        if self._side == "entry":
            self._wire.to_requester.append((trio.current_time(), data))
        self._send.send_nowait(data)

    async def close(self) -> None:
        await self._send.aclose()

    async def reset(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


class FakeMesh:
    """`open_channel` to the entry node: a channel pair on one `Wire`, its far end served by `server`."""

    def __init__(self, nursery: trio.Nursery, server: GenerationServer) -> None:
        self.wire = Wire()
        self._nursery, self._server = nursery, server

    async def open_channel(self, peer_id: str, protocol: str, *, max_frame_bytes: int) -> Channel:
        ours = Channel(cast(Any, self.wire.stream("requester")), "entry", protocol, max_frame_bytes)
        theirs = Channel(cast(Any, self.wire.stream("entry")), "requester", protocol, max_frame_bytes)
        for channel in (ours, theirs):
            channel.start_reading(self._nursery)
        self._nursery.start_soon(self._server.serve, "requester", theirs)
        return ours


Script = Callable[[list[float]], AsyncIterator[ChunkEvent]]
"""The entry node's runner: yields events; gets the list of times `cancel` was called."""
Requester = Callable[[RemoteGenerations, "FakeMesh"], Awaitable[None]]


def run(script: Script, requester: Requester) -> list[float]:
    """The requester's scenario against an entry node running `script`; the times it was cancelled."""
    cancels: list[float] = []

    @asynccontextmanager
    async def open_stream(request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        yield script(cancels)

    async def cancel(request_id: RequestId) -> bool:
        cancels.append(trio.current_time())
        return True

    async def main() -> None:
        with trio.fail_after(600):  # mock seconds: a wait that never ends fails instead of hanging
            await scenario()

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            mesh = FakeMesh(nursery, GenerationServer(open_stream, cancel, CONFIG))
            await requester(RemoteGenerations(cast(Any, mesh), CONFIG), mesh)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return cancels


async def collect(
    remote: RemoteGenerations, out: list[tuple[float, ChunkEvent]], on_event: Callable[[], Any] = lambda: None
) -> None:
    async with remote.open_stream("entry", REQUEST) as events:
        async for event in events:
            out.append((trio.current_time(), event))
            on_event()


async def quiet_for(seconds: float, cancels: list[float]) -> AsyncIterator[ChunkEvent]:
    """One token, `seconds` of silence (a long prefill, a slow decode), then the end."""
    yield TextDelta(text="a")
    await trio.sleep(seconds)
    yield DONE


def test_a_quiet_generation_is_kept_alive_and_never_times_out() -> None:
    got: list[tuple[float, ChunkEvent]] = []
    wire: list[Wire] = []

    async def requester(remote: RemoteGenerations, mesh: FakeMesh) -> None:
        wire.append(mesh.wire)
        await collect(remote, got)

    run(lambda cancels: quiet_for(9.5, cancels), requester)
    assert [(at, type(e)) for at, e in got] == [(0.0, TextDelta), (9.5, Finish)]
    keep_alives = [at for at, frame in wire[0].to_requester if decode_entry_message(frame[4:]) == KeepAlive()]
    interval = CONFIG.keepalive_interval_s
    assert keep_alives == [interval * k for k in range(1, 10)], keep_alives  # one per quiet interval


def test_a_frozen_entry_node_ends_the_stream_after_the_idle_timeout() -> None:
    got: list[tuple[float, ChunkEvent]] = []

    async def requester(remote: RemoteGenerations, mesh: FakeMesh) -> None:
        await trio.sleep(0.5)
        await collect(remote, got, on_event=lambda: setattr(mesh.wire, "frozen", True))

    run(lambda cancels: quiet_for(60.0, cancels), requester)
    (first_at, _), (error_at, error) = got
    assert isinstance(error, GenerationError) and error.code == NODE_UNAVAILABLE, error
    assert "no answer for 3 s" in error.message
    assert error_at - first_at == CONFIG.idle_timeout_s  # its last frame was the token


def test_a_killed_entry_node_ends_the_stream_at_once() -> None:
    got: list[tuple[float, ChunkEvent]] = []

    async def requester(remote: RemoteGenerations, mesh: FakeMesh) -> None:
        async def kill() -> None:
            await trio.sleep(2.5)
            for send, receive in mesh.wire.ends.values():  # the connection closes
                await send.aclose()
                await receive.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill)
            await collect(remote, got)

    run(lambda cancels: quiet_for(60.0, cancels), requester)
    error_at, error = got[-1]
    assert isinstance(error, GenerationError) and error.code == NODE_UNAVAILABLE, error
    assert error_at == 2.5


async def ignores_cancel(cancels: list[float]) -> AsyncIterator[ChunkEvent]:
    """A runner that never ends the request itself: only leaving its stream stops it."""
    yield TextDelta(text="a")
    await trio.sleep(60.0)
    yield DONE


async def honours_cancel(cancels: list[float]) -> AsyncIterator[ChunkEvent]:
    """A runner that ends a cancelled request 0.5 s later (a decode step) with Finish(cancelled)."""
    yield TextDelta(text="a")
    while not cancels:
        await trio.sleep(0.1)
    await trio.sleep(0.5)
    yield Finish(reason="cancelled", usage=Usage(prompt_tokens=1, completion_tokens=1))


def cancelling_at_1s(got: list[tuple[float, ChunkEvent]]) -> Requester:
    """A requester that streams into `got` and cancels the request 1 s in."""

    async def requester(remote: RemoteGenerations, mesh: FakeMesh) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, remote, got)
            await trio.sleep(1.0)
            assert await remote.cancel(REQUEST.request_id)

    return requester


def test_a_cancel_reaches_the_runner_and_its_finish_the_requester() -> None:
    got: list[tuple[float, ChunkEvent]] = []
    assert run(honours_cancel, cancelling_at_1s(got)) == [1.0]
    finish_at, finish = got[-1]
    assert isinstance(finish, Finish) and finish.reason == "cancelled"
    assert abs(finish_at - 1.5) <= 0.1  # the runner's own end, passed on at once


def test_a_runner_that_ignores_a_cancel_is_left_after_the_grace() -> None:
    got: list[tuple[float, ChunkEvent]] = []
    assert run(ignores_cancel, cancelling_at_1s(got)) == [1.0]
    error_at, error = got[-1]
    assert isinstance(error, GenerationError) and error.code == NODE_UNAVAILABLE, error
    assert error_at == 1.0 + CONFIG.cancel_grace_s  # the entry left the stream: the channel reset
