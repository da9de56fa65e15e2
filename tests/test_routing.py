"""Generations routed between nodes: real meshes on 127.0.0.1, a real runner on the random model.

The entry node serves `/shoal/generate/1.0.0` from a `RunnerSupervisor`; another node, which holds
no model, runs requests there through `RemoteGenerations`. The entry node runs in this trio
process, or (to kill or freeze it) in a subprocess: `python -m tests.test_routing serve MODEL DIR`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import psutil
import pytest
import trio

from node.net import Mesh
from node.net.channel import ChannelError
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from node.serving.routing import RemoteGenerations, RoutingConfig, serve_generations
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams
from protocol.events import (
    NODE_UNAVAILABLE,
    ChunkEvent,
    Finish,
    GenerationError,
    PrefillProgress,
    TextDelta,
    Usage,
)
from protocol.generate_wire import (
    GENERATE_PROTOCOL,
    Event,
    GenerateWireError,
    KeepAlive,
    RemoteCancel,
    RemoteGenerate,
    decode_entry_message,
    decode_requester_message,
    encode,
)
from protocol.ids import ModelId, RequestId
from tests.meshes import config, running, wait_connected
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(180)

MODEL = ModelId("tiny")
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 3


def request(request_id: str, max_tokens: int | None = 64, content: str = PROMPT) -> GenerateRequest:
    return GenerateRequest(
        request_id=RequestId(request_id),
        model=MODEL,
        messages=(ChatMessage(role="user", content=content),),
        params=SamplingParams(temperature=0, max_tokens=max_tokens),
    )


async def collect(stream: AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]) -> list[ChunkEvent]:
    async with stream as events:
        return [event async for event in events]


def run(fn: Callable[[], Awaitable[None]], limit_s: float = 120) -> None:
    async def main() -> None:
        with trio.fail_after(limit_s):
            await fn()

    trio.run(main)


# --- the wire ------------------------------------------------------------------------------------
def test_wire_round_trip_and_garbage() -> None:
    req = request("r1")
    assert decode_requester_message(encode(RemoteGenerate(request=req))) == RemoteGenerate(request=req)
    assert decode_requester_message(encode(RemoteCancel())) == RemoteCancel()
    for event in (TextDelta(text="hé"), PrefillProgress(processed_tokens=0, total_tokens=9)):
        assert decode_entry_message(encode(Event(event=event))) == Event(event=event)
    assert decode_entry_message(encode(KeepAlive())) == KeepAlive()
    garbage = [b"", b"\xff", b"\x9f" * 10_000, encode(KeepAlive())[:-1], encode(RemoteCancel())]
    for body in garbage:  # the last: a requester message where an entry message belongs
        with pytest.raises(GenerateWireError):
            decode_entry_message(body)
    with pytest.raises(GenerateWireError):
        decode_requester_message(encode(Event(event=TextDelta(text="x"))))
    huge = request("r2", content="x" * (17 * 1024 * 1024))
    with pytest.raises(GenerateWireError, match="exceeds"):
        encode(RemoteGenerate(request=huge))


# --- entry node in this process ------------------------------------------------------------------
@asynccontextmanager
async def entry_and_requester(
    tmp_path: Path, model_dir: Path
) -> AsyncIterator[tuple[RunnerSupervisor, Mesh, Mesh]]:
    """A runner, the entry node's mesh serving it, and a model-less node connected to it."""
    runner = RunnerSupervisor(RunnerSpec(MODEL, model_path=model_dir, prefill_step_size=16))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        async with (
            running(config(tmp_path, "entry")) as entry,
            running(config(tmp_path, "requester", bootstrap_peers=(entry.addrs()[0],))) as requester,
        ):
            with trio.fail_after(10):
                await wait_connected(requester, entry)
                await wait_connected(entry, requester)
            yield runner, entry, requester
        nursery.cancel_scope.cancel()


def text_of(events: list[ChunkEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_remote_stream_is_the_local_stream(tmp_path: Path, random_model_dir: Path) -> None:
    """Same events as a local stream; early exit and cancel reach the runner (bench/ has speeds)."""

    async def scenario() -> None:
        async with entry_and_requester(tmp_path, random_model_dir) as (runner, entry, requester):
            server = serve_generations(entry, runner.open_stream, runner.cancel)
            remote = RemoteGenerations(requester)

            def idle() -> bool:
                return runner.health().active_requests == 0

            # The prefix cache makes a repeated prompt's prefill differ from the first one's:
            # a warm-up puts both measured streams in the same (cached) state.
            with trio.fail_after(60):
                await collect(runner.open_stream(request("warm-up")))
            local = await collect(runner.open_stream(request("local")))
            routed = await collect(remote.open_stream(entry.peer_id, request("remote")))
            assert routed == local
            assert isinstance(local[-1], Finish) and local[-1].reason == "length"
            assert local[-1].usage.completion_tokens == 64 and text_of(local)
            progress = [e for e in routed if isinstance(e, PrefillProgress)]
            assert len(progress) >= 2 and progress[0].processed_tokens == 0
            assert progress[-1].processed_tokens == progress[-1].total_tokens
            assert (server.stats.served, server.stats.active, server.stats.requester_gone) == (1, 0, 0)

            # A node that holds no shard of anything asks the entry node: the same stream again.
            async with running(config(tmp_path, "other", bootstrap_peers=(entry.addrs()[0],))) as other:
                with trio.fail_after(10):
                    await wait_connected(other, entry)
                    await wait_connected(entry, other)
                again = await collect(RemoteGenerations(other).open_stream(entry.peer_id, request("other")))
                assert again == local

            # Early exit: the runner's generation is cancelled (its request leaves the runner as
            # cancelled; with no max_tokens nothing else ends it before the context is full).
            async with remote.open_stream(entry.peer_id, request("early", max_tokens=None)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        break
            assert runner.health().active_requests in (0, 1)
            await wait_until_async(idle, 60, "the runner idle after the early exit")
            assert runner.health().cancelled == 1
            await wait_until_async(lambda: server.stats.active == 0, 60, "no stream served")
            assert server.stats.requester_gone == 1

            # cancel(): the stream ends with the runner's own Finish(cancelled).
            async with remote.open_stream(entry.peer_id, request("cancel-me", max_tokens=None)) as events:
                seen: list[ChunkEvent] = []
                async for event in events:
                    seen.append(event)
                    if isinstance(event, TextDelta) and len(seen) == 5:
                        assert await remote.cancel(RequestId("cancel-me"))
            assert isinstance(seen[-1], Finish) and seen[-1].reason == "cancelled"
            assert not await remote.cancel(RequestId("cancel-me"))
            await wait_until_async(idle, 60, "the runner idle after the cancel")
            assert runner.health().cancelled == 2

            # A node that is not connected: one error event, no exception, and no wait for an
            # answer (the error is not the idle timeout's).
            nowhere = await collect(remote.open_stream(requester.peer_id, request("nowhere")))
            assert len(nowhere) == 1 and isinstance(nowhere[0], GenerationError)
            assert (nowhere[0].error_kind, nowhere[0].code) == ("server_error", NODE_UNAVAILABLE)
            assert requester.peer_id in nowhere[0].message
            assert "no answer" not in nowhere[0].message, nowhere[0].message

            # A peer that sends garbage instead of a RemoteGenerate is dropped, the server carries on.
            channel = await requester.open_channel(entry.peer_id, GENERATE_PROTOCOL)
            await channel.send(b"\xff\x00 not cbor")
            with pytest.raises(ChannelError):
                await channel.receive(idle_timeout_s=5)
            await channel.reset()
            assert server.stats.bad_requests == 1

    run(scenario)


def test_slow_first_token_is_kept_alive(tmp_path: Path, random_model_dir: Path) -> None:
    """A source that takes longer than the idle timeout to start: keep-alives carry it through."""

    class SlowSource:
        def __init__(self, runner: RunnerSupervisor, delay_s: float) -> None:
            self.runner, self.delay_s = runner, delay_s

        @asynccontextmanager
        async def open_stream(self, req: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
            await trio.sleep(self.delay_s)  # a model loading, a long prefill
            async with self.runner.open_stream(req) as events:
                yield events

        async def cancel(self, request_id: RequestId) -> bool:
            return await self.runner.cancel(request_id)

    async def scenario() -> None:
        async with entry_and_requester(tmp_path, random_model_dir) as (runner, entry, requester):
            cfg = RoutingConfig(keepalive_interval_s=0.2, idle_timeout_s=0.8)
            source = SlowSource(runner, delay_s=2.0)
            serve_generations(entry, source.open_stream, source.cancel, cfg)
            events = await collect(
                RemoteGenerations(requester, cfg).open_stream(entry.peer_id, request("slow"))
            )
            assert isinstance(events[-1], Finish), events[-1]

    run(scenario)


def test_early_exits_from_a_flood_keep_the_connection(tmp_path: Path) -> None:
    """Clients leaving while events pour in (cancelled sends and reads) never break the connection.

    py-libp2p 0.8.1 without `mesh.shield_frame_writes` lost the connection within two of these.
    """

    @asynccontextmanager
    async def flood(req: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        async def events() -> AsyncIterator[ChunkEvent]:
            for _ in range(100_000):
                yield TextDelta(text=" word")
            yield Finish(reason="length", usage=Usage(prompt_tokens=1, completion_tokens=100_000))

        yield events()

    async def echo(peer_id: str, payload: bytes) -> bytes:
        return payload

    async def scenario() -> None:
        async with (
            running(config(tmp_path, "entry")) as entry,
            running(config(tmp_path, "requester", bootstrap_peers=(entry.addrs()[0],))) as requester,
        ):
            with trio.fail_after(10):
                await wait_connected(requester, entry)
                await wait_connected(entry, requester)
            entry.set_request_handler(echo)
            server = serve_generations(entry, flood)
            remote = RemoteGenerations(requester)
            for i in range(20):
                async with remote.open_stream(entry.peer_id, request(f"flood-{i}")) as events:
                    async for event in events:
                        assert isinstance(event, TextDelta), event
                        if i % 2:  # half leave after the first event, half a little later
                            break
                        with trio.move_on_after(0.005):
                            await trio.sleep_forever()
                        break
            with trio.fail_after(60):
                assert await requester.request(entry.peer_id, b"still there") == b"still there"
            await wait_until_async(lambda: server.stats.active == 0, 60, "no stream served")
            assert server.stats.requester_gone == 20
            assert requester.stats.auth_succeeded == 1  # the one connection all along

    run(scenario)


# --- entry node in a subprocess: killed, frozen ---------------------------------------------------
def serve_main(model_dir: str, data_dir: str) -> None:
    """The subprocess: an entry node serving generations; prints `serving ADDR` once ready."""

    async def main() -> None:
        runner = RunnerSupervisor(RunnerSpec(MODEL, model_path=Path(model_dir)))
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            async with running(config(Path(data_dir), "entry")) as entry:
                serve_generations(entry, runner.open_stream, runner.cancel)
                await collect(runner.open_stream(request("warm-up", max_tokens=4)))
                print("serving", entry.addrs()[0], flush=True)
                await trio.sleep_forever()

    trio.run(main)


@asynccontextmanager
async def entry_process(model_dir: Path, data_dir: Path) -> AsyncIterator[tuple[trio.Process, str]]:
    """The entry node in a subprocess; killed with its runner (and continued first) at the end."""
    cmd = [sys.executable, "-m", "tests.test_routing", "serve", str(model_dir), str(data_dir)]
    process = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    assert process.stdout is not None
    try:
        output = b""
        with trio.fail_after(90):
            while b"\n" not in output:
                chunk = await process.stdout.receive_some(4096)
                assert chunk, "the entry node exited before serving"
                output += chunk
        line = output.split(b"\n", 1)[0].decode()
        assert line.startswith("serving "), line
        yield process, line.split()[1]
    finally:
        with trio.CancelScope(shield=True):
            try:
                children = psutil.Process(process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for proc in (psutil.Process(process.pid), *children):
                try:
                    proc.send_signal(signal.SIGKILL)
                    proc.send_signal(signal.SIGCONT)
                except psutil.NoSuchProcess:
                    pass
            with trio.move_on_after(10):
                await process.wait()
            await trio.to_thread.run_sync(lambda: psutil.wait_procs(children, timeout=10))


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_dead_or_frozen_entry_node_ends_the_stream_with_an_error(
    tmp_path: Path, random_model_dir: Path, how: str
) -> None:
    async def scenario() -> None:
        async with (
            entry_process(random_model_dir, tmp_path / "entry") as (process, addr),
            running(config(tmp_path, "requester", bootstrap_peers=(addr,))) as requester,
        ):
            with trio.fail_after(10):
                while not requester.connected_peers():
                    await requester.events.receive()
            entry_id = addr.rsplit("/", 1)[-1]
            remote = RemoteGenerations(requester)
            seen: list[ChunkEvent] = []
            async with remote.open_stream(entry_id, request("doomed", max_tokens=None)) as events:
                async for event in events:
                    seen.append(event)
                    if len(seen) == 10:
                        os.kill(process.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            error = seen[-1]
            assert isinstance(error, GenerationError), error
            assert (error.error_kind, error.code) == ("server_error", NODE_UNAVAILABLE)
            assert entry_id in error.message
            assert any(isinstance(e, TextDelta) for e in seen)
            # A dead node's connection closes at once; a frozen one's stays open and silent, and
            # the requester's idle timeout ends the stream (before py-libp2p's ping monitor would
            # drop the connection: `node.net.channel`).
            silent = f"no answer for {RoutingConfig().idle_timeout_s:.0f} s"
            assert (silent in error.message) == (how == "frozen"), error.message

            # Once it is gone, a new request fails too (not connected, or no answer).
            after = await collect(remote.open_stream(entry_id, request("after")))
            assert isinstance(after[-1], GenerationError) and after[-1].code == NODE_UNAVAILABLE

    run(scenario)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve_main(sys.argv[2], sys.argv[3])
