"""Manifests: content ids, path rules, the files of a stage, and folder hashing with its cache."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from node.files.hashing import HashCache, folder_manifest
from protocol.manifest import (
    MAX_MANIFEST_FILES,
    FileEntry,
    Manifest,
    ManifestError,
    TransferProgress,
    canonical_bytes,
    manifest_of,
    metadata_paths,
    stage_paths,
    stage_shards,
)
from tests.file_peers import sharded_model, write_files


def entry(path: str, data: bytes = b"x") -> FileEntry:
    return FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


# ---- identity -------------------------------------------------------------------------------------


def test_the_id_names_the_content_whatever_the_order() -> None:
    a, b = entry("config.json", b"{}"), entry("model.safetensors", b"weights")
    manifest = manifest_of([b, a])
    assert manifest == manifest_of([a, b])
    assert manifest.id == hashlib.sha256(canonical_bytes(manifest)).hexdigest()
    # Pinned: the canonical encoding must never change within a manifest version.
    assert canonical_bytes(manifest_of([entry("a", b"")])) == (
        b'{"derived_from":null,"files":[{"path":"a","sha256":'
        b'"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","size":0}],"version":1}'
    )
    assert manifest_of([a, entry("model.safetensors", b"weightz")]).id != manifest.id
    assert manifest_of([a, b], derived_from=entry("model.gguf", b"gguf")).id != manifest.id


def test_a_manifest_survives_the_wire() -> None:
    manifest = manifest_of([entry("config.json"), entry("sub/tokenizer.json")], derived_from=entry("m.gguf"))
    assert Manifest.model_validate(json.loads(manifest.model_dump_json())) == manifest
    assert Manifest.model_validate_json(manifest.model_dump_json()).id == manifest.id
    assert manifest.entry("sub/tokenizer.json") == entry("sub/tokenizer.json")
    assert manifest.total_bytes == 2
    with pytest.raises(ManifestError, match="no file 'absent'"):
        manifest.subset({"absent"})


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/etc/passwd",
        "../x",
        "a/../b",
        "a//b",
        "./a",
        ".hidden",
        "a/.git/config",
        "a\\b",
        "nul\x00",
        "x" * 201,
    ],
)
def test_paths_never_leave_the_model_folder(path: str) -> None:
    with pytest.raises(ValueError):
        entry(path)


@pytest.mark.parametrize(
    "bad",
    [
        {"path": "a", "size": -1, "sha256": "0" * 64},
        {"path": "a", "size": True, "sha256": "0" * 64},
        {"path": "a", "size": "1", "sha256": "0" * 64},
        {"path": "a", "size": 1, "sha256": "0" * 63},
        {"path": "a", "size": 1, "sha256": "A" * 64},
        {"path": "a", "size": 1, "sha256": "0" * 64, "extra": 1},
    ],
)
def test_hostile_entries_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FileEntry.model_validate(bad)


def test_files_must_be_sorted_unique_few_and_not_folders() -> None:
    a, b = entry("a"), entry("b")
    for files in ((b, a), (a, a), (entry("a"), entry("a/b"))):
        with pytest.raises(ValueError):
            Manifest(files=files)
    too_many = [entry(f"f{i:04d}") for i in range(MAX_MANIFEST_FILES + 1)]
    with pytest.raises(ValueError, match="exceed"):
        manifest_of(too_many)


# ---- what a stage needs ---------------------------------------------------------------------------


def _model(num_layers: int) -> tuple[Manifest, dict[str, object], dict[str, object]]:
    files = sharded_model(num_layers, shard_bytes=4)
    manifest = manifest_of(entry(path, data) for path, data in files.items())
    index = json.loads(files["model.safetensors.index.json"])
    return manifest, index, json.loads(files["config.json"])


def _shard(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


@pytest.mark.parametrize(
    ("start", "end", "shards"),
    [
        (0, 2, {1, 2}),  # first: its layers' shards (the embedding lies in shard 1)
        (2, 4, {3, 4, 6}),  # middle: its layers only
        (4, 6, {5, 6}),  # last: its layers, the norm and head in shard 6
        (0, 6, {1, 2, 3, 4, 5, 6}),
    ],
)
def test_a_stage_needs_the_shards_of_its_layers_and_ends(start: int, end: int, shards: set[int]) -> None:
    _, index, _ = _model(6)
    mapping = dict(index["weight_map"])  # type: ignore[call-overload]
    mapping["model.layers.3.extra.weight"] = _shard(6, 6)  # a layer split over two shards
    got = stage_shards(mapping, start=start, end=end, num_layers=6)
    assert got == {_shard(i, 6) for i in shards}


def test_a_tied_head_needs_the_embedding_on_the_last_stage() -> None:
    _, index, _ = _model(4)
    mapping = {k: v for k, v in index["weight_map"].items() if not k.startswith("lm_head")}  # type: ignore[attr-defined]
    assert stage_shards(mapping, start=2, end=4, num_layers=4) == {_shard(i, 4) for i in (1, 3, 4)}
    assert stage_shards(mapping, start=2, end=4, num_layers=4, tied_embeddings=False) == {
        _shard(3, 4),
        _shard(4, 4),
    }
    assert stage_shards(mapping, start=1, end=3, num_layers=4) == {_shard(2, 4), _shard(3, 4)}


def test_stage_paths_add_the_small_files_and_check_the_index() -> None:
    manifest, index, config = _model(4)
    meta = {"config.json", "model.safetensors.index.json", "tokenizer.json"}
    assert metadata_paths(manifest) == meta
    assert stage_paths(manifest, index, config, start=1, end=2) == meta | {_shard(2, 4)}
    assert stage_paths(manifest, None, config, start=1, end=2) == {f.path for f in manifest.files}
    with pytest.raises(ManifestError, match="num_hidden_layers"):
        stage_paths(manifest, index, {}, start=0, end=1)
    with pytest.raises(ManifestError, match="not a non-empty part"):
        stage_paths(manifest, index, config, start=2, end=2)
    broken = {"weight_map": {"model.layers.0.w": "other.safetensors"}}
    with pytest.raises(ManifestError, match=r"no file 'other\.safetensors'"):
        stage_paths(manifest, broken, config, start=0, end=1)
    for bad in ({}, {"weight_map": {"w": "../x.safetensors"}}, {"weight_map": {"w": "x.bin"}}):
        with pytest.raises(ManifestError):
            stage_paths(manifest, bad, config, start=0, end=1)


def test_transfer_progress_fraction() -> None:
    base: dict[str, Any] = {
        "manifest_id": "",
        "model": "m",
        "source": "peers",
        "rate_bps": 0.0,
        "files_done": 0,
        "files_total": 1,
    }
    assert (
        TransferProgress(**base, state="fetching", bytes_done=25, bytes_total=100, peers=1).fraction == 0.25
    )
    assert TransferProgress(**base, state="fetching", bytes_done=5, bytes_total=0, peers=0).fraction == 0.0
    assert TransferProgress(**base, state="done", bytes_done=0, bytes_total=0, peers=0).fraction == 1.0


# ---- a folder's manifest, hashed once -------------------------------------------------------------


def test_folder_manifest_hashes_each_file_once_across_restarts(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    files = {"config.json": b"{}", "sub/tokenizer.json": b"tok", "model.safetensors": os.urandom(100_000)}
    write_files(folder, files | {".cache/huggingface/x.lock": b"", ".hidden": b"h"})
    sidecar = tmp_path / "hashes.json"

    first = HashCache(sidecar)
    manifest = folder_manifest(folder, first)
    assert manifest == manifest_of(entry(path, data) for path, data in files.items())
    assert first.hashed_bytes == sum(len(d) for d in files.values())

    restarted = HashCache(sidecar)  # a new process: the sidecar answers, nothing is read
    assert folder_manifest(folder, restarted) == manifest
    assert restarted.hashed_bytes == 0

    (folder / "config.json").write_bytes(b"[]")  # a changed file is hashed again, alone
    again = HashCache(sidecar)
    changed = folder_manifest(folder, again)
    assert again.hashed_bytes == 2
    assert changed.entry("config.json") == entry("config.json", b"[]")
    assert changed.id != manifest.id

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert folder_manifest(folder, again, derived_from=gguf).derived_from == entry("m.gguf", b"GGUF")


def test_a_broken_sidecar_starts_empty_and_an_unwritable_one_is_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    sidecar = tmp_path / "hashes.json"
    sidecar.write_text("{not json")
    cache = HashCache(sidecar)
    assert cache.sha256(tmp_path / "a") == hashlib.sha256(b"a").hexdigest()
    cache.save()
    assert HashCache(sidecar).matches(tmp_path / "a", entry("a", b"a"))
    blocked = HashCache(tmp_path / "a" / "cannot-be-a-dir.json")
    assert not blocked.matches(tmp_path / "a", entry("a", b"b"))
    blocked.save()  # logs once, raises nothing
