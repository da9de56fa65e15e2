"""`protocol.model_names`: the names the cluster shows, whom to ask for one, and clashing names."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.files import HashCache, folder_manifest
from protocol.cluster import ClusterState
from protocol.cluster_codec import Delta, decode_message, encode_delta
from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, StageAssignment
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import FileEntry, manifest_of
from protocol.model_names import distinct_name, holders_named, names_in_use
from tests.file_peers import file_peer, run, sharded_model, write_files
from tests.test_cluster_files import ME, PEER, FakeCluster, files_of

A, B, C = (NodeId(n) for n in ("node-a", "node-b", "node-c"))
ONE = manifest_of([FileEntry(path="config.json", size=2, sha256="1" * 64)])
TWO = manifest_of([FileEntry(path="config.json", size=3, sha256="2" * 64)])


def _record(model: str, manifest_id_of: object) -> InstanceRecord:
    manifest = ONE if manifest_id_of is ONE else TWO
    return InstanceRecord(InstanceId(f"{model}-1"), ModelId(model), (StageAssignment(A, 0, 1),), "", manifest)


HOLDINGS = {
    A: NodeHoldings((Holding(ONE.id, None, "harbour-llama"),)),
    B: NodeHoldings((Holding(ONE.id, (0,), "harbour-llama"),)),  # a stage's shards only
    C: NodeHoldings((Holding(TWO.id, None, ""),)),  # an older node: no name
}


def test_names_in_use_come_from_instance_records_and_holdings() -> None:
    used = names_in_use(HOLDINGS, [_record("other", TWO)])
    assert used == {"harbour-llama": {ONE.id}, "other": {TWO.id}}


@pytest.mark.parametrize(
    ("name", "manifest", "used", "expected"),
    [
        ("harbour-llama", ONE.id, {}, "harbour-llama"),  # nobody else: the plain name
        ("harbour-llama", ONE.id, {"harbour-llama": {ONE.id}}, "harbour-llama"),  # itself, again
        ("harbour-llama", TWO.id, {"harbour-llama": {ONE.id}}, f"harbour-llama-{TWO.id[:8]}"),
        ("harbour-llama", TWO.id, {"other": {ONE.id}}, "harbour-llama"),
    ],
)
def test_a_clashing_name_gets_its_manifest_prefix(
    name: str, manifest: str, used: dict[str, set[str]], expected: str
) -> None:
    assert distinct_name(name, manifest, used) == expected


def test_holders_named_are_live_peers_with_every_file() -> None:
    live = {A, B, C, ME}
    assert holders_named("harbour-llama", HOLDINGS, live, ME) == [A]  # B holds only shards
    assert holders_named("harbour-llama", HOLDINGS, live - {A}, ME) == []  # A is not alive
    assert holders_named("harbour-llama", HOLDINGS, live, A) == []  # never the asking node
    assert holders_named("", HOLDINGS, live, ME) == []  # no name is no name


def test_holding_names_cross_the_wire() -> None:
    state = ClusterState.empty().with_holdings(A, HOLDINGS[A])
    (data,) = encode_delta(state)
    message = decode_message(data)
    assert isinstance(message, Delta)
    assert message.state.holdings()[A].models[0].model == "harbour-llama"


def test_a_second_model_with_a_taken_folder_name_is_offered_under_a_distinct_name(tmp_path: Path) -> None:
    """A peer holds a model called `tiny`; this node's own, different `tiny` folder is served as
    `tiny-<manifest prefix>`, advertised so, found by either name, and keeps its name when asked again."""
    theirs, mine = tmp_path / "theirs" / "tiny", tmp_path / "mine" / "tiny"
    write_files(theirs, sharded_model(1, 1_000))
    write_files(mine, sharded_model(2, 1_000))
    cluster = FakeCluster()
    other = folder_manifest(theirs, HashCache(None))
    cluster.state = cluster.state.with_holdings(PEER, NodeHoldings((Holding(other.id, None, "tiny"),)))
    files = files_of(cluster, tmp_path / "data")

    async def main() -> None:
        described = await files.describe(str(mine))
        expected = f"tiny-{described.manifest.id[:8]}"
        assert described.name == expected and described.manifest != other
        assert files.records()[0].models == (Holding(described.manifest.id, None, expected),)
        assert files.named(expected) is not None and files.named("tiny") is None
        assert files.named(f"cluster/{described.manifest.id}") is not None
        assert (await files.describe(str(mine))).name == expected

    run(main)


def test_a_whole_copy_from_peers_is_described_by_its_own_manifest_and_name(tmp_path: Path) -> None:
    """`cluster/<manifest id>` (as `shoal models --local` lists it) or its name: the manifest the
    peers know (naming the .gguf it was imported from), not one hashed afresh from the files, and
    the model's name, not the folder's."""
    source, gguf = tmp_path / "peer" / "tiny", tmp_path / "peer" / "tiny.gguf"
    write_files(source, sharded_model(2, 5_000))
    gguf.write_bytes(b"GGUF, as imported")

    async def main() -> None:
        async with file_peer(source, derived_from=gguf) as (url, _served, manifest):
            assert manifest.derived_from is not None
            cluster = FakeCluster()
            cluster.peer_holds(manifest, url)
            files = files_of(cluster, tmp_path / "me")
            stage = StageAssignment(ME, 0, 2)
            record = InstanceRecord(InstanceId("i"), ModelId("tiny"), (stage,), "/elsewhere/tiny", manifest)
            folder = await files.folder_for(record, stage)
            described = await files.describe(f"cluster/{manifest.id}")
            assert (described.manifest, described.name) == (manifest, "tiny")
            assert files.named("tiny") == (manifest, folder, "tiny")

    run(main)
