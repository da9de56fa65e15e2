"""The mesh's redial schedule (`node.net.redial.Redialer`), on trio's mock clock.

A peer without a connection is dialed at most once per backoff period, doubling from
`redial_min_s` to `redial_max_s`; never while admission refuses it; not at all while it is
connected (it may have dialed us); and from `redial_min_s` again once it was admitted. The dial
itself is a stand-in that fails or "connects" (the admission book says so); the jitter is pinned to
its middle. Real meshes reconnecting: tests/test_net_mesh.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from node.net import quirks, redial
from node.net.admission import Admission
from node.net.config import MeshConfig
from node.net.events import MeshStats
from node.net.identity import load_or_create_identity, peer_id_of
from node.net.peers import PeerBook

MIN, MAX = 0.5, 4.0


class FakeAdmission:
    """The admission state the redialer reads: the peer book, and an event for every change."""

    def __init__(self) -> None:
        self.book = PeerBook()
        self.changed = trio.Event()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def connect(self, peer: str) -> None:
        self.book.connection_opened(peer, trio.current_time())
        assert self.book.auth_succeeded(peer, self.book.epoch(peer))
        self.notify()

    def disconnect(self, peer: str) -> None:
        self.book.connection_closed(peer)
        self.notify()


class Peer:
    """One remote peer: who it is, and when the redialer dialed it."""

    def __init__(self, tmp_path: Path) -> None:
        self.id = peer_id_of(load_or_create_identity(tmp_path / "peer"))
        self.addr = f"/ip4/127.0.0.1/tcp/4001/p2p/{self.id}"
        self.dials: list[float] = []


Scenario = Callable[[FakeAdmission, redial.Redialer, Peer], Awaitable[None]]


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: str, scenario: Scenario) -> list[float]:
    """Run `scenario` beside a redialer keeping `peer` connected; the times it dialed.

    `answers` says how each dial ends, in turn: "f" fails, "c" connects; the rest fail.
    """
    peer = Peer(tmp_path)
    admission = FakeAdmission()
    outcomes = itertools.chain(answers, itertools.repeat("f"))

    async def dial(host: Any, peer_id: Any, addrs: Any, timeout_s: float) -> None:
        peer.dials.append(trio.current_time())
        if next(outcomes) == "f":
            raise quirks.DialError("connection refused")
        admission.connect(peer.id)

    monkeypatch.setattr(quirks, "dial", dial)
    monkeypatch.setattr(redial.random, "uniform", lambda low, high: (low + high) / 2)
    config = MeshConfig(data_dir=tmp_path, redial_min_s=MIN, redial_max_s=MAX)
    host: Any = None  # the stand-in dial above never looks at it
    redialer = redial.Redialer(
        host=host, admission=cast(Admission, admission), config=config, stats=MeshStats(), my_id="me"
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            redialer.attach(nursery)
            await scenario(admission, redialer, peer)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return peer.dials


def test_an_unreachable_peer_is_dialed_with_a_doubling_backoff_up_to_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(admission: FakeAdmission, redialer: redial.Redialer, peer: Peer) -> None:
        redialer.add(peer.addr)
        await trio.sleep(20)

    # Waits of 0.5, 1, 2, then 4, 4, ... s (the cap).
    assert run(tmp_path, monkeypatch, "", scenario) == [0.0, 0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5]


def test_a_refused_peer_is_not_dialed_until_its_refusal_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(admission: FakeAdmission, redialer: redial.Redialer, peer: Peer) -> None:
        book = admission.book
        book.connection_opened(peer.id, 0.0)
        assert book.auth_failed(peer.id, book.epoch(peer.id), now=0.0, refuse_s=6.0, proven=True)
        admission.disconnect(peer.id)
        redialer.add(peer.addr)
        await trio.sleep(8)

    assert run(tmp_path, monkeypatch, "", scenario) == [6.0, 6.5, 7.5]


def test_an_admitted_peer_starts_again_from_the_shortest_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(admission: FakeAdmission, redialer: redial.Redialer, peer: Peer) -> None:
        redialer.add(peer.addr)
        await trio.sleep(10)  # connected by the third dial, at 1.5 s
        admission.disconnect(peer.id)
        await trio.sleep(3)

    assert run(tmp_path, monkeypatch, "ffc", scenario) == [0.0, 0.5, 1.5, 10.0, 10.5, 11.5]


def test_a_peer_that_dials_us_is_not_dialed_while_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario(admission: FakeAdmission, redialer: redial.Redialer, peer: Peer) -> None:
        redialer.add(peer.addr)
        await trio.sleep(1.0)  # dials at 0 and 0.5 failed; the next is due at 1.5
        admission.connect(peer.id)  # it connected to us
        await trio.sleep(4.0)
        admission.disconnect(peer.id)
        await trio.sleep(1.0)

    assert run(tmp_path, monkeypatch, "", scenario) == [0.0, 0.5, 5.0, 5.5]
