"""A node's own copy of a model, in one process: a `.gguf` it has is imported into the cluster's
very manifest (the import is deterministic, wherever the file lies), another file never is, and with
the only holder dead and no copy here the stage fails at once, not after waiting for holders.
The cluster is `tests.test_cluster_files`' fake; the nodes' real parts (imports, hashing, the board)
run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

from node.files import FetchError, HashCache, folder_manifest
from node.files.cluster import HOLDERS_WAIT_S, files_unavailable
from node.models import builtin_gguf_path, ensure_gguf_model
from node.models.gguf import MARKER_FILE
from protocol.cluster_records import Holding, InstanceRecord, NodeHoldings, StageAssignment
from protocol.ids import InstanceId, ModelId
from protocol.manifest import Manifest
from protocol.membership import View
from tests.file_peers import run
from tests.model_factory import make_random_model, write_llama_gguf
from tests.test_cluster_files import ME, PEER, FakeCluster, files_of


@pytest.fixture(scope="module")
def gguf(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF (random weights, SmolLM2's tokenizer), as llama.cpp would write it."""
    root = tmp_path_factory.mktemp("gguf")
    model = make_random_model(root / "weights", tokenizer_from=builtin_model_dir)
    return write_llama_gguf(model, root / "tiny.gguf", tokenizer_gguf=builtin_gguf_path())


def _imported(gguf: Path, data_dir: Path) -> Manifest:
    """The manifest a node that imports `gguf` into `data_dir` describes (as `describe` does)."""
    folder = ensure_gguf_model(gguf, data_dir / "models" / gguf.stem)
    return folder_manifest(folder, HashCache(None), derived_from=gguf)


def _record(manifest: Manifest, source: str) -> tuple[InstanceRecord, StageAssignment]:
    stage = StageAssignment(ME, 0, 2)
    return InstanceRecord(InstanceId("i"), ModelId("tiny"), (stage,), source, manifest), stage


class Quiet(FakeCluster):
    """A cluster whose state never changes: a node waiting for holders waits all of `HOLDERS_WAIT_S`."""

    async def wait_changed(self) -> None:
        await trio.sleep_forever()


def _holder_died(cluster: FakeCluster, manifest: Manifest) -> None:
    """PEER held the model, and is dead now: its holdings stay in the state."""
    cluster.state = cluster.state.with_holdings(PEER, NodeHoldings((Holding(manifest.id),)))
    cluster.view = View({})


def test_a_gguf_this_node_has_is_imported_as_the_clusters_copy(gguf: Path, tmp_path: Path) -> None:
    """The holder imported the file at one path; this node has the same bytes at another (another
    mtime too): its own import has the holder's manifest, so it runs from it and serves it."""
    manifest = _imported(gguf, tmp_path / "holder")
    here = tmp_path / "mine" / gguf.name
    here.parent.mkdir()
    shutil.copyfile(gguf, here)
    cluster = FakeCluster()
    _holder_died(cluster, manifest)
    files = files_of(cluster, tmp_path / "me")
    record, stage = _record(manifest, str(here))

    async def main() -> None:
        folder = await files.folder_for(record, stage)
        assert folder == tmp_path / "me" / "models" / "tiny"
        assert (folder / MARKER_FILE).read_text() != (
            tmp_path / "holder/models/tiny" / MARKER_FILE
        ).read_text()
        assert folder_manifest(folder, HashCache(None), derived_from=here) == manifest
        [holding] = files.records()[0].models
        assert (holding.manifest_id, holding.files) == (manifest.id, None)  # every file
        assert files_unavailable(cluster, "tiny") is None

    run(main, limit_s=60)


def test_with_no_copy_anywhere_the_stage_fails_at_once_and_says_why(
    gguf: Path, builtin_model_dir: Path, tmp_path: Path
) -> None:
    """This node's file at the source path is another model's: it is hashed, never imported. The
    only holder is dead, so the stage does not wait for holders: the board and the cluster state
    say why at once, and a request for the model would end with that reason."""
    manifest = _imported(gguf, tmp_path / "holder")
    other = make_random_model(tmp_path / "other", tokenizer_from=builtin_model_dir, seed=1)
    impostor = write_llama_gguf(other, tmp_path / "mine" / gguf.name, tokenizer_gguf=builtin_gguf_path())
    cluster = Quiet()
    _holder_died(cluster, manifest)
    files = files_of(cluster, tmp_path / "me")
    record, stage = _record(manifest, str(impostor))
    cluster.state = cluster.state.with_leader_claim(ME, 1).with_instance(ME, 1, record)

    async def main() -> None:
        started = trio.current_time()
        with pytest.raises(FetchError, match=rf"no peer holds the files of 'tiny' \(.*{PEER[-8:]}.* gone\)"):
            await files.folder_for(record, stage)
        assert trio.current_time() - started < HOLDERS_WAIT_S / 2
        assert not (tmp_path / "me" / "models" / "tiny").exists()  # nothing imported
        assert files.records()[1].transfers[-1].state == "failed" and cluster.published
        holdings, transfers = files.records()
        cluster.state = cluster.state.with_holdings(ME, holdings).with_transfers(ME, transfers)
        assert "no peer holds the files of 'tiny'" in (files_unavailable(cluster, "tiny") or "")

    run(main, limit_s=60)
