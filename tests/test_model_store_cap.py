"""`--max-model-bytes`: the least recently used models leave the store first; models in use never do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.models.disk import USED_MARKER, StoreFullError, make_room, mark_used
from node.models.store import hub_dir, models_dir

MB = 1_000_000
CAP = 10 * MB + 10_000
"""10 MB, and room for the small files (config.json, the use marker) beside the weights."""


def _model(folder: Path, size: int, used_at: float | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * size)
    if used_at is not None:
        mark_used(folder)
        os.utime(folder / USED_MARKER, (used_at, used_at))
    return folder


@pytest.fixture
def store(tmp_path: Path) -> dict[str, Path]:
    root = models_dir(tmp_path)
    return {
        "old": _model(root / "old", 3 * MB, used_at=1_000),
        "recent": _model(root / "recent", 3 * MB, used_at=3_000),
        "hub": _model(hub_dir(tmp_path) / "org--mid", 3 * MB, used_at=2_000),
    }


def test_no_cap_evicts_nothing(tmp_path: Path, store: dict[str, Path]) -> None:
    assert make_room(tmp_path, 100 * MB, None, keep=()) == []
    assert all(path.is_dir() for path in store.values())


def test_the_least_recently_used_go_first(tmp_path: Path, store: dict[str, Path]) -> None:
    # 9 MB held + 4 MB needed under a 10 MB cap: 3 MB must go, and "old" was used longest ago.
    assert make_room(tmp_path, 4 * MB, CAP, keep=()) == [store["old"]]
    assert not store["old"].exists() and store["hub"].is_dir() and store["recent"].is_dir()
    # Next, the hub model (used before "recent"), unless it is in use.
    assert make_room(tmp_path, 5 * MB, CAP, keep=[store["hub"]]) == [store["recent"]]
    assert store["hub"].is_dir()


def test_what_cannot_fit_evicts_nothing_and_says_why(tmp_path: Path, store: dict[str, Path]) -> None:
    with pytest.raises(StoreFullError, match="--max-model-bytes"):
        make_room(tmp_path, 8 * MB, CAP, keep=[store["recent"]])
    assert all(path.is_dir() for path in store.values())


def test_a_folder_outside_the_store_is_never_touched(tmp_path: Path, store: dict[str, Path]) -> None:
    mine = _model(tmp_path / "elsewhere" / "my-model", 50 * MB, used_at=1)
    make_room(tmp_path, 1 * MB, 7 * MB, keep=())
    assert mine.is_dir()
