"""A cap on the model store: least recently used models go first, never one that is in use.

Everything under `<data_dir>/models/` is a copy Shoal made (a .gguf import, a hub download, files
fetched from peers) and can be made again, so it may be evicted; a folder the user pointed at
(`--model /data/my-model`) lives elsewhere and is never touched. "Used" is when a runner or stage
last loaded the model (`mark_used`), else when the folder was last changed.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from node.models.store import LocalModel, list_local_models, models_dir

log = logging.getLogger(__name__)

USED_MARKER = ".last-used"
"""An empty file in a model folder whose mtime says when the model was last loaded."""


class StoreFullError(OSError):
    """The model does not fit under the cap even with every unused model evicted."""


def mark_used(folder: Path) -> None:
    """Note that `folder`'s model was just loaded (best effort: a read-only store only loses order)."""
    with contextlib.suppress(OSError):
        (folder / USED_MARKER).touch()


def last_used(folder: Path) -> float:
    for candidate in (folder / USED_MARKER, folder):
        with contextlib.suppress(OSError):
            return candidate.stat().st_mtime
    return 0.0


@dataclass(frozen=True)
class Eviction:
    """The plan `plan_eviction` makes: what to remove, and whether that makes enough room."""

    remove: tuple[LocalModel, ...]
    fits: bool


def plan_eviction(
    models: Collection[LocalModel], used_at: dict[Path, float], need: int, cap: int, keep: Collection[Path]
) -> Eviction:
    """Which models to evict, oldest use first, so that `need` more bytes fit under `cap`. Pure."""
    kept = {path.resolve() for path in keep}
    total = sum(model.size_bytes for model in models)
    remove: list[LocalModel] = []
    candidates = sorted(
        (m for m in models if m.path.resolve() not in kept), key=lambda m: (used_at.get(m.path, 0.0), m.name)
    )
    for model in candidates:
        if total + need <= cap:
            break
        remove.append(model)
        total -= model.size_bytes
    return Eviction(tuple(remove), total + need <= cap)


def make_room(data_dir: Path, need_bytes: int, cap_bytes: int | None, keep: Collection[Path]) -> list[Path]:
    """Evict least recently used models until `need_bytes` more fit under `cap_bytes` (None: no cap).

    `keep`: the folders of models in use (or about to be). Returns the evicted folders; raises
    `StoreFullError` naming the figures when even evicting everything else is not enough, having
    evicted nothing.
    """
    if cap_bytes is None:
        return []
    root = models_dir(data_dir).resolve()
    models = [m for m in list_local_models(data_dir) if m.path.resolve().is_relative_to(root)]
    plan = plan_eviction(models, {m.path: last_used(m.path) for m in models}, need_bytes, cap_bytes, keep)
    if not plan.fits:
        held = sum(m.size_bytes for m in models)
        raise StoreFullError(
            f"{need_bytes / 1e9:.2f} GB more does not fit in the model store's cap of "
            f"{cap_bytes / 1e9:.2f} GB ({held / 1e9:.2f} GB held, models in use kept): "
            "raise --max-model-bytes or free disk"
        )
    for model in plan.remove:
        log.info(
            "evicting %s (%.2f GB, least recently used) to make room", model.name, model.size_bytes / 1e9
        )
        shutil.rmtree(model.path, ignore_errors=True)
    return [m.path for m in plan.remove]
