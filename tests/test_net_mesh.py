"""Real meshes on 127.0.0.1 in one trio process: admission, gossip, requests, restarts, bad frames.

No mDNS here (tests/test_net_mdns.py does that in network namespaces); channels are
tests/test_net_channels.py, the framer tests/test_framing.py. Every wait is on an event, inside
`trio.fail_after`, or a bounded poll of a counter (`tests.waiting.wait_until_async`).
"""

from __future__ import annotations

import argparse
import math
import random
import socket
import struct
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.net import Gossip, RemoteError, RequestError, add_mesh_arguments, quirks
from node.net import mesh as mesh_module
from node.net.auth import derive_key
from node.net.channel import Channel, ChannelError
from node.net.config import mesh_config_from_args
from node.net.identity import load_or_create_identity, peer_id_of
from node.net.peers import Opened, PeerBook
from protocol.framing import encode
from tests.meshes import config, echo, gossip_until_received, run, running, wait_connected
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(90)


# --- the pure parts -----------------------------------------------------------------------------
def test_peer_book_transitions() -> None:
    book = PeerBook()
    assert book.connection_opened("p", now=0) is Opened.AUTHENTICATE
    assert book.connection_opened("p", now=0) is Opened.NOTHING  # second connection: one handshake
    epoch = book.epoch("p")
    assert book.auth_succeeded("p", epoch) is True
    assert book.auth_succeeded("p", epoch) is False  # the other direction's handshake: no 2nd "up"
    assert book.authenticated_peers() == {"p"}
    assert book.connection_closed("p") is False  # one connection left
    assert book.connection_closed("p") is True  # now down
    assert not book.is_authenticated("p")
    # A handshake outcome from a previous stretch of connectedness is ignored.
    assert book.connection_opened("p", now=1) is Opened.AUTHENTICATE
    assert book.auth_succeeded("p", epoch) is False
    assert book.auth_failed("p", epoch, now=1, refuse_s=30, proven=False) is False
    assert book.auth_failed("p", book.epoch("p"), now=1, refuse_s=30, proven=True) is True
    assert book.is_refused("p", now=30) and not book.is_refused("p", now=31.5)
    assert book.connection_opened("p", now=2) is Opened.REFUSE
    book.connection_closed("p")
    book.connection_closed("p")
    book.forget_expired(now=100)
    assert book.refused_until("p") == -math.inf


def test_cluster_key_depends_on_name_and_secret() -> None:
    keys = {derive_key("shoal", None), derive_key("shoal", b"s"), derive_key("other", None)}
    assert len(keys) == 3
    assert derive_key("shoal", b"s") == derive_key("shoal", b"s")


def test_cli_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_mesh_arguments(parser)
    monkeypatch.setenv("SHOAL_CLUSTER_SECRET", "from-env")
    peer = "/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWFaztMzrWjQb4MixfdGGL8Z7EnrZLK8CpMSpirFDXrQmG"
    cfg = mesh_config_from_args(
        parser.parse_args(["--cluster", "lab", "--peer", peer, "--no-mdns"]), tmp_path
    )
    assert (cfg.cluster, cfg.secret, cfg.bootstrap_peers, cfg.mdns) == ("lab", b"from-env", (peer,), False)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    args = parser.parse_args(["--cluster-secret-file", str(secret_file)])
    assert mesh_config_from_args(args, tmp_path).secret == b"from-file"
    assert mesh_config_from_args(parser.parse_args(["--cluster-secret", "x"]), tmp_path).secret == b"x"
    with pytest.raises(ValueError, match="peer address"):
        mesh_config_from_args(parser.parse_args(["--peer", "/ip4/10.0.0.2/tcp/4001"]), tmp_path)


# --- three meshes -------------------------------------------------------------------------------
def test_three_meshes_gossip_and_requests(tmp_path: Path) -> None:
    """a <- b <- c (a line): gossip from a reaches c through b; requests go to direct peers."""

    async def scenario() -> None:
        async with (
            running(config(tmp_path, "a")) as a,
            running(config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],))) as b,
            running(config(tmp_path, "c", bootstrap_peers=(b.addrs()[0],))) as c,
        ):
            with trio.fail_after(10):
                await wait_connected(b, a, c)
                await wait_connected(a, b)
                await wait_connected(c, b)
            assert a.connected_peers() == {b.peer_id} and c.connected_peers() == {b.peer_id}
            for addr in a.addrs():
                assert addr.startswith("/ip4/127.0.0.1/tcp/") and addr.endswith(a.peer_id)

            with trio.fail_after(20):
                await gossip_until_received(a, [b, c], b"from-a")  # c hears a via b
                await gossip_until_received(c, [a, b], b"from-c")

            for mesh in (a, b, c):
                mesh.set_request_handler(echo)
            assert await b.request(a.peer_id, b"ping") == b"echo:ping"
            assert await b.request(c.peer_id, b"") == b"echo:"
            big = random.randbytes(3 * 1024 * 1024)
            assert await c.request(b.peer_id, big) == b"echo:" + big
            with pytest.raises(RequestError, match="not connected"):
                await a.request(c.peer_id, b"no direct connection")

            async def failing(peer_id: str, payload: bytes) -> bytes:
                raise RuntimeError("boom")

            a.set_request_handler(failing)
            with pytest.raises(RemoteError, match="RuntimeError"):
                await b.request(a.peer_id, b"x")
            with pytest.raises(ValueError):
                await a.publish(b"x" * (a.config.max_gossip_bytes + 1))
            assert a.stats.gossip_rejected == 0 and b.stats.refused_streams == 0

    run(scenario)


def test_wrong_secret_is_refused(tmp_path: Path) -> None:
    """x has the wrong secret: it is refused both ways and nothing crosses in either direction."""

    async def scenario() -> None:
        right = {"secret": b"correct horse"}
        async with (
            running(config(tmp_path, "a", **right)) as a,
            running(config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],), **right)) as b,
            running(
                config(tmp_path, "x", bootstrap_peers=(a.addrs()[0], b.addrs()[0]), secret=b"wrong")
            ) as x,
        ):
            a.add_peer(x.addrs()[0])  # and a dials x too
            x_calls: list[bytes] = []

            async def x_handler(peer_id: str, payload: bytes) -> bytes:
                x_calls.append(payload)
                return b"leak"

            x.set_request_handler(x_handler)
            a.set_request_handler(echo)
            with trio.fail_after(10):
                await wait_connected(a, b)
            await wait_until_async(
                lambda: a.stats.auth_failed >= 1 and b.stats.auth_failed >= 1, 10, "x refused by a and b"
            )
            await wait_until_async(lambda: x.stats.auth_failed >= 2, 10, "a and b refused by x")
            for _ in range(5):
                await x.publish(b"from-x")
            seen: list[Gossip] = []
            with trio.fail_after(20):
                await gossip_until_received(a, [b], b"from-a", seen)
                await gossip_until_received(b, [a], b"from-b", seen)
            with pytest.raises(RequestError):
                await x.request(a.peer_id, b"let me in")
            with pytest.raises(RequestError):
                await a.request(x.peer_id, b"hello?")

            async def channel_handler(peer_id: str, channel: Channel) -> None:
                x_calls.append(await channel.receive())

            a.set_channel_handler("/test/chan/1", channel_handler)
            with pytest.raises(ChannelError, match="not connected"):
                await x.open_channel(a.peer_id, "/test/chan/1")
            with trio.fail_after(10), pytest.raises((*quirks.TRANSPORT_ERRORS, quirks.DialError)):
                await quirks.dial(x.host, ID.from_base58(a.peer_id), [a.host.get_addrs()[0]], 3)
                stream = await x.host.new_stream(ID.from_base58(a.peer_id), ["/test/chan/1"])  # type: ignore[list-item]
                await stream.write(encode(b"sneaky", a.config.max_request_bytes))
                await stream.read(1)
                await stream.read(1)

            # A raw sync stream from x: dropped before reaching a's handler.
            with trio.fail_after(10), pytest.raises((*quirks.TRANSPORT_ERRORS, quirks.DialError)):
                await quirks.dial(x.host, ID.from_base58(a.peer_id), [a.host.get_addrs()[0]], 3)
                stream = await x.host.new_stream(ID.from_base58(a.peer_id), [mesh_module.SYNC_PROTOCOL])
                await stream.write(encode(b"sneaky", a.config.max_request_bytes))
                await stream.read(1)
                await stream.read(1)

            assert x.connected_peers() == frozenset()
            assert x.peer_id not in a.connected_peers() | b.connected_peers()
            assert x.stats.gossip_delivered == 0 and x_calls == []
            for mesh in (a, b):
                while True:
                    try:
                        seen.append(mesh.gossip.receive_nowait())
                    except trio.WouldBlock:
                        break
            assert all(g.peer_id != x.peer_id for g in seen)
            assert a.stats.requests_served == 0  # x's requests never reached the handler

    run(scenario)


@pytest.mark.parametrize("same_port", [True, False], ids=["same-port", "new-port"])
def test_restarted_peer_is_reconnected_promptly(tmp_path: Path, same_port: bool) -> None:
    """b stops, a's redials fail (and land b in py-libp2p's 60 s negative cache), b comes back."""

    async def scenario() -> None:
        async with running(config(tmp_path, "a")) as a:
            a.set_request_handler(echo)
            async with running(config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],))) as b:
                b_id, b_port = b.peer_id, int(b.addrs()[0].split("/")[4])
                with trio.fail_after(10):
                    await wait_connected(a, b)
                a.add_peer(b.addrs()[0])  # a keeps dialing b's (old) address
            await wait_until_async(lambda: b_id not in a.connected_peers(), 10, "b gone from a's peers")
            failures = a.stats.dial_failures
            await wait_until_async(lambda: a.stats.dial_failures > failures, 10, "a redial of b failing")
            # Same port: only a can reconnect (b has no bootstrap peer). New port: b dials a.
            restart = (
                config(tmp_path, "b", p2p_port=b_port)
                if same_port
                else config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],))
            )
            async with running(restart) as b2:
                assert b2.peer_id == b_id
                started = trio.current_time()
                with trio.fail_after(5):
                    await wait_connected(a, b2)
                    await wait_connected(b2, a)
                print(f"reconnected in {trio.current_time() - started:.2f} s")
                assert await b2.request(a.peer_id, b"back") == b"echo:back"

    run(scenario)


def test_quirk_negative_cache_is_bypassed(tmp_path: Path) -> None:
    """Pins the py-libp2p behavior quirks.dial works around: after a failed dial, 60 s of refusal."""

    async def scenario() -> None:
        async with running(config(tmp_path, "a")) as a:
            placeholder = socket.socket()  # holds a port nobody listens on (connection refused)
            placeholder.bind(("127.0.0.1", 0))
            port = placeholder.getsockname()[1]
            b_id = ID.from_base58(peer_id_of(load_or_create_identity(tmp_path / "b")))
            addr = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
            with pytest.raises(quirks.DialError):
                await quirks.dial(a.host, b_id, [addr], 3)
            placeholder.close()
            async with running(config(tmp_path, "b", p2p_port=port)) as b:
                with pytest.raises(SwarmException, match="negative cache"):
                    await a.host.connect(PeerInfo(b_id, [addr]))  # py-libp2p alone: refused
                with trio.fail_after(5):
                    await quirks.dial(a.host, b_id, [addr], 3)  # with the workaround: connected
                    await wait_connected(a, b)

    run(scenario)


def test_bad_frames_are_dropped_and_counted(tmp_path: Path) -> None:
    async def scenario() -> None:
        limits = {"max_request_bytes": 1024, "request_timeout_s": 1.0}
        async with running(config(tmp_path, "a", **limits)) as a:
            calls: list[bytes] = []

            async def handler(peer_id: str, payload: bytes) -> bytes:
                calls.append(payload)
                return payload

            a.set_request_handler(handler)
            async with running(config(tmp_path, "b", bootstrap_peers=(a.addrs()[0],), **limits)) as b:
                with trio.fail_after(10):
                    await wait_connected(a, b)
                rng = random.Random(1234)
                header = struct.Struct(">I")
                bad: list[tuple[bytes, bool]] = [
                    (header.pack(2**31), False),  # oversized length
                    (header.pack(1025) + b"x" * 1025, False),  # one byte over the cap
                    (header.pack(100) + b"x" * 10, True),  # truncated, then EOF
                    (header.pack(100), False),  # stalls: no payload, no EOF
                    (b"\x00\x01", True),  # not even a header
                ]
                for _ in range(20):  # random bytes claiming more than they carry
                    length = rng.randrange(2**32)
                    body = rng.randbytes(rng.randrange(min(length, 300)) if length else 0)
                    if length > len(body):
                        bad.append((header.pack(length) + body, True))
                peer = ID.from_base58(a.peer_id)
                for data, close_write in bad:
                    stream = await b.host.new_stream(peer, [mesh_module.SYNC_PROTOCOL])
                    await stream.write(data)
                    if close_write:
                        await stream.close()
                    with trio.fail_after(5), pytest.raises(quirks.TRANSPORT_ERRORS):
                        while await stream.read(1024):  # a resets the stream: that's the event
                            pass
                        raise EOFError  # a clean close counts as a drop too
                assert a.stats.bad_frames == len(bad)
                assert calls == []
                assert await b.request(a.peer_id, b"still fine") == b"still fine"
                with pytest.raises(ValueError):
                    await b.request(a.peer_id, b"x" * 1025)

    run(scenario)
