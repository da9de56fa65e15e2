"""The hub as the fallback when no peer holds a model: huggingface_hub's real download against
`FakeHub` (tests/test_models_resolve.py: repo info, tree listing, `resolve/` with Range) on 127.0.0.1,
pointed at with `HF_ENDPOINT`; and `HF_HUB_OFFLINE=1` meaning peers only."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.files import Fetcher, FetchError, HashCache, HubRef, Peer, fetch_from_hub, folder_manifest
from node.models.hub import hub_model_dir
from protocol.manifest import INDEX_FILE, Manifest, stage_paths
from tests.file_peers import KEY, file_peer, run, sharded_model, write_files
from tests.test_models_resolve import FakeHub

REPO = "test-org/tiny-model"


@pytest.fixture
def repo_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "upstream"
    write_files(
        folder,
        {
            "config.json": b'{"model_type": "llama", "num_hidden_layers": 1}',
            "tokenizer.json": b'{"version": "1.0"}',
            "model.safetensors": os.urandom(200_000),
        },
    )
    return folder


@pytest.fixture
def hub(repo_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo(REPO, repo_folder)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield fake


def fetcher() -> Fetcher:
    return Fetcher(KEY, "12D3KooWhubuser", HashCache(None))


def test_a_model_no_peer_holds_comes_from_the_hub_checked(
    hub: FakeHub, repo_folder: Path, tmp_path: Path
) -> None:
    manifest = folder_manifest(repo_folder, HashCache(None))  # as the cluster describes the model
    data_dir = tmp_path / "data"

    async def main() -> None:
        fetch = fetcher()
        got = await fetch.fetch(manifest, tmp_path / "unused", [], hub=HubRef(REPO, data_dir))
        assert got == hub_model_dir(REPO, data_dir)
        assert folder_manifest(got, HashCache(None)) == manifest
        [progress] = fetch.board.snapshots()
        assert (progress.source, progress.state, progress.bytes_done) == ("hub", "done", manifest.total_bytes)
        assert progress.manifest_id == manifest.id and progress.model == REPO

    run(main)
    assert any(r.startswith(f"GET /{REPO}/resolve/") for r in hub.requests)
    assert not (tmp_path / "unused").exists()


def test_a_hub_model_nobody_described_yet(hub: FakeHub, repo_folder: Path, tmp_path: Path) -> None:
    async def main() -> None:
        folder = await fetch_from_hub(REPO, tmp_path / "data", HashCache(None))
        assert folder_manifest(folder, HashCache(None)) == folder_manifest(repo_folder, HashCache(None))

    run(main)


def test_a_hub_repo_that_changed_since_the_manifest_is_refused(
    hub: FakeHub, repo_folder: Path, tmp_path: Path
) -> None:
    manifest = folder_manifest(repo_folder, HashCache(None))
    hub.repos[REPO]["model.safetensors"] = os.urandom(200_000)

    async def main() -> None:
        fetch = fetcher()
        with pytest.raises(FetchError, match=r"differs from the cluster's manifest: 'model.safetensors'"):
            await fetch.fetch(manifest, tmp_path / "t", [], hub=HubRef(REPO, tmp_path / "data"))
        assert fetch.board.snapshots()[-1].state == "failed"

    run(main)


def test_offline_means_peers_only(repo_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: it must not be tried
    manifest: Manifest = folder_manifest(repo_folder, HashCache(None))
    hub_ref = HubRef(REPO, tmp_path / "data")

    async def main() -> None:
        with pytest.raises(
            FetchError, match=r"no peer holds the files of test-org/tiny-model and HF_HUB_OFFLINE=1"
        ):
            await fetcher().fetch(manifest, tmp_path / "t", [], hub=hub_ref)
        with pytest.raises(FetchError, match="no Hugging Face repo to fall back on"):
            await fetcher().fetch(manifest, tmp_path / "t", [])
        async with file_peer(repo_folder) as (url, served, _):  # a peer holds it: offline is no obstacle
            got = await fetcher().fetch(manifest, tmp_path / "t", [Peer("a", url)], hub=hub_ref)
            assert got == tmp_path / "t" and served.body_bytes == manifest.total_bytes

    run(main)


def test_a_stage_gets_only_its_files_from_the_hub(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage of layers [2, 4) of 4: the hub sends the metadata, then only that stage's shards
    (`allow_patterns`), each checked; offline, the same files on disk are enough."""
    folder = tmp_path / "sharded"
    write_files(folder, sharded_model(num_layers=4, shard_bytes=50_000))
    hub.add_repo(REPO, folder)
    manifest = folder_manifest(folder, HashCache(None))
    index, config = (json.loads((folder / name).read_text()) for name in (INDEX_FILE, "config.json"))
    wanted = stage_paths(manifest, index, config, start=2, end=4)
    hub_ref = HubRef(REPO, tmp_path / "data")

    async def stage() -> None:
        got = await fetcher().fetch_stage(manifest, tmp_path / "t", [], start=2, end=4, hub=hub_ref)
        assert got == hub_model_dir(REPO, hub_ref.data_dir)
        assert {p.name for p in got.iterdir() if not p.name.startswith(".")} == wanted
        assert all((got / p).read_bytes() == (folder / p).read_bytes() for p in wanted)

    run(stage)
    fetched = {r.rsplit("/", 1)[-1] for r in hub.requests if r.startswith(f"GET /{REPO}/resolve/")}
    assert fetched == wanted and len(wanted) < len(manifest.files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    run(stage)
    assert not hub.requests
