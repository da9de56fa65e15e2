"""`shoal status`: what the table shows of model files moving between nodes."""

from __future__ import annotations

from rich.console import Console

from node.cli.status import render
from protocol.cluster_view import ClusterView, HoldingView, InstanceView, MemberView, StageView
from protocol.manifest import TransferProgress

NODE = "12D3KooWnodeBBBBBBBB"


def _member(transfers: tuple[TransferProgress, ...]) -> MemberView:
    return MemberView(
        id=NODE,
        host="b",
        role="follower",
        status="alive",
        backend="cpu",
        os="linux",
        memory_total=2**34,
        memory_available=2**33,
        last_seen_s=0.4,
        api_url="http://10.0.0.2:52415",
        version="0.1.0",
        multiaddrs=(),
        models=(HoldingView(manifest_id="ab" * 32, files=3),),
        transfers=transfers,
    )


def _text(view: ClusterView) -> str:
    console = Console(record=True, width=200)
    console.print(render(view))
    return console.export_text()


def test_transfers_and_loading_instances_are_shown_and_nothing_when_none_move() -> None:
    moving = TransferProgress(
        manifest_id="ab" * 32,
        model="tiny-llama",
        source="peers",
        state="fetching",
        bytes_done=50_000_000,
        bytes_total=100_000_000,
        rate_bps=25e6,
        files_done=1,
        files_total=3,
        peers=2,
    )
    failed = moving.model_copy(update={"state": "failed", "error": "no peer holds 'config.json'"})
    instance = InstanceView(
        id="tiny-llama-1", model="tiny-llama", stages=(StageView(node_id=NODE, start_layer=0, end_layer=4),)
    )
    view = ClusterView(
        cluster="home",
        self=NODE,
        leader=NODE,
        term=1,
        members=(_member((moving, failed)),),
        instances=(instance.model_copy(update={"state": "loading"}),),
    )
    text = _text(view)
    assert "model files" in text and "50% (50 / 100 MB)" in text and "25.0 MB/s" in text
    assert "peers (2)" in text and "1/3" in text and "failed: no peer holds 'config.json'" in text
    assert "0-4 (loading)" in text
    quiet = _text(view.model_copy(update={"members": (_member(()),), "instances": (instance,)}))
    assert "model files" not in quiet and "loading" not in quiet


def test_a_tensor_instance_shows_its_ranks() -> None:
    other = "12D3KooWnodeCCCCCCCC"
    stages = (
        StageView(node_id=NODE, start_layer=0, end_layer=4),
        StageView(node_id=other, start_layer=0, end_layer=4),
    )
    instance = InstanceView(id="tiny-llama-1", model="tiny-llama", stages=stages, sharding="tensor")
    view = ClusterView(
        cluster="home", self=NODE, leader=NODE, term=1, members=(_member(()),), instances=(instance,)
    )
    text = _text(view)
    assert "tensor: BBBBBBBB: rank 0, CCCCCCCC: rank 1" in text and "0-4" not in text


def test_each_member_shows_the_round_trip_the_answering_node_measured_to_it() -> None:
    far, near = "12D3KooWnodeCCCCCCCC", "12D3KooWnodeDDDDDDDD"
    me = _member(()).model_copy(update={"round_trips_us": {far: 1260, near: 21}})
    members = (
        me,
        me.model_copy(update={"id": far}),
        me.model_copy(update={"id": near, "round_trips_us": {}}),
    )
    view = ClusterView(cluster="home", self=NODE, leader=NODE, term=1, members=members, instances=())
    rows = {
        line.split("│")[1].strip(): line
        for line in _text(view).splitlines()
        if "12D3" not in line and "│" in line
    }
    assert rows["BBBBBBBB (this)"].rstrip(" │").endswith("-")
    assert rows["CCCCCCCC"].rstrip(" │").endswith("1.3 ms") and rows["DDDDDDDD"].rstrip(" │").endswith(
        "21 us"
    )
