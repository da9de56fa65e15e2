"""Import a llama-architecture `.gguf` file into an mlx-lm model folder (float32 weights).

`mlx_lm.load` cannot read a GGUF, but `mx.load(path, return_metadata=True)` can: it returns the
tensors under llama.cpp's names (Q4_0/Q4_1/Q8_0 ones as MLX affine `weight`/`scales`/`biases`
triples with group size 32; F16/F32 ones plain) and the metadata. The import:

1. dequantizes every tensor to float32 (quantized MLX kernels are very slow on a CPU, and
   bfloat16 changes greedy output);
2. renames tensors to Hugging Face llama names and undoes llama.cpp's row permutation of the q
   and k projections (its converter interleaves each head's rotary halves);
3. writes `config.json` from the `llama.*` metadata and the tokenizer files from `tokenizer.*`
   (see `gguf_tokenizer`);
4. builds all of it in a hidden staging folder and renames it into place, so an interrupted import
   never leaves a folder that looks complete.

The pure parts (names, permutation, config) are plain functions; `import_gguf` and
`ensure_gguf_model` do the I/O. Everything that cannot be imported faithfully (another
architecture, K-quants, Llama-3.1 rope factors, a SentencePiece vocabulary) raises
`GGUFImportError` instead of producing a model that talks nonsense.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from node.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, tokenizer_config
from node.models.store import (
    ModelResolveError,
    folder_lock,
    publish_dir,
    staging_dir,
)

log = logging.getLogger("shoal.models")

GGUF_GROUP_SIZE = 32
"""llama.cpp's Q4_0/Q4_1/Q8_0 blocks hold 32 weights; mx.load keeps that as the MLX group size."""
IMPORTER_VERSION = 1
"""Bump when the import's output changes: cached imports with an older version are redone."""
MARKER_FILE = "shoal_import.json"
"""Written last into an imported folder: which file (path, size, mtime) it was made from, and how."""
WEIGHTS_FILE = "model.safetensors"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFImportError(ModelResolveError):
    """A .gguf file that cannot be turned into a faithful mlx-lm model folder."""


# ---- pure helpers --------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> HF's: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if match := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise GGUFImportError(f"tensor {gguf_name!r} has no llama equivalent (not a plain llama model?)")


def permute_rows(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's `permute` for q/k rows (HF order -> GGUF order). Only tests need this direction."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo `permute_rows`: per head, rows (r0, r_half, r1, r_half+1, ...) -> (r0, r1, ..., r_half, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def plain_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """mx.load's metadata with `mx.array` values turned into Python scalars and lists."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        out[key] = value.tolist() if isinstance(value, mx.array) else value
    return out


def _float32_decimal(value: float) -> float:
    """The shortest decimal that is the same float32: 9.999999747378752e-06 -> 1e-05."""

    def as_f32(x: float) -> float:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])

    target = as_f32(value)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        candidate = float(f"{target:.{digits}g}")
        with contextlib.suppress(OverflowError):  # rounded past float32's largest value
            if as_f32(candidate) == target:
                return candidate
    return target


def build_llama_config(meta: Mapping[str, Any], *, has_output: bool) -> dict[str, Any]:
    """Hugging Face `config.json` for a llama GGUF's plain metadata. Raises `GGUFImportError`."""

    def need(key: str) -> Any:
        if key not in meta:
            raise GGUFImportError(f"the GGUF metadata has no {key!r}")
        return meta[key]

    hidden = int(need("llama.embedding_length"))
    n_heads = int(need("llama.attention.head_count"))
    n_kv_heads = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if meta.get("llama.expert_count"):
        raise GGUFImportError("mixture-of-experts llama GGUFs are not supported")
    vocab_size = meta.get("llama.vocab_size")
    if vocab_size is None:
        vocab_size = len(meta.get("tokenizer.ggml.tokens") or ())
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "rms_norm_eps": _float32_decimal(float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": _float32_decimal(float(meta.get("llama.rope.freq_base", 10000.0))),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(need("llama.rope.scaling.factor"))}
    elif scaling != "none":
        raise GGUFImportError(f"rope scaling {scaling!r} is not supported")
    for field in ("bos_token_id", "eos_token_id"):
        if (token_id := meta.get(f"tokenizer.ggml.{field}")) is not None:
            config[field] = int(token_id)
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]
    return config


def dequantize_all(tensors: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Every tensor as float32 under its GGUF name; quantized `weight`/`scales`/`biases` triples merged."""
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        scales = tensors.get(f"{base}.scales")
        if scales is None:
            out[name] = value.astype(mx.float32)
            continue
        biases = tensors[f"{base}.biases"]
        bits = value.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 weights = bits per weight
        out[name] = mx.dequantize(
            value,
            scales.astype(mx.float32),
            biases.astype(mx.float32),
            group_size=GGUF_GROUP_SIZE,
            bits=bits,
        )
    return out


def llama_weights(tensors: Mapping[str, mx.array], config: Mapping[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors -> float32 weights under HF llama names, q/k rows back in HF order."""
    if "rope_freqs.weight" in tensors:
        raise GGUFImportError("rope frequency factors (Llama 3.1-style rope scaling) are not supported")
    if biased := sorted(name for name in tensors if name.endswith(".bias")):
        raise GGUFImportError(f"bias tensors are not supported (e.g. {biased[0]})")
    weights: dict[str, mx.array] = {}
    for name, value in dequantize_all(tensors).items():
        hf_name = hf_tensor_name(name)
        if ".self_attn.q_proj." in hf_name:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif ".self_attn.k_proj." in hf_name:
            value = unpermute_rows(value, config["num_key_value_heads"])
        weights[hf_name] = value
    return weights


# ---- I/O -----------------------------------------------------------------------------------------


def read_gguf(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors (lazy) and plain metadata of a GGUF file. Raises `GGUFImportError`."""
    try:
        loaded = mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise GGUFImportError(f"cannot read {gguf_path} as GGUF: {exc}") from exc
    tensors, meta = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    return dict(tensors), plain_metadata(meta)


def source_stamp(gguf_path: Path) -> dict[str, Any]:
    """What identifies the file an import came from (cheap: no hashing of 100s of MB)."""
    st = gguf_path.stat()
    return {
        "source": str(gguf_path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "importer_version": IMPORTER_VERSION,
    }


def is_current_import(out_dir: Path, gguf_path: Path) -> bool:
    """Whether `out_dir` is a complete import of this very file by this importer version."""
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(marker == source_stamp(gguf_path) and (out_dir / WEIGHTS_FILE).is_file())


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Import `gguf_path` into the mlx-lm folder `out_dir` (replacing it) and return `out_dir`.

    Always does the work (~5 s for a 135M model); `ensure_gguf_model` is the cached form.
    Raises `GGUFImportError` (a `ModelResolveError`) for files it cannot import faithfully.
    """
    gguf_path = Path(gguf_path)
    tensors, meta = read_gguf(gguf_path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    config = build_llama_config(meta, has_output="output.weight" in tensors)
    try:
        tokenizer = build_tokenizer(meta)
    except GGUFTokenizerError as exc:
        raise GGUFImportError(f"{gguf_path}: {exc}") from exc
    tok_config = tokenizer_config(meta, context_length=config["max_position_embeddings"])
    weights = llama_weights(tensors, config)

    with staging_dir(out_dir) as staging:
        mx.save_safetensors(str(staging / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        _write_json(staging / "config.json", config)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tok_config)
        _write_json(staging / MARKER_FILE, source_stamp(gguf_path))  # last: the import is complete
        publish_dir(staging, out_dir)
    return out_dir


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def ensure_gguf_model(gguf_path: Path, out_dir: Path) -> Path:
    """`out_dir`, imported from `gguf_path` unless a current import is already there.

    Safe to call from several processes at once: one imports while the others wait, then reuse it.
    """
    gguf_path = Path(gguf_path)
    if is_current_import(out_dir, gguf_path):
        return out_dir
    with folder_lock(out_dir):
        if is_current_import(out_dir, gguf_path):
            return out_dir
        log.info("importing %s into %s (once; takes a few seconds)", gguf_path, out_dir)
        return import_gguf(gguf_path, out_dir)
