"""`shoal models`' picture (`protocol.held_models.node_models`, pure) and what the dashboard may
place by name (`node.files.cluster.placeable`: no partial copies fetched from peers)."""

from __future__ import annotations

import json
from pathlib import Path

from node.files.cluster import MANIFEST_SIDECAR, placeable
from node.models.store import list_local_models
from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, NodeTransfers, StageAssignment
from protocol.cluster_view import MemberView
from protocol.held_models import node_models
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import FileEntry, Manifest, TransferProgress, manifest_of

A, B, C = NodeId("12D3KooWa"), NodeId("12D3KooWb"), NodeId("12D3KooWc")


def _manifest(*sizes: int) -> Manifest:
    files = [FileEntry(path="config.json", size=10, sha256="0" * 64)]
    files += [
        FileEntry(path=f"w{i}.safetensors", size=s, sha256=f"{i + 1:x}" * 64) for i, s in enumerate(sizes)
    ]
    return manifest_of(files)


def _member(node: NodeId) -> MemberView:
    return MemberView(
        id=node,
        host=f"host-{node[-1]}",
        role="follower",
        status="alive",
        backend="cpu",
        os="linux",
        memory_total=1,
        memory_available=1,
        last_seen_s=None,
        api_url="",
        version="",
        multiaddrs=(),
    )


def test_each_node_with_its_share_of_each_model_and_who_uses_it() -> None:
    placed, own, fetched = _manifest(100, 200), _manifest(7), _manifest(5, 5)
    record = InstanceRecord(
        InstanceId("m-1"),
        ModelId("m"),
        (StageAssignment(A, 0, 1), StageAssignment(B, 1, 2)),
        manifest=placed,
    )
    holdings = {
        A: NodeHoldings((Holding(placed.id),)),  # all of it
        B: NodeHoldings(
            tuple(sorted([Holding(placed.id, (0, 2)), Holding(own.id)], key=lambda h: h.manifest_id))
        ),
        C: NodeHoldings((Holding(fetched.id, (1,)),)),  # a manifest this node never saw
    }
    moved = TransferProgress(
        manifest_id=fetched.id,
        model="gone",
        source="peers",
        state="done",
        bytes_done=5,
        bytes_total=5,
        rate_bps=0.0,
        files_done=1,
        files_total=1,
        peers=0,
    )
    nodes = node_models(
        [_member(n) for n in (A, B, C)],
        holdings,
        [record],
        {own.id: ("mine", own)},
        {C: NodeTransfers((moved,))},
    )
    assert [n.node for n in nodes] == [A, B, C] and nodes[1].host == "host-b"
    [a] = nodes[0].models
    assert (a.model, a.files_held, a.files_total, a.bytes_held, a.bytes_total, a.in_use) == (
        "m",
        3,
        3,
        310,
        310,
        ("m-1",),
    )
    b = {m.manifest_id: m for m in nodes[1].models}
    assert (b[placed.id].files_held, b[placed.id].bytes_held, b[placed.id].in_use) == (2, 210, ("m-1",))
    assert (b[own.id].model, b[own.id].bytes_held, b[own.id].in_use) == ("mine", 17, ())
    [c] = nodes[2].models
    assert (c.model, c.files_held, c.files_total, c.bytes_held, c.bytes_total) == (
        "gone",
        1,
        None,
        None,
        None,
    )
    # A model nobody here knows the manifest of, held whole by C under a name: the name shows.
    other = _manifest(9)
    holdings[C] = NodeHoldings((Holding(other.id, None, "harbour-llama"),))
    [held] = node_models([_member(C)], holdings, [], {}, {})[0].models
    assert (held.model, held.files_held, held.bytes_total) == ("harbour-llama", None, None)


def test_a_partial_copy_from_peers_is_not_placeable_and_a_whole_one_goes_by_its_name(tmp_path: Path) -> None:
    models = tmp_path / "models"
    whole, part = _manifest(4), _manifest(4, 4)
    for manifest in (whole, part):
        folder = models / "cluster" / manifest.id
        folder.mkdir(parents=True)
        (folder / "config.json").write_bytes(b"x" * 10)
        (folder / "w0.safetensors").write_bytes(b"w" * 4)  # the partial one lacks w1
        body = {"model": "m", "manifest": manifest.model_dump(mode="json")}
        (folder / MANIFEST_SIDECAR).write_text(json.dumps(body))
    unsure = models / "cluster" / ("f" * 64)  # no sidecar: cannot tell, so not offered
    unsure.mkdir()
    (unsure / "config.json").write_text("{}")
    (models / "plain").mkdir()
    (models / "plain" / "config.json").write_text("{}")
    listed = {m.name: m.path for m in placeable(list_local_models(tmp_path), tmp_path)}
    assert listed == {"plain": models / "plain", "m": models / "cluster" / whole.id}  # by its name
    (models / "m").mkdir()  # an import of the same model here: each name listed once
    (models / "m" / "config.json").write_text("{}")
    assert sorted(m.name for m in placeable(list_local_models(tmp_path), tmp_path)) == ["m", "plain"]
