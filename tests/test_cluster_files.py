"""A node's model files in one process: what it advertises, where a stage's folder comes from, and
what survives a restart. The peer is a real files route (`tests.file_peers`) named in a fake
cluster state as a live member that holds the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from node.files import Fetcher, FetchError, FileServer, HashCache, cluster_model_dir, folder_manifest
from node.files.cluster import MANIFEST_SIDECAR, ClusterFiles
from protocol.cluster import ClusterState
from protocol.cluster_records import (
    Holding,
    InstanceRecord,
    NodeHoldings,
    NodeProfile,
    StageAssignment,
)
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.manifest import Manifest
from protocol.membership import MemberState, Status, View
from tests.file_peers import KEY, file_peer, run, sharded_model, write_files

ME, PEER = NodeId("12D3KooWme"), NodeId("12D3KooWpeer")


class FakeCluster:
    def __init__(self) -> None:
        self.me = ME
        self.state = ClusterState.empty()
        self.view = View({PEER: MemberState(PEER, Status.ALIVE, 0, 1, 0.0)})
        self.published = 0

    async def wait_changed(self) -> None:
        await trio.sleep(0.05)

    async def publish_own(self) -> None:
        self.published += 1

    def peer_holds(self, manifest: Manifest, url: str) -> None:
        profile = NodeProfile("peer", "linux", "cpu", 1, 1, url, "0.1.0", 1.0)
        self.state = self.state.with_profile(PEER, profile).with_holdings(
            PEER, NodeHoldings((Holding(manifest.id),))
        )


def files_of(cluster: FakeCluster, data_dir: Path) -> ClusterFiles:
    cache = HashCache(None)
    return ClusterFiles(cluster, FileServer(KEY), Fetcher(KEY, ME, cache), cache, data_dir)


def record(manifest: Manifest, *stages: StageAssignment) -> InstanceRecord:
    return InstanceRecord(InstanceId("i"), ModelId("tiny"), stages, "/elsewhere/tiny", manifest)


def test_a_stage_fetches_its_shards_advertises_them_and_offers_them_again_after_a_restart(
    tmp_path: Path,
) -> None:
    source = tmp_path / "peer" / "tiny"
    write_files(source, sharded_model(3, 50_000))
    data_dir = tmp_path / "me"

    async def main() -> None:
        async with file_peer(source) as (url, served, manifest):
            cluster = FakeCluster()
            cluster.peer_holds(manifest, url)
            files = files_of(cluster, data_dir)
            stages = (StageAssignment(PEER, 0, 1), StageAssignment(ME, 1, 3))
            folder = await files.folder_for(record(manifest, *stages), stages[1])
            assert folder == cluster_model_dir(data_dir, manifest.id)
            shards = sorted(p.name for p in folder.glob("*.safetensors"))
            assert shards == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
            assert served.body_bytes == sum(f.stat().st_size for f in folder.iterdir() if f.name[0] != ".")
            (holdings, transfers) = files.records()
            indices = tuple(i for i, f in enumerate(manifest.files) if (folder / f.path).is_file())
            assert holdings == NodeHoldings((Holding(manifest.id, indices, "tiny"),))
            assert transfers.transfers[-1].state == "done" and cluster.published == 1

            # Restarted: the sidecar says what the folder is, nothing is hashed or fetched again.
            again = files_of(cluster, data_dir)
            await again.offer_stored()
            assert again.records()[0] == holdings and (folder / MANIFEST_SIDECAR).is_file()
            assert await again.folder_for(record(manifest, *stages), stages[1]) == folder
            assert served.body_bytes == sum(f.stat().st_size for f in folder.iterdir() if f.name[0] != ".")

    run(main)


def test_a_folder_the_source_names_here_with_the_same_content_is_used_as_it_is(tmp_path: Path) -> None:
    """E.g. a folder every node sees: no peer is asked; another content is never taken for it."""
    model = tmp_path / "shared" / "tiny"
    write_files(model, sharded_model(2, 10_000))
    manifest = folder_manifest(model, HashCache(None))
    cluster = FakeCluster()
    files = files_of(cluster, tmp_path / "me")
    stage = StageAssignment(ME, 0, 2)
    same = InstanceRecord(InstanceId("i"), ModelId("tiny"), (stage,), str(model), manifest)

    async def main() -> None:
        assert await files.folder_for(same, stage) == model
        assert files.records()[0] == NodeHoldings((Holding(manifest.id, model="tiny"),))
        (model / "config.json").write_text('{"num_hidden_layers": 2, "edited": true}')
        other = folder_manifest(model, HashCache(None))
        changed = InstanceRecord(InstanceId("j"), ModelId("tiny"), (stage,), str(model), other)
        fresh = files_of(cluster, tmp_path / "me2")
        assert await fresh.folder_for(changed, stage) == model
        # The record names the old content: the edited folder is not it, and no peer has it.
        with pytest.raises(FetchError, match="no peer holds"):
            await fresh.folder_for(same, stage)
        assert fresh.records()[1].transfers[-1].state == "failed"  # and the board says why

    run(main, limit_s=30)
