"""Random-weight mlx-lm model folders of any small size, with a real tokenizer, for tests.

    make_random_model(tmp_path / "tiny", tokenizer_from=builtin_model_dir)

builds the mlx-lm model class from a config dict, fills every parameter with random values
(norm weights 1, other weights normal * 0.02), saves it as `model.safetensors` with
`{"format": "mlx"}` and copies the tokenizer files from `tokenizer_from`. The vocabulary size is
the tokenizer's, so every token id it produces has an embedding row. The output head is its own
random matrix (not tied to the embedding): with tied random weights a tiny model just echoes its
last input token, while an untied one produces varied text.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import Tokenizer

ModelType = Literal["llama", "qwen2", "qwen3"]
DType = Literal["float32", "bfloat16", "float16"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Copied from `tokenizer_from` when present; config.json, weights and generation_config.json (the
donor's sampling defaults, which would not suit random weights) never are."""
WEIGHT_SCALE = 0.02


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Ids the tokenizer can produce: its vocabulary plus added tokens."""
    return int(
        Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    )


def random_model_config(
    *,
    model_type: ModelType,
    vocab_size: int,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    special_ids: dict[str, Any],
) -> dict[str, Any]:
    """A Hugging Face style config.json for `model_type` with these sizes."""
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
        model_type
    ]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6 if model_type == "qwen3" else 1e-5,
        "rope_theta": 1_000_000.0 if model_type == "qwen3" else 10_000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    config.update(special_ids)
    return config


def make_random_model(
    out_dir: Path,
    *,
    model_type: ModelType = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    tokenizer_from: Path,
    seed: int = 0,
    dtype: DType = "float32",
) -> Path:
    """Write a random-weight `model_type` model folder to `out_dir` (created) and return it.

    Deterministic for a given seed and shape. A 2-layer, 64-wide model with SmolLM2's 49152-token
    vocabulary is ~13 MB (the embedding dominates) and loads in well under a second.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = random_model_config(
        model_type=model_type,
        vocab_size=tokenizer_vocab_size(tokenizer_from),
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        special_ids=_special_ids(tokenizer_from),
    )
    return write_random_model(out_dir, config, tokenizer_from=tokenizer_from, seed=seed, dtype=dtype)


def write_random_model(
    out_dir: Path, config: dict[str, Any], *, tokenizer_from: Path, seed: int = 0, dtype: DType = "float32"
) -> Path:
    """The mlx-lm model class of `config` with random weights, written as a folder. A tied config
    (`tie_word_embeddings`) gets no `lm_head`, as tied checkpoints come."""
    from mlx_lm.utils import MODEL_REMAPPING

    family = str(config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = _random_parameters(dict(tree_flatten(model.parameters())), seed, getattr(mx, dtype))
    model.update(tree_unflatten(list(weights.items())))  # proves every name and shape fits the class
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    return write_model_folder(Path(out_dir), weights, config, tokenizer_from=tokenizer_from)


def _random_parameters(shapes: dict[str, mx.array], seed: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    key = mx.random.key(seed)
    out: dict[str, mx.array] = {}
    for name, param in sorted(shapes.items()):
        key, sub = mx.random.split(key)
        if "norm" in name and name.endswith(".weight"):
            value = mx.ones(param.shape)
        elif name.endswith(".bias"):
            value = mx.zeros(param.shape)
        else:
            value = mx.random.normal(param.shape, key=sub) * WEIGHT_SCALE
        out[name] = value.astype(dtype)
    mx.eval(out)
    return out


def _special_ids(tokenizer_dir: Path) -> dict[str, Any]:
    """bos/eos ids from the tokenizer folder's config.json, when it has one (e.g. an imported model)."""
    try:
        source = json.loads((tokenizer_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {key: source[key] for key in ("bos_token_id", "eos_token_id") if key in source}


_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    """HF llama name -> llama.cpp name, spelled out independently of `node.models.gguf`."""
    base, _, kind = hf_name.rpartition(".")
    if base in _HF_TO_GGUF_GLOBAL:
        return f"{_HF_TO_GGUF_GLOBAL[base]}.{kind}"
    _model, _layers, index, rest = base.split(".", 3)
    return f"blk.{index}.{_HF_TO_GGUF_LAYER[rest]}.{kind}"


def llama_cpp_permute(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's convert_hf_to_gguf `permute` of q/k rows, written with explicit row indices."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    half = head_dim // 2
    # GGUF row h*head_dim + 2*i + j holds HF row h*head_dim + j*half + i
    order = [h * head_dim + j * half + i for h in range(n_heads) for i in range(half) for j in range(2)]
    return w[mx.array(order)]


def write_llama_gguf(model_dir: Path, gguf_path: Path, *, tokenizer_gguf: Path) -> Path:
    """Write the llama model folder `model_dir` as an F32 GGUF file, the way llama.cpp would.

    The tokenizer metadata (vocab, merges, token types, special ids, chat template) is copied
    from `tokenizer_gguf`, so the vocabulary must be that file's (use its imported folder as
    `tokenizer_from` when making the model).
    """
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config["model_type"] != "llama":
        raise ValueError("only llama models can be written as a llama GGUF")
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    tensors: dict[str, mx.array] = {}
    for name, value in weights.items():
        if ".self_attn.q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        tensors[gguf_tensor_name(name)] = value.astype(mx.float32)
    _tensors, source_meta = mx.load(str(tokenizer_gguf), return_metadata=True)
    assert isinstance(source_meta, dict)
    meta: dict[str, Any] = {k: v for k, v in source_meta.items() if k.startswith("tokenizer.")}

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    meta.update(
        {
            "general.architecture": "llama",
            "general.name": model_dir.name,
            "llama.block_count": u32(config["num_hidden_layers"]),
            "llama.context_length": u32(config["max_position_embeddings"]),
            "llama.embedding_length": u32(config["hidden_size"]),
            "llama.feed_forward_length": u32(config["intermediate_size"]),
            "llama.attention.head_count": u32(config["num_attention_heads"]),
            "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
            "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
            "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
            "llama.rope.dimension_count": u32(config["head_dim"]),
            "llama.vocab_size": u32(config["vocab_size"]),
        }
    )
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_gguf(str(gguf_path), tensors, meta)
    return gguf_path


def quantized_copy(src: Path, dst: Path, *, bits: int, group_size: int) -> Path:
    """The model folder `src` quantized to MLX affine `bits`-bit the way `mlx_lm.convert -q` does it
    (scales and biases in the model's dtype), written to `dst` (created) with `src`'s tokenizer."""
    from mlx_lm.utils import load, quantize_model

    loaded: Any = load(str(src), return_config=True)
    model, _tokenizer, config = loaded
    model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    return write_model_folder(dst, dict(tree_flatten(model.parameters())), config, tokenizer_from=src)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The float32 dense twin of the quantized folder `src`: w = q * scale + bias, written out in
    numpy (independently of `mx.dequantize`), every other parameter upcast to float32."""
    import numpy as np

    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    bits, group = int(config["quantization"]["bits"]), int(config["quantization"]["group_size"])
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    dense: dict[str, mx.array] = {}
    for name, value in weights.items():
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")):
            continue
        if value.dtype == mx.uint32 and f"{base}.scales" in weights:
            words = np.asarray(value)
            q = np.stack([(words >> (bits * i)) & (2**bits - 1) for i in range(32 // bits)], axis=-1)
            q = q.reshape(words.shape[0], -1).astype(np.float32)
            scales = np.asarray(weights[f"{base}.scales"].astype(mx.float32))
            biases = np.asarray(weights[f"{base}.biases"].astype(mx.float32))
            dense[name] = mx.array(q * np.repeat(scales, group, axis=1) + np.repeat(biases, group, axis=1))
        else:
            dense[name] = value.astype(mx.float32)
    plain = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return write_model_folder(dst, dense, plain, tokenizer_from=src)


def write_model_folder(
    dst: Path, weights: dict[str, mx.array], config: dict[str, Any], *, tokenizer_from: Path
) -> Path:
    """An mlx-lm folder: these weights and config.json, and `tokenizer_from`'s tokenizer files."""
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, dst / name)
    return dst


def sharded_copy(src: Path, dst: Path) -> Path:
    """`src` (one `model.safetensors`) rewritten as one shard per layer plus a weight index, as
    large checkpoints come: the embedding in the first shard, the final norm and head in the last."""
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    layers = json.loads((src / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"]
    names = [f"model-{i + 1:05d}-of-{layers:05d}.safetensors" for i in range(layers)]
    groups: dict[str, dict[str, mx.array]] = {name: {} for name in names}
    for tensor, value in weights.items():
        parts = tensor.split(".")
        index = int(parts[2]) if tensor.startswith("model.layers.") else 0 if "embed_tokens" in tensor else -1
        groups[names[index]][tensor] = value
    dst.mkdir(parents=True, exist_ok=True)
    for name, group in groups.items():
        mx.save_safetensors(str(dst / name), group, metadata={"format": "mlx"})
    weight_map = {tensor: name for name, group in groups.items() for tensor in group}
    total = sum(v.nbytes for v in weights.values())
    index_body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index_body, indent=2), encoding="utf-8")
    for path in src.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copyfile(path, dst / path.name)
    return dst
