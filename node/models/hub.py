"""Hugging Face repos as model folders: `org/name` -> `<data_dir>/models/hf/org--name/`.

`huggingface_hub.snapshot_download` does the work, with its own progress bar; an interrupted
download resumes where it stopped. Two environment variables are read at call time (the library
reads them once, at import, which is too early for a process that sets them later, and for tests):

- `HF_ENDPOINT`: the Hub (or a mirror) to download from;
- `HF_HUB_OFFLINE=1`: no network at all; a repo already downloaded completely is used as it is,
  anything else fails with a `ModelResolveError` naming the repo.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path

from node.models.store import ModelResolveError, hub_dir, hub_folder_name, is_model_dir

ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
"""What mlx-lm itself downloads for a model (`mlx_lm.utils.DEFAULT_ALLOW_PATTERNS`): no .bin, no .gguf."""
HUB_CACHE_SUBDIR = ".cache"
"""`<data_dir>/models/hf/.cache/`: huggingface_hub's refs (branch -> commit), so offline mode can
check that a download is complete; kept in the data dir, not in ~/.cache."""

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
_TRUE = {"1", "true", "yes", "on"}


def looks_like_repo_id(ref: str) -> bool:
    """`org/name` with the characters the Hub allows (no `--` or `..`, which the Hub forbids)."""
    return bool(_REPO_ID.fullmatch(ref)) and "--" not in ref and ".." not in ref


def hub_offline(env: dict[str, str] | None = None) -> bool:
    """Whether `HF_HUB_OFFLINE` (or transformers' older `TRANSFORMERS_OFFLINE`) is set to a true value."""
    env = dict(os.environ) if env is None else env
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_model_dir(repo_id: str, data_dir: Path) -> Path:
    return hub_dir(data_dir) / hub_folder_name(repo_id)


def exact_patterns(paths: Collection[str]) -> list[str]:
    """`allow_patterns` that match exactly these repo paths (huggingface_hub matches with `fnmatch`,
    so `*`, `?` and `[` in a name are escaped)."""
    return [glob.escape(path) for path in sorted(paths)]


def download_hub_model(
    repo_id: str,
    data_dir: Path,
    *,
    revision: str | None = None,
    allow_patterns: Sequence[str] = ALLOW_PATTERNS,
) -> Path:
    """The folder of `repo_id` in the data dir, downloaded (or completed) first unless offline.

    `allow_patterns` says which files (default: what mlx-lm downloads); a pipeline stage passes
    `exact_patterns` of the files it needs, and then only those are downloaded, or, offline, must
    be there. Raises `ModelResolveError` when the repo does not exist, cannot be reached, is incomplete while
    offline, or holds no `config.json` (not a transformers/mlx-lm model).
    """
    from huggingface_hub import snapshot_download  # ~0.3 s import: only when a repo is used

    local_dir = hub_model_dir(repo_id, data_dir)
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            local_dir=local_dir,
            cache_dir=hub_dir(data_dir) / HUB_CACHE_SUBDIR,
            allow_patterns=list(allow_patterns),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            local_files_only=offline,
        )
    # Any failure of the download library (its HTTP and transport error classes differ between
    # versions) becomes one error naming the repo; the cause stays chained for the log.
    except Exception as exc:
        if offline:
            raise ModelResolveError(
                f"model {repo_id!r} is not (completely) downloaded in {local_dir} and HF_HUB_OFFLINE is set: "
                f"download it once with network access ({type(exc).__name__}: {exc})"
            ) from exc
        source = os.environ.get("HF_ENDPOINT") or "the Hugging Face Hub"
        raise ModelResolveError(
            f"could not download model {repo_id!r} from {source} into {local_dir}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    folder = Path(path)
    if not is_model_dir(folder):
        raise ModelResolveError(f"Hugging Face repo {repo_id!r} has no config.json: not an mlx-lm model")
    return folder
