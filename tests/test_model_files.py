"""Who holds a model's files and what follows: holdings as indices, whom to fetch from, placement's
preference, and an instance's state while its files move. Pure functions, table tests."""

from __future__ import annotations

from protocol.cluster_records import (
    Holding,
    InstanceRecord,
    NodeHoldings,
    NodeTransfers,
    StageAssignment,
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import FileEntry, TransferProgress, TransferState, manifest_of
from protocol.model_files import (
    file_holders,
    files_unobtainable,
    held_bytes,
    held_paths,
    holders_gone,
    holding_of,
    holding_views,
    instance_files_state,
    instance_view,
)

ME, A, B, C = (NodeId(f"12D3KooW{c}") for c in "mabc")
MANIFEST = manifest_of(
    [
        FileEntry(path="config.json", size=10, sha256="a" * 64),
        FileEntry(path="model-1.safetensors", size=1000, sha256="b" * 64),
        FileEntry(path="model-2.safetensors", size=2000, sha256="c" * 64),
    ]
)
OTHER = manifest_of([FileEntry(path="config.json", size=1, sha256="d" * 64)])
URLS = {n: f"http://10.0.0.{i}:52415" for i, n in enumerate((ME, A, B, C))}


def holdings(**per_node: Holding | None) -> dict[NodeId, NodeHoldings]:
    nodes = {"me": ME, "a": A, "b": B, "c": C}
    return {nodes[k]: NodeHoldings(() if h is None else (h,)) for k, h in per_node.items()}


def test_a_holding_names_all_files_or_the_indices_of_some() -> None:
    every = {f.path for f in MANIFEST.files}
    assert holding_of(MANIFEST, every) == Holding(MANIFEST.id)
    some = holding_of(MANIFEST, {"config.json", "model-2.safetensors", "not-in-it"})
    assert some == Holding(MANIFEST.id, (0, 2))
    assert holding_of(MANIFEST, set()) is None
    assert held_paths(MANIFEST, Holding(MANIFEST.id)) is None
    assert held_paths(MANIFEST, Holding(MANIFEST.id, (0, 2, 7))) == {"config.json", "model-2.safetensors"}
    both = sorted((Holding(MANIFEST.id, (0, 2)), Holding(OTHER.id)), key=lambda h: h.manifest_id)
    views = {v.manifest_id: v.files for v in holding_views(NodeHoldings(tuple(both)))}
    assert views == {MANIFEST.id: 2, OTHER.id: None}


def test_holders_are_the_live_peers_that_serve_some_of_the_files() -> None:
    held = holdings(
        me=Holding(MANIFEST.id),  # this node: never its own peer
        a=Holding(MANIFEST.id, (1,)),
        b=Holding(OTHER.id),  # another model
        c=Holding(MANIFEST.id, (9,)),  # indices past the manifest: nothing usable
    )
    found = file_holders(MANIFEST, held, URLS, live={ME, A, B, C}, me=ME)
    assert [(h.node, h.paths) for h in found] == [(A, frozenset({"model-1.safetensors"}))]
    assert found[0].url == URLS[A]
    assert file_holders(MANIFEST, held, URLS, live={ME, B, C}, me=ME) == []  # A is not alive
    assert file_holders(MANIFEST, held, {**URLS, A: ""}, live={ME, A}, me=ME) == []  # A has no API URL


def test_held_bytes_count_what_each_node_serves_of_the_model() -> None:
    held = holdings(a=Holding(MANIFEST.id), b=Holding(MANIFEST.id, (0, 2)), c=Holding(OTHER.id))
    assert held_bytes(MANIFEST, held) == {A: 3010, B: 2010}


def _moving(
    state: TransferState, error: str | None = None, manifest_id: str = MANIFEST.id
) -> TransferProgress:
    return TransferProgress(
        manifest_id=manifest_id,
        model="m",
        source="peers",
        state=state,
        bytes_done=1,
        bytes_total=2,
        rate_bps=0.0,
        files_done=0,
        files_total=1,
        peers=1,
        error=error,
    )


def test_an_instance_is_loading_while_its_files_move_and_failed_when_a_transfer_failed() -> None:
    stages = (StageAssignment(A, 0, 2), StageAssignment(B, 2, 4))
    record = InstanceRecord(InstanceId("i"), ModelId("m"), stages, manifest=MANIFEST)
    cases: list[tuple[dict[NodeId, NodeTransfers], tuple[str | None, str | None]]] = [
        ({}, (None, None)),
        ({A: NodeTransfers((_moving("done"),))}, (None, None)),
        ({A: NodeTransfers((_moving("done"),)), B: NodeTransfers((_moving("fetching"),))}, ("loading", None)),
        (
            {B: NodeTransfers((_moving("failed", "no peer holds it"),))},
            ("failed", f"node {B[-8:]}: no peer holds it"),
        ),
        ({B: NodeTransfers((_moving("failed"), _moving("fetching")))}, ("loading", None)),  # retried
        ({B: NodeTransfers((_moving("failed", manifest_id=OTHER.id),))}, (None, None)),  # another model
        ({C: NodeTransfers((_moving("fetching"),))}, (None, None)),  # not a stage node
    ]
    for transfers, expected in cases:
        assert instance_files_state(record, transfers) == expected, transfers
    view = instance_view(record, {B: NodeTransfers((_moving("fetching"),))})
    assert (view.manifest_id, view.state, [s.node_id for s in view.stages]) == (
        MANIFEST.id,
        "loading",
        [A, B],
    )
    plain = InstanceRecord(InstanceId("j"), ModelId("m"), stages)
    assert instance_view(plain, {B: NodeTransfers((_moving("failed"),))}).state is None


def test_holders_are_gone_only_when_some_were_heard_of_and_none_is_live() -> None:
    held = holdings(a=Holding(MANIFEST.id), b=Holding(MANIFEST.id, (1,)), c=Holding(OTHER.id))
    assert holders_gone(MANIFEST, held, live={C})  # A and B held it, both dead
    assert not holders_gone(MANIFEST, held, live={B, C})  # B holds some: ask it
    assert not holders_gone(MANIFEST, holdings(c=Holding(OTHER.id)), live={C})  # none heard of yet
    assert not holders_gone(MANIFEST, {}, live=set())


def test_files_are_unobtainable_when_a_stage_failed_and_no_live_node_holds_them_all() -> None:
    """Only then: a failed transfer while a live node (or the live nodes together) hold every file
    is one to retry, and a hub repo is a source of its own."""
    stages = (StageAssignment(A, 0, 2), StageAssignment(B, 2, 4))
    record = InstanceRecord(InstanceId("i"), ModelId("m"), stages, manifest=MANIFEST)
    failed = {B: NodeTransfers((_moving("failed", "no peer holds the files"),))}
    why = f"node {B[-8:]}: no peer holds the files"
    everyone = {ME, A, B, C}
    cases: list[tuple[dict[NodeId, NodeHoldings], dict[NodeId, NodeTransfers], set[NodeId], str | None]] = [
        (holdings(c=Holding(MANIFEST.id)), failed, everyone - {C}, why),  # the holder is dead
        ({}, failed, everyone, why),  # nobody ever held it
        (holdings(a=Holding(MANIFEST.id, (0, 1))), failed, everyone, why),  # a file is held by nobody
        (holdings(c=Holding(MANIFEST.id)), failed, everyone, None),  # C is alive: B retries from it
        (holdings(a=Holding(MANIFEST.id, (0, 1)), c=Holding(MANIFEST.id, (2,))), failed, everyone, None),
        ({}, {B: NodeTransfers((_moving("fetching"),))}, everyone, None),  # not failed (yet)
        ({}, {}, everyone, None),
    ]
    for held, transfers, live, expected in cases:
        assert files_unobtainable(record, held, transfers, live) == expected, (held, transfers, live)
    from_hub = InstanceRecord(InstanceId("i"), ModelId("m"), stages, manifest=MANIFEST, hub_repo="org/m")
    assert files_unobtainable(from_hub, {}, failed, everyone) is None
    resolved_by_each = InstanceRecord(InstanceId("i"), ModelId("m"), stages)
    assert files_unobtainable(resolved_by_each, {}, failed, everyone) is None
