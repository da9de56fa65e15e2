"""Where fetched files lie: the target folder, its staging folder beside it, the part files inside.

    <data_dir>/models/cluster/<manifest id>/           a model fetched from peers (`cluster_model_dir`)
    <parent>/.<name>.fetch/                             its staging folder: checked files, waiting
    <parent>/.<name>.fetch/.parts/<path>.<a>-<b>.part   bytes in flight (`pieces`)

A file reaches the staging folder only once its hash matched; the target gets files only from
there, by rename: a new target appears whole (one rename of the staging folder), an existing one
(a stage that needs more files of a model already here) gets each file complete, one rename
each. The staging folder's name is fixed, not random, so a restarted node finds what it had.
All blocking: worker threads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from node.files.download import FetchError
from node.files.hashing import HashCache
from node.models.store import CLUSTER_SUBDIR, models_dir
from protocol.manifest import FileEntry

PARTS_DIR = ".parts"
"""Inside the staging folder; hidden, so no manifest path can clash with it."""


def cluster_model_dir(data_dir: Path, manifest_id: str) -> Path:
    """Where a model fetched from peers is kept: named by content, so two models never share it."""
    return models_dir(data_dir) / CLUSTER_SUBDIR / manifest_id


def staging_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.fetch"


def inventory(
    cache: HashCache, target: Path, staging: Path, wanted: Sequence[FileEntry]
) -> tuple[list[FileEntry], list[FileEntry]]:
    """(to fetch, already checked in staging) of `wanted`; the rest is in the target already, with
    the right hash. A staged file that does not match is removed."""
    todo: list[FileEntry] = []
    staged: list[FileEntry] = []
    try:
        for entry in wanted:
            if cache.matches(target / entry.path, entry):
                continue
            if cache.matches(staging / entry.path, entry):
                staged.append(entry)
                continue
            if (staging / entry.path).is_file():
                (staging / entry.path).unlink()
            todo.append(entry)
    finally:
        cache.save()
    return todo, staged


def place(cache: HashCache, whole: Path, dest: Path, sha256: str) -> None:
    """Give a file whose hash matched its name in the staging folder."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(whole, dest)
    cache.remember(dest, sha256)


def write_empty(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(b"")


def publish(cache: HashCache, staging: Path, target: Path) -> None:
    """Move the checked files from staging into the target (see the module docstring)."""
    shutil.rmtree(staging / PARTS_DIR, ignore_errors=True)
    files = [p for p in staging.rglob("*") if p.is_file()]
    hashes = {p.relative_to(staging): cache.sha256(p) for p in files}  # cached when they were placed
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, target)
    else:
        for rel in hashes:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, target / rel)
        shutil.rmtree(staging, ignore_errors=True)
    for rel, sha in hashes.items():
        cache.remember(target / rel, sha)
    cache.save()


def read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FetchError(f"cannot read {path.name} of the fetched model: {exc}") from exc
