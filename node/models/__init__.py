"""Model files: fetching, preparing and checking what a model needs on disk.

A model reference (the built-in `smollm2-135m`, a model folder, a llama/qwen2/qwen3 `.gguf` file or
a Hugging Face repo id) becomes an mlx-lm model folder with `resolve_model(ref, data_dir)`. Modules:
`store` (data dir layout, listing, atomic publishing), `gguf*` (GGUF import: architectures,
quant layouts, safetensors writer, child process, tokenizer), `builtin` (the default model), `hub`
(Hugging Face downloads), `resolve` (the dispatcher).
"""

from node.models.builtin import BUILTIN_MODEL_NAME, builtin_gguf_path, ensure_builtin_model
from node.models.gguf import GGUFImportError, ensure_gguf_model, import_gguf
from node.models.hub import download_hub_model
from node.models.resolve import locate_model, resolve_model
from node.models.store import (
    LocalModel,
    ModelResolveError,
    ResolvedModel,
    default_data_dir,
    list_local_models,
)

__all__ = [
    "BUILTIN_MODEL_NAME",
    "GGUFImportError",
    "LocalModel",
    "ModelResolveError",
    "ResolvedModel",
    "builtin_gguf_path",
    "default_data_dir",
    "download_hub_model",
    "ensure_builtin_model",
    "ensure_gguf_model",
    "import_gguf",
    "list_local_models",
    "locate_model",
    "resolve_model",
]
