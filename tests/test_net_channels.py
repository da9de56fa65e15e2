"""Channels and named request protocols between real meshes: frames both ways, caps, failures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from node.net import RequestError
from node.net.channel import Channel, ChannelClosed, ChannelError, ChannelTimeout
from node.net.config import MeshConfig as NET
from tests.meshes import config, echo, run, running, wait_connected
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(90)


def test_channels_and_named_requests(tmp_path: Path) -> None:
    """Frames both ways, idle timeouts that lose nothing, caps, handler failures, a peer that dies."""

    async def scenario() -> None:
        served: list[str] = []

        async def echo_frames(peer_id: str, channel: Channel) -> None:
            served.append(peer_id)
            try:
                while True:
                    frame = await channel.receive()
                    if frame == b"fail":
                        raise RuntimeError("boom")
                    await channel.send(b"echo:" + frame)
            except ChannelClosed:
                served.append("closed")

        async def control(peer_id: str, payload: bytes) -> bytes:
            return b"control:" + payload

        async with running(config(tmp_path, "a", max_request_bytes=4 * 1024 * 1024)) as a:
            a.set_channel_handler("/test/echo/1", echo_frames)
            a.set_channel_handler("/test/small/1", echo_frames, max_frame_bytes=10)
            a.set_request_handler(echo)
            a.set_request_handler(control, protocol="/test/control/1")
            async with running(config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],))) as b:
                with trio.fail_after(10):
                    await wait_connected(b, a)
                # Named request protocols next to the sync one.
                assert await b.request(a.peer_id, b"x", protocol="/test/control/1") == b"control:x"
                assert await b.request(a.peer_id, b"x") == b"echo:x"
                with pytest.raises(RequestError):
                    await b.request(a.peer_id, b"x", protocol="/test/nobody/1")

                with trio.fail_after(20):
                    async with await b.open_channel(a.peer_id, "/test/echo/1") as channel:
                        big = random.randbytes(3 * 1024 * 1024)
                        for payload in (b"one", b"", big):
                            await channel.send(payload)
                        for payload in (b"one", b"", big):
                            assert await channel.receive() == b"echo:" + payload
                        with pytest.raises(ChannelTimeout):
                            await channel.receive(idle_timeout_s=0.05)
                        await channel.send(b"after a timeout")  # nothing lost or torn
                        assert await channel.receive(idle_timeout_s=5) == b"echo:after a timeout"
                        with pytest.raises(ValueError):
                            await channel.send(b"x" * (channel.max_frame_bytes + 1))
                    await wait_until_async(lambda: served[-1:] == ["closed"], 10, "the handler saw the close")
                    assert served == [b.peer_id, "closed"]

                    # The handler raises: the channel is reset (py-libp2p reads a reset as an end).
                    channel = await b.open_channel(a.peer_id, "/test/echo/1")
                    await channel.send(b"fail")
                    with pytest.raises(ChannelError) as failed:
                        await channel.receive(idle_timeout_s=5)
                    assert not isinstance(failed.value, ChannelTimeout)
                    await channel.reset()

                    # A frame over the handler's cap: dropped and reset, the handler never sees it.
                    channel = await b.open_channel(a.peer_id, "/test/small/1")
                    await channel.send(b"x" * 11)
                    with pytest.raises(ChannelError):
                        await channel.receive(idle_timeout_s=5)
                    await channel.reset()

                    with pytest.raises(ChannelError):
                        await b.open_channel(a.peer_id, "/test/nobody/1")

                    # The peer goes away mid-channel: the next receive fails, without waiting for
                    # its idle timeout. (A host closed in this process is only noticed by the ping
                    # monitor, within its interval + ping timeout; a killed process at once: see
                    # tests/test_routing.py.)
                    channel = await b.open_channel(a.peer_id, "/test/echo/1")
                    await channel.send(b"hi")
                    assert await channel.receive() == b"echo:hi"
                    async with running(config(tmp_path, "c", bootstrap_peers=(b.addrs()[0],))) as c:
                        c.set_channel_handler("/test/echo/1", echo_frames)
                        await wait_connected(b, c)
                        to_c = await b.open_channel(c.peer_id, "/test/echo/1")
                        await to_c.send(b"c?")
                        assert await to_c.receive() == b"echo:c?"
                    stopped = trio.current_time()
                    noticed_within = 3 * (NET.health_check_interval_s + NET.ping_timeout_s)
                    with pytest.raises(ChannelError) as lost:
                        await to_c.receive(idle_timeout_s=noticed_within)
                    assert not isinstance(lost.value, ChannelTimeout)
                    print(f"a stopped peer's channel failed after {trio.current_time() - stopped:.2f} s")
                    await to_c.reset()
                    await channel.aclose()

    run(scenario)
