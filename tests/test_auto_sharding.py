"""`"sharding": "auto"`: the rule (pure), the round trips a node measures, and the leader's choice."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import trio

from node.cluster.links import LinkProbe, connect_round_trip, rounded_us
from node.control.leader import AUTO_MEASURE_WAIT_S, LeaderControl
from protocol.auto_sharding import choose_sharding, exchanges, token_bytes, worst_round_trip
from protocol.cluster_records import NodeProfile, RoundTrip
from protocol.control_wire import Invalid, Placed
from protocol.ids import ModelId, NodeId
from protocol.model_shape import ModelShape
from tests.control_fakes import GIB, ME, OTHER, SHAPE, FakeCluster, ask, leader_of, run
from tests.waiting import wait_until_async

MB = 10**6
LLAMA_3B = ModelShape.uniform(
    ModelId("3b"),
    num_layers=28,
    bytes_per_layer=62 * MB,
    embedding_bytes=90 * MB,
    head_bytes=0,
    tied_embeddings=True,
)
"""About a Llama-3.2-3B Q4_0 as `bench/tensor_parallel.py` makes it: 1.8 GB a token, tied head."""
SMOL = ModelShape.uniform(
    ModelId("smol"),
    num_layers=30,
    bytes_per_layer=3 * MB,
    embedding_bytes=15 * MB,
    head_bytes=0,
    tied_embeddings=True,
)


def test_tensor_pays_for_a_large_model_on_a_lan_not_for_a_small_one_or_a_slow_link() -> None:
    assert token_bytes(LLAMA_3B) == 28 * 62 * MB + 90 * MB and exchanges(LLAMA_3B) == 59
    lan = choose_sharding(LLAMA_3B, 2, 21)
    assert lan.sharding == "tensor" and "59 exchanges at a 21 us round trip" in lan.reason
    assert choose_sharding(LLAMA_3B, 2, 200).sharding == "tensor"  # a real LAN's round trip
    assert choose_sharding(LLAMA_3B, 2, 2000).sharding == "pipeline"  # Wi-Fi
    assert choose_sharding(SMOL, 2, 21).sharding == "pipeline"
    assert choose_sharding(SMOL, 8, 1).sharding == "pipeline"
    unmeasured = choose_sharding(LLAMA_3B, 2, None)
    assert unmeasured.sharding == "pipeline" and "no round trip" in unmeasured.reason


def test_a_mixture_of_experts_counts_the_experts_a_token_reads() -> None:
    """Stored like the 3B model, but a token reads a tenth of it: tensor does not pay on a LAN."""
    moe = dataclasses.replace(LLAMA_3B, token_bytes=token_bytes(LLAMA_3B) // 10)
    assert choose_sharding(LLAMA_3B, 2, 200).sharding == "tensor"
    assert choose_sharding(moe, 2, 200).sharding == "pipeline"


def test_the_worst_pair_counts_and_an_unmeasured_pair_means_unknown() -> None:
    a, b, c = NodeId("a"), NodeId("b"), NodeId("c")
    links = {a: {b: 40, c: 900}, b: {a: 30}, c: {b: 50}}
    assert worst_round_trip(links, [a, b]) == 30  # the lower of the two ends' figures
    assert worst_round_trip(links, [a, b, c]) == 900
    assert worst_round_trip({a: {b: 40}}, [a, b, c]) is None
    assert worst_round_trip({}, [a]) == 0


def test_round_trips_are_rounded_to_two_figures() -> None:
    assert [rounded_us(s) for s in (0.0, 21.4e-6, 234e-6, 1.26e-3, 0.5)] == [1, 21, 230, 1300, 500000]


def test_a_connect_is_timed_and_a_closed_port_is_none() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        seconds = connect_round_trip("127.0.0.1", port)
        assert seconds is not None and 0 < seconds < 1
    assert connect_round_trip("127.0.0.1", port) is None  # nobody listens there now


def test_the_probe_measures_live_peers_and_forgets_those_gone() -> None:
    async def main() -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            peers = {NodeId("peer"): f"http://127.0.0.1:{server.getsockname()[1]}"}
            probe = LinkProbe(lambda: peers)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe.run)
                links = await wait_until_async(probe.links, 10, "the peer measured", interval=0.05)
                assert [t.node for t in links] == ["peer"] and 0 < links[0].us < 1_000_000
                peers.clear()
                assert probe.links() == ()
                nursery.cancel_scope.cancel()

    trio.run(main)


def _with_links(cluster: FakeCluster, trips: dict[NodeId, tuple[RoundTrip, ...]]) -> None:
    for node, links in trips.items():
        profile = NodeProfile(node, "linux", "cpu", 8 * GIB, 8 * GIB, "http://h:1", "0", 0.0, links=links)
        cluster.state = cluster.state.with_profile(node, profile)


SPLITTABLE = dataclasses.replace(SHAPE, tensor_ranks=4)
"""1 GiB over 4 layers: 54 ms a token on one node; 2 ranks save 27 ms against 11 exchanges."""


def test_the_leader_picks_by_the_measured_round_trip_and_says_why() -> None:
    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, OTHER: 8 * GIB})
        unmeasured = await leader.place(ask(shape=SPLITTABLE, sharding="auto", preview=True))
        assert isinstance(unmeasured, Placed) and unmeasured.instance.sharding == "pipeline"
        assert "no round trip" in unmeasured.sharding_reason
        _with_links(cluster, {ME: (RoundTrip(OTHER, 60),), OTHER: ()})
        fast = await leader.place(ask(shape=SPLITTABLE, sharding="auto"))
        assert isinstance(fast, Placed) and fast.instance.sharding == "tensor"
        assert fast.sharding_reason.startswith("tensor: 2 ranks") and "60 us" in fast.sharding_reason
        assert [r.sharding for r in cluster.state.instances().values()] == ["tensor"]
        _with_links(cluster, {ME: (RoundTrip(OTHER, 5000),)})
        slow = await leader.place(ask("other", shape=SPLITTABLE, sharding="auto", preview=True))
        assert isinstance(slow, Placed) and slow.instance.sharding == "pipeline"
        whole = await leader.place(ask("other", sharding="auto", preview=True))  # no tensor ranks
        assert isinstance(whole, Placed) and whole.instance.sharding == "pipeline"
        assert "no tensor-parallel placement" in whole.sharding_reason
        asked = await leader.place(ask("other", preview=True))
        assert isinstance(asked, Placed) and asked.sharding_reason == ""

    run(main)


def test_a_placement_waits_a_little_for_a_round_trip_not_measured_yet() -> None:
    """`shoal run --sharding auto` on nodes started together: the peer is measured a second later."""

    async def main() -> None:
        cluster, leader = leader_of({ME: 8 * GIB, OTHER: 8 * GIB})

        async def measured_later() -> None:
            await trio.sleep(1)
            _with_links(cluster, {ME: (RoundTrip(OTHER, 60),)})
            cluster.changed()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(measured_later)
            placed = await leader.place(ask(shape=SPLITTABLE, sharding="auto"))
        assert isinstance(placed, Placed) and placed.instance.sharding == "tensor"
        assert trio.current_time() == pytest.approx(1)
        _with_links(cluster, {ME: ()})  # the figure gone (say, the peer restarted): none comes
        started = trio.current_time()
        never = await leader.place(ask("other", shape=SPLITTABLE, sharding="auto", nodes=2))
        assert isinstance(never, Placed) and never.instance.sharding == "pipeline"
        assert trio.current_time() - started == pytest.approx(AUTO_MEASURE_WAIT_S)

    run(main)


def test_a_leader_that_cannot_seal_refuses_tensor_in_a_cluster_with_a_secret() -> None:
    async def main() -> None:
        cluster = FakeCluster({ME: 8 * GIB, OTHER: 8 * GIB})
        leader = LeaderControl(cluster, unsealed_tensor=True)
        _with_links(cluster, {ME: (RoundTrip(OTHER, 20),)})
        refused = await leader.place(ask(shape=SPLITTABLE, sharding="tensor"))
        assert isinstance(refused, Invalid) and refused.kind == "unsupported" and "secret" in refused.reason
        auto = await leader.place(ask(shape=SPLITTABLE, sharding="auto"))
        assert isinstance(auto, Placed) and auto.instance.sharding == "pipeline"
        assert "seal" in auto.sharding_reason

    run(main)
