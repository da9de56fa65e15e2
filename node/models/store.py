"""The data dir's model store: where model folders live, how they are named, listed and published.

Layout under `<data_dir>/models/`:

    <name>/                 a folder imported from a .gguf file (the built-in one is `smollm2-135m/`)
    hf/<org>--<name>/       a Hugging Face repo, as `snapshot_download(local_dir=...)` leaves it
    hf/.cache/              huggingface_hub's refs and locks for those downloads
    cluster/<manifest id>/  files fetched from peers (`node.files`): a whole model, or only the
                            config, tokenizer and shards of the stages this node ran
    .<name>.partial-XXXX/   an import in progress (never listed, never resolved)

A model folder is one that holds `config.json`; it is made complete before it gets its final name
(`staging_dir` + `publish_dir`), so a crash mid-import leaves only a hidden `.partial` folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HUB_SUBDIR = "hf"
"""Hugging Face downloads go to `<data_dir>/models/hf/`; `hf` is therefore not a valid import name."""
CLUSTER_SUBDIR = "cluster"
"""Models fetched from peers go to `<data_dir>/models/cluster/<manifest id>/`: a reserved name too."""
HUB_SEPARATOR = "--"
"""`org/name` is stored as `org--name`: the Hub forbids `--` in ids, so the mapping is reversible."""
STALE_PARTIAL_S = 3600.0
"""A `.partial` folder older than this is left over from a killed import and gets removed."""

ModelSource = Literal["builtin", "folder", "gguf", "hub", "local"]


class ModelResolveError(ValueError):
    """A model reference that names no usable model; the message says what was tried and why."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for `mlx_lm.load(path)`."""

    name: str
    """The id clients put in requests: `smollm2-135m`, a folder's name, a repo id, a .gguf's stem."""
    path: Path
    """An absolute path to an mlx-lm model folder (config.json, *.safetensors, tokenizer files)."""
    source: ModelSource
    """How the reference was understood; `local` is a name already in `<data_dir>/models/`."""


@dataclass(frozen=True)
class LocalModel:
    """One model folder found in the data dir, as `shoal models` shows it."""

    name: str
    path: Path
    model_type: str
    size_bytes: int


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$SHOAL_DATA_DIR`, else `$XDG_DATA_HOME/shoal`, else `~/.local/share/shoal`."""
    env = os.environ if env is None else env
    if explicit := env.get("SHOAL_DATA_DIR"):
        return Path(explicit).expanduser()
    if xdg := env.get("XDG_DATA_HOME"):
        return Path(xdg).expanduser() / "shoal"
    return Path.home() / ".local" / "share" / "shoal"


def models_dir(data_dir: Path) -> Path:
    return data_dir / "models"


def hub_dir(data_dir: Path) -> Path:
    return models_dir(data_dir) / HUB_SUBDIR


def hub_folder_name(repo_id: str) -> str:
    """`org/name` -> `org--name`."""
    return repo_id.replace("/", HUB_SEPARATOR, 1)


def repo_id_from_folder(folder_name: str) -> str:
    """`org--name` -> `org/name` (the inverse of `hub_folder_name`)."""
    return folder_name.replace(HUB_SEPARATOR, "/", 1)


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def dir_size(path: Path) -> int:
    """Bytes of the regular files under `path`, not following links."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for file in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, file)).st_size
    return total


def read_model_type(path: Path) -> str:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "?"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else "?"


def list_local_models(data_dir: Path) -> list[LocalModel]:
    """Every complete model folder under `<data_dir>/models`, imported ones first, each sorted by name."""
    root = models_dir(data_dir)
    found: list[LocalModel] = []
    subdirs = (
        (root, _plain_name),
        (root / HUB_SUBDIR, repo_id_from_folder),
        (root / CLUSTER_SUBDIR, _cluster_name),
    )
    for parent, naming in subdirs:
        if not parent.is_dir():
            continue
        for child in sorted(parent.iterdir()):
            if child.name.startswith(".") or not child.is_dir() or not is_model_dir(child):
                continue
            found.append(LocalModel(naming(child.name), child, read_model_type(child), dir_size(child)))
    return found


def _plain_name(folder_name: str) -> str:
    return folder_name


def _cluster_name(folder_name: str) -> str:
    """`cluster/<manifest id>`: a model from peers is named by its content (it may hold only the
    shards of a stage, so it is listed, but only a complete one serves on its own)."""
    return f"{CLUSTER_SUBDIR}/{folder_name}"


@contextlib.contextmanager
def folder_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for preparing `target`, so that two processes never import it twice."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """An empty hidden folder beside `target` to build it in; removed on any failure.

    The caller fills it and calls `publish_dir(staging, target)` before the block ends.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published folder is an ordinary one
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_dir(staging: Path, target: Path) -> None:
    """Give the complete folder `staging` the name `target`, replacing any folder there.

    Each rename is atomic: a reader sees the old folder, no folder, or the new one; never a half one.
    """
    old: Path | None = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(target, old)
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_partials(target: Path) -> None:
    now = time.time()
    for pattern in (f".{target.name}.partial-*", f".{target.name}.old-*"):
        for leftover in target.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if now - leftover.stat().st_mtime > STALE_PARTIAL_S:
                    shutil.rmtree(leftover, ignore_errors=True)
