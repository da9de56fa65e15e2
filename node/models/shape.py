"""`model_shape`: the bytes each part of a model folder takes, for placement. Reads headers only.

The weights' sizes come from the safetensors headers (an 8-byte little-endian length, then that
much JSON naming each tensor's dtype, shape and byte range); no tensor is read. Each tensor goes to:

    model.layers.N.*                        layer N (also `model.h.N`, `transformer.h.N`,
                                            `backbone.layers.N`, `model.layers.layers.N` ...)
    model.embed_tokens.*                    the embedding (also `tok_embeddings`, `word_embeddings`,
                                            `embeddings`, `embed_in`, `wte`, position `wpe`)
    model.norm.*, lm_head.*, output.*       the head (with any other module of `model.`,
                                            `backbone.`, `transformer.`: final_layernorm,
                                            lfm2's embedding_norm, gpt_neox's embed_out ...)

(a `language_model.` prefix, as vision-language checkpoints have, is ignored). Layers numbered past
`num_hidden_layers` (e.g. a multi-token-prediction layer) are not loaded by mlx-lm and not counted.
Any other tensor (a vision tower ...) is an error: the model cannot be split by layers if we do not
know where it goes.

Bytes at run time can differ from bytes on disk (see `node.cpu.dtype`): on the CPU the runner
keeps affine 4/8-bit layers and 16-bit matrices as stored on its kernels (`kernels=True`) and
runs everything else in float32 (everything, without the kernels). `runtime_dtype_bytes=4` counts
that: a float tensor at 4 bytes per element, an mlx-quantized weight (a uint32 `weight` packing
32/bits values per word, with sibling `scales` and `biases`) at its dense size,
`packed elements x 32 / bits` at 4 bytes, its scales and biases then gone. `bits` comes from the
config's `quantization` (a per-module entry first, then the default).

A family whose layers need more than the hidden state at a cut (`UNSPLITTABLE`) gets its reason
in `ModelShape.unsplittable`: placement then puts it on one node, and refuses more.

The KV cache per token per layer is 2 (keys and values) x kv heads x head dim x the activations'
dtype bytes (`runtime_dtype_bytes`, else the config's `torch_dtype`, else the weights' dominant
float dtype); on the kernels, `KERNEL_KV_BYTES` (`node.cpu.kv_cache` keeps the caches float16).
Every layer is assumed to keep a full cache: an overestimate for sliding-window and recurrent
layers. A model without attention (`num_attention_heads` absent: mamba) keeps none.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from protocol.ids import ModelId
from protocol.placement import ModelShape
from protocol.tensor_split import tensor_limit

MAX_HEADER_BYTES = 100 * 1024**2
"""A safetensors header larger than this is refused (the safetensors library's own limit)."""
DEFAULT_CONTEXT_LENGTH = 4096
"""Tokens reserved when neither the caller nor `max_position_embeddings` says."""

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
"""Bytes per element of each safetensors dtype."""
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
HALF_DTYPES = frozenset({"F16", "BF16"})
KERNEL_BITS = frozenset({4, 8})
"""What the CPU kernels keep as stored (node.cpu.kernel_layers): 16-bit matrices, affine 4/8-bit
and MXFP4 layers (experts too); other modes (nvfp4 ...) are dequantized to float32 at load, and
counted so."""
KERNEL_KV_BYTES = 2
"""A KV-cache element on the kernels: float16 (`node.cpu.kv_cache`; its float32 setting is for
comparisons, and placement does not follow it)."""
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

_PER_LAYER_INPUTS = "its layers take per-layer inputs computed from the token ids"
_GEMMA4 = f"{_PER_LAYER_INPUTS} and share key/value states across layers"
UNSPLITTABLE = {
    "gemma3n": _PER_LAYER_INPUTS,
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    "hunyuan": "its layers hand key/value states on to the next layer (cross-layer attention)",
    "rwkv7": "its layers hand the first layer's value state on to every later layer",
    "kimi_k3": "its layers hand block-attention residuals on along with the hidden state",
    "muse_spark": "each layer hands the next its normalized attention input",
    "bailing_moe_linear": "its linear-attention layers take their position from an attention layer's cache",
    "talkie": "its layers take the token embedding as an input besides the hidden state",
    "deepseek_v41": "its layers pass several residual streams (hyper-connections), not one hidden state",
    "iquestloopcoder": "it runs its layers twice over (a loop), calling their parts itself",
}
"""mlx-lm model types a pipeline stage cannot run (`node.pipeline.generic`), with why: their layers
need more than the hidden state at a cut. mlx-lm 0.32.2; each checked by splitting a tiny random
model in process, except kimi_k3 and muse_spark (read in the source: their loops unpack a pair)."""

_LAYER = re.compile(r"(?:model|backbone|transformer)\.(?:layers\.)?(?:layers|h|blocks)\.(\d+)\.")
_DECODER = ("model.", "backbone.", "transformer.")
_EMBEDDINGS = frozenset(
    {"embed_tokens", "tok_embeddings", "word_embeddings", "embeddings", "embed_in", "wte", "wpe"}
)
_HEAD = ("lm_head.", "output.")
_EXPERTS = re.compile(r"\.(?:switch_mlp|experts)\.")
"""The stacked experts of a mixture-of-experts layer (mlx-lm's SwitchGLU), experts first."""


class ModelShapeError(ValueError):
    """A model folder whose size cannot be worked out; the message names the file or tensor."""


def model_shape(
    model_id: str,
    folder: Path,
    context_length: int | None = None,
    *,
    runtime_dtype_bytes: int | None = None,
    kernels: bool = False,
) -> ModelShape:
    """The `ModelShape` of the mlx-lm model folder `folder` (config.json + *.safetensors).

    `context_length` defaults to the config's `max_position_embeddings`. `runtime_dtype_bytes`
    (e.g. 4 for float32 on the CPU) counts weights and KV cache at that size; None counts them as
    stored. `kernels` (with `runtime_dtype_bytes`): the runner's CPU kernels keep affine 4/8-bit
    layers and 2-D 16-bit weights as stored (`node.cpu.dtype`), so those count as stored and
    only the rest at `runtime_dtype_bytes`. Raises `ModelShapeError` for a missing or malformed
    config or header, a tensor that is not a layer, embedding or head, or a layer without tensors.
    """
    config = _read_config(folder)
    num_layers = _config_int(config, "num_hidden_layers")
    tensors = _read_headers(folder)
    bits = _quantization_bits(config)
    layers = [0] * num_layers
    embedding = head = unread = 0
    experts, routed = _experts(config)
    seen_layers: set[int] = set()
    for name, info in tensors.items():
        size = _runtime_bytes(name, info, tensors, bits, runtime_dtype_bytes, kernels)
        local = name.removeprefix("language_model.")
        if match := _LAYER.match(local):
            index = int(match.group(1))
            if index < num_layers:
                layers[index] += size
                seen_layers.add(index)
                if experts and _EXPERTS.search(local) and int(info["shape"][0]) == experts:
                    unread += size - size * routed // experts
        elif _is_embedding(local):
            embedding += size
        elif local.startswith(_HEAD + _DECODER):
            head += size
        else:
            raise ModelShapeError(
                f"{folder}: tensor {name!r} is not in a layer, the embedding or the head; "
                "this model cannot be split by layers"
            )
    if missing := sorted(set(range(num_layers)) - seen_layers):
        raise ModelShapeError(f"{folder}: no tensors for layer(s) {missing[:8]} of {num_layers}")
    has_lm_head = any(n.removeprefix("language_model.").startswith(_HEAD) for n in tensors)
    tied = config.get("tie_word_embeddings")
    if context_length is None:
        context_length = int(config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH)
    tensor = tensor_limit(config)
    tied_head = tied if isinstance(tied, bool) else not has_lm_head
    token_bytes = sum(layers) - unread + (embedding if tied_head else head) if unread else 0
    return ModelShape(
        model=ModelId(model_id),
        layer_bytes=tuple(layers),
        embedding_bytes=embedding,
        head_bytes=head,
        tied_embeddings=tied_head,
        kv_bytes_per_token=_kv_bytes_per_token(
            config, tensors, KERNEL_KV_BYTES if kernels and runtime_dtype_bytes else runtime_dtype_bytes
        ),
        context_length=context_length,
        unsplittable=UNSPLITTABLE.get(str(config.get("model_type")), ""),
        tensor_ranks=tensor[0],
        tensor_unsplittable=tensor[1],
        token_bytes=token_bytes,
    )


def _experts(config: dict[str, Any]) -> tuple[int, int]:
    """(experts per layer, experts a token is routed to) of a mixture of experts; (0, 0) otherwise."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    routed = config.get("num_experts_per_tok") or config.get("experts_per_token") or 0
    if type(experts) is not int or type(routed) is not int or not 0 < routed < experts:
        return 0, 0
    return experts, routed


def _is_embedding(name: str) -> bool:
    """A tensor of the token (or position) embedding, which the first stage holds."""
    return name.startswith(_DECODER) and name.split(".")[1] in _EMBEDDINGS


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a .safetensors file holds: name -> {"dtype", "shape", "data_offsets"}."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ModelShapeError(f"{path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES:
                raise ModelShapeError(f"{path}: header of {length} bytes exceeds {MAX_HEADER_BYTES}")
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise ModelShapeError(f"{path}: {exc}") from exc
    except ValueError as exc:  # a bad UTF-8 or JSON header
        raise ModelShapeError(f"{path}: malformed safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelShapeError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        try:
            start, end = info["data_offsets"]
            ok = info["dtype"] in DTYPE_BYTES and 0 <= start <= end and isinstance(info["shape"], list)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ModelShapeError(f"{path}: malformed entry for tensor {name!r}")
    return header


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelShapeError(f"{folder}: cannot read config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelShapeError(f"{folder}: config.json is not a JSON object")
    if isinstance(text := config.get("text_config"), dict):
        config = {**config, **text}  # a vision-language model: the language model's sizes
    return config


def _config_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if type(value) is not int or value < 1:
        raise ModelShapeError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def _read_headers(folder: Path) -> dict[str, dict[str, Any]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelShapeError(f"{folder}: no *.safetensors files")
    tensors: dict[str, dict[str, Any]] = {}
    for path in files:
        tensors.update(read_safetensors_header(path))
    return tensors


def _quantization_bits(config: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Bits and mode (`affine`, `mxfp4`, ...) per quantized module: "" is the default, other keys
    are module paths."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict):
        return {}

    def spec(entry: dict[str, Any], default_mode: str) -> tuple[int, str]:
        return entry["bits"], str(entry.get("mode", default_mode))

    default_mode = str(quant.get("mode", "affine"))
    bits = {
        k: spec(v, default_mode)
        for k, v in quant.items()
        if isinstance(v, dict) and isinstance(v.get("bits"), int)
    }
    if isinstance(quant.get("bits"), int):
        bits[""] = spec(quant, "affine")
    return bits


def _elements(info: dict[str, Any]) -> int:
    count = 1
    for dim in info["shape"]:
        count *= int(dim)
    return count


def _runtime_bytes(
    name: str,
    info: dict[str, Any],
    tensors: dict[str, dict[str, Any]],
    bits: dict[str, tuple[int, str]],
    runtime_dtype_bytes: int | None,
    kernels: bool,
) -> int:
    stored = int(info["data_offsets"][1] - info["data_offsets"][0])
    if runtime_dtype_bytes is None:
        return stored
    module, _, kind = name.rpartition(".")
    quantized = f"{module}.scales" in tensors and kind in ("weight", "scales", "biases")
    if not quantized:
        if kernels and info["dtype"] in HALF_DTYPES and len(info["shape"]) == 2:
            return stored
        return _elements(info) * runtime_dtype_bytes if info["dtype"] in FLOAT_DTYPES else stored
    module_spec = bits.get(module, bits.get(""))
    if module_spec is None:
        raise ModelShapeError(f"tensor {name!r} is quantized but config.json gives no quantization bits")
    module_bits, mode = module_spec
    on_kernels = (module_bits in KERNEL_BITS and mode == "affine") or (module_bits == 4 and mode == "mxfp4")
    if kernels and on_kernels:
        return stored
    if kind != "weight":
        return 0  # folded into the dense weight
    packed_bits = _elements(info) * DTYPE_BYTES[info["dtype"]] * 8
    return packed_bits // module_bits * runtime_dtype_bytes


def _kv_bytes_per_token(
    config: dict[str, Any], tensors: dict[str, dict[str, Any]], runtime_dtype_bytes: int | None
) -> int:
    if config.get("num_attention_heads") is None:
        return 0  # no attention: a recurrent state that does not grow with the context
    heads = _config_int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or _config_int(config, "hidden_size") // heads
    return 2 * int(kv_heads) * int(head_dim) * _activation_bytes(config, tensors, runtime_dtype_bytes)


def _activation_bytes(
    config: dict[str, Any], tensors: dict[str, dict[str, Any]], runtime_dtype_bytes: int | None
) -> int:
    if runtime_dtype_bytes is not None:
        return runtime_dtype_bytes
    declared = config.get("torch_dtype") or config.get("dtype")
    if isinstance(declared, str) and declared in TORCH_DTYPE_BYTES:
        return TORCH_DTYPE_BYTES[declared]
    floats: Counter[str] = Counter()
    for info in tensors.values():
        if info["dtype"] in FLOAT_DTYPES:
            floats[info["dtype"]] += int(info["data_offsets"][1] - info["data_offsets"][0])
    return DTYPE_BYTES[floats.most_common(1)[0][0]] if floats else 2
