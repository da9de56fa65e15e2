"""Real meshes on 127.0.0.1 for tests: a config without mDNS, a started mesh, waits on events.

Peers find each other through bootstrap addresses. Every wait is on an event (callers bound it with
`trio.fail_after`) or, for a counter without one, `tests.waiting.wait_until_async`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import trio

from node.net import Gossip, Mesh, MeshConfig


def config(tmp_path: Path, name: str, **overrides: object) -> MeshConfig:
    base = MeshConfig(
        data_dir=tmp_path / name,
        mdns=False,
        listen_host="127.0.0.1",
        redial_min_s=0.1,
        redial_max_s=0.5,
        auth_timeout_s=3.0,
        dial_timeout_s=3.0,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


@asynccontextmanager
async def running(cfg: MeshConfig) -> AsyncIterator[Mesh]:
    """A started Mesh, stopped (host closed) when the block ends."""
    mesh = Mesh(cfg)
    async with trio.open_nursery() as nursery:
        await nursery.start(mesh.run)
        yield mesh
        nursery.cancel_scope.cancel()


async def wait_connected(mesh: Mesh, *peers: Mesh) -> None:
    """Wait for `mesh` to have authenticated all `peers` (on its event channel)."""
    want = {p.peer_id for p in peers}
    while not want <= mesh.connected_peers():
        await mesh.events.receive()


async def gossip_until_received(
    sender: Mesh, receivers: list[Mesh], tag: bytes, others: list[Gossip] | None = None
) -> None:
    """Publish `tag`+seq every 100 ms (at most 100 times) until each receiver got one.

    Gossip is best effort by design (GossipSub drops while a mesh forms), hence the re-publish.
    Other messages received meanwhile are appended to `others`.
    """
    got: set[str] = set()
    everyone = trio.Event()

    async def receive(mesh: Mesh) -> None:
        while True:
            msg = await mesh.gossip.receive()
            if not msg.data.startswith(tag) and others is not None:
                others.append(msg)
            if msg.data.startswith(tag):
                assert msg.peer_id == sender.peer_id
                got.add(mesh.peer_id)
                if len(got) == len(receivers):
                    everyone.set()
                return

    async with trio.open_nursery() as nursery:
        for mesh in receivers:
            nursery.start_soon(receive, mesh)
        for seq in range(100):
            if everyone.is_set():
                break
            await sender.publish(tag + b"#%d" % seq)
            with trio.move_on_after(0.1):
                await everyone.wait()
        if not everyone.is_set():
            raise AssertionError(f"{tag!r} reached {len(got)} of {len(receivers)} receivers in 100 publishes")


async def echo(peer_id: str, payload: bytes) -> bytes:
    return b"echo:" + payload


def run(fn: Callable[[], Awaitable[None]], limit_s: float = 60) -> None:
    async def main() -> None:
        with trio.fail_after(limit_s):
            await fn()

    trio.run(main)
