"""What a GGUF's architecture means in Hugging Face / mlx-lm terms: names, config.json, rope.

Pure functions of plain metadata and tensor names. Supported: `llama` (llama.cpp's converter
interleaves each head's rotary halves in the q and k rows, which `unpermute_order` undoes),
`qwen2` (q/k/v biases), `qwen3` (q/k RMS norms, its own head_dim) and `qwen3moe` (qwen3's
attention; every layer a mixture of experts: router `ffn_gate_inp` -> `mlp.gate`, the
(experts, rows, cols) `ffn_{gate,up,down}_exps` -> mlx-lm's `mlp.switch_mlp.*_proj`, whose
SwitchLinear weights have the same layout; no shared experts) and `gpt-oss` (see `gguf_gptoss`:
its own names, biases, sinks, yarn). No qwen is permuted (llama.cpp's
converter permutes only for its Llama class). Llama 3.x rope scaling arrives as a `rope_freqs`
tensor of per-dimension factors and is turned back into HF's `rope_scaling` (`fit_llama3_rope`).
Anything else (other MoE families, partial rotary, yarn but gpt-oss's, another architecture) raises
`GGUFImportError`: better no model than one that talks nonsense.
"""

from __future__ import annotations

import contextlib
import math
import re
import struct
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from node.models import gguf_gptoss
from node.models.gguf import GGUFImportError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
"""GGUF `general.architecture` -> HF architecture."""
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
"""GGUF architectures whose mlx-lm `model_type` is another word (the others: the same word)."""
MOE_ARCHITECTURES = frozenset({"qwen3moe"})
"""Architectures whose every layer's feed-forward is a mixture of experts (no dense ffn tensors)."""
EXPERT_MODULES = (".switch_mlp.", ".mlp.experts.")
"""Parts of the HF name of an expert weight (qwen3_moe, gpt_oss): (experts, rows, cols), quantized
per row as a 2D one."""
PERMUTED_QK = frozenset({"llama"})
"""Architectures whose q/k rows llama.cpp's converter permuted."""
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192
"""HF's (and llama.cpp's) default `original_max_position_embeddings` for llama3 rope scaling."""
ROPE_FIT_RTOL = 1e-5
"""How closely mlx-lm's Llama3RoPE must reproduce the GGUF's rope factors (float32 is ~6e-8)."""

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_BASE_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
_MOE_FFN = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_EXTRA_LAYER = {
    "llama": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
    "qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight"),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
QUANTIZABLE = frozenset(
    [
        "embed_tokens",
        "lm_head",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate",
        "router",
    ]
)
"""Modules (last name part) that are Linear/Embedding/SwitchLinear in mlx-lm (`gate`, `router`: MoE routers)
and so can hold quantized weights."""


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> HF's: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if match := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        names = _LAYER_NAMES | gguf_gptoss.LAYER_NAMES if arch == gguf_gptoss.GPT_OSS else _LAYER_NAMES
        if part in names:
            bare = part in gguf_gptoss.BARE_PARAMETERS and kind == "weight"
            return f"model.layers.{layer}.{names[part]}" + ("" if bare else f".{kind}")
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise GGUFImportError(f"tensor {gguf_name!r} has no {arch} equivalent (not a plain {arch} model?)")


def expected_tensors(arch: str, n_layers: int, *, has_output: bool) -> set[str]:
    """The GGUF tensor names an `arch` model of `n_layers` has (besides `rope_freqs`)."""
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if has_output else set())
    ffn = _MOE_FFN if arch in MOE_ARCHITECTURES else _DENSE_FFN
    per_layer = [f"{part}.weight" for part in (*_BASE_LAYER, *ffn)] + list(_EXTRA_LAYER.get(arch, ()))
    if arch == gguf_gptoss.GPT_OSS:  # its own set; the head is never tied
        names, per_layer = names | {"output.weight"}, list(gguf_gptoss.LAYER_TENSORS)
    return names | {f"blk.{i}.{part}" for i in range(n_layers) for part in per_layer}


def check_tensor_names(names: Collection[str], arch: str, n_layers: int) -> None:
    """Raise `GGUFImportError` unless `names` are exactly what mlx-lm's `arch` class loads."""
    expected = expected_tensors(arch, n_layers, has_output="output.weight" in names)
    actual = set(names) - {"rope_freqs.weight"}
    if extra := sorted(actual - expected):
        for name in extra:
            hf_tensor_name(name, arch)  # a name with no HF meaning at all gets that message
        raise GGUFImportError(f"tensors {extra[:3]} are not part of an mlx-lm {arch} model")
    if missing := sorted(expected - actual):
        raise GGUFImportError(f"the GGUF lacks tensors an mlx-lm {arch} model needs: {missing[:3]}")


def is_quantizable(hf_name: str) -> bool:
    """Whether `hf_name` is the weight of a Linear/Embedding/SwitchLinear (the only places MLX takes
    packed weights)."""
    base, _, kind = hf_name.rpartition(".")
    return kind == "weight" and base.rpartition(".")[2] in QUANTIZABLE


def weight_rank(hf_name: str) -> int:
    """How many dimensions mlx-lm's weight `hf_name` has when it is a matrix: 3 for experts."""
    return 3 if any(module in hf_name for module in EXPERT_MODULES) else 2


def permute_order(rows: int, n_heads: int) -> npt.NDArray[np.intp]:
    """Row order of llama.cpp's q/k `permute` (HF -> GGUF): `gguf = hf[permute_order(...)]`."""
    return np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).swapaxes(1, 2).reshape(-1)


def unpermute_order(rows: int, n_heads: int) -> npt.NDArray[np.intp]:
    """The inverse: `hf = gguf[unpermute_order(...)]` (per head, rows 0, 2, 4, ... then 1, 3, ...)."""
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)


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


def build_config(
    meta: Mapping[str, Any], *, has_output: bool, rope_freqs: npt.NDArray[np.float32] | None = None
) -> dict[str, Any]:
    """Hugging Face `config.json` for a GGUF's plain metadata. Raises `GGUFImportError`."""
    arch = str(meta.get("general.architecture"))
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"architecture {arch!r} is not supported (only {sorted(ARCHITECTURES)})")

    def need(key: str) -> Any:
        if (full := f"{arch}.{key}") not in meta:
            raise GGUFImportError(f"the GGUF metadata has no {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    moe = arch in MOE_ARCHITECTURES | {gguf_gptoss.GPT_OSS}
    if not moe and meta.get(f"{arch}.expert_count"):
        raise GGUFImportError(f"mixture-of-experts {arch} GGUFs are not supported")
    if arch == "qwen2" and head_dim * n_heads != hidden:
        raise GGUFImportError(f"qwen2 with head_dim {head_dim} != hidden/heads is not supported by mlx-lm")
    ffn_key = "expert_feed_forward_length" if moe else "feed_forward_length"
    vocab_size = meta.get(f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(meta.get("tokenizer.ggml.tokens") or ())
    rope_theta = _float32_decimal(float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length") or need(ffn_key)),
        "rms_norm_eps": _float32_decimal(float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch in MOE_ARCHITECTURES:
        config |= moe_config(meta, arch)
    elif arch == gguf_gptoss.GPT_OSS:
        config |= gguf_gptoss.gptoss_config(meta, config["num_hidden_layers"])
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling == "yarn" and arch == gguf_gptoss.GPT_OSS:
        config["rope_scaling"] = gguf_gptoss.yarn_scaling(meta)
    elif scaling != "none":
        raise GGUFImportError(f"rope scaling {scaling!r} is not supported")
    if rope_freqs is not None:
        if arch != "llama" or scaling != "none":
            raise GGUFImportError(f"rope_freqs with {arch} / {scaling!r} rope scaling is not supported")
        if fitted := fit_llama3_rope(rope_freqs, head_dim=head_dim, base=rope_theta, meta=meta):
            config["rope_scaling"] = fitted
    for field in ("bos_token_id", "eos_token_id"):
        if (token_id := meta.get(f"tokenizer.ggml.{field}")) is not None:
            config[field] = int(token_id)
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]
    return config


def moe_config(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """mlx-lm qwen3_moe's expert fields. llama.cpp's qwen3moe makes every layer sparse, routes by
    softmax over all experts and renormalizes the chosen experts' weights (`norm_w` true), so
    `norm_topk_prob` is true, `decoder_sparse_step` 1 and no layer is dense."""
    counts: dict[str, int] = {}
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        if not (value := int(meta.get(f"{arch}.{key}") or 0)):
            raise GGUFImportError(f"the GGUF metadata has no '{arch}.{key}'")
        counts[key] = value
    if counts["expert_used_count"] > counts["expert_count"]:
        raise GGUFImportError(f"{counts['expert_used_count']} experts per token of {counts['expert_count']}")
    if int(meta.get(f"{arch}.expert_shared_count") or 0):
        raise GGUFImportError(f"shared experts in {arch} are not supported")
    return {
        "num_experts": counts["expert_count"],
        "num_experts_per_tok": counts["expert_used_count"],
        "moe_intermediate_size": counts["expert_feed_forward_length"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def llama3_factors(scaling: Mapping[str, float], *, head_dim: int, base: float) -> npt.NDArray[np.float64]:
    """Per-dimension wavelength factors mlx-lm's Llama3RoPE applies for HF `rope_scaling`."""
    factor, lff, hff = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    out = np.where(wavelen > old / lff, factor, 1.0)
    medium = (wavelen > old / hff) & (wavelen < old / lff)
    smooth = (old / wavelen - lff) / (hff - lff)
    return np.where(medium, 1.0 / ((1 - smooth) / factor + smooth), out)


def fit_llama3_rope(
    rope_freqs: npt.NDArray[np.float32], *, head_dim: int, base: float, meta: Mapping[str, Any]
) -> dict[str, Any] | None:
    """HF llama3 `rope_scaling` that reproduces the GGUF's `rope_freqs` factors; None if all are 1.

    Tries the metadata (`llama.rope.scaling.factor` / `.original_context_length`) with Llama 3's
    low/high frequency factors 1 and 4, then solves those two from the factors that lie between
    1 and `factor` (a line in 1/wavelength). Raises `GGUFImportError` when nothing fits.
    """
    target = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if target.shape != (head_dim // 2,) or not np.isfinite(target).all() or (target <= 0).any():
        raise GGUFImportError(f"rope_freqs of shape {rope_freqs.shape} does not fit head_dim {head_dim}")
    if np.allclose(target, 1.0, rtol=ROPE_FIT_RTOL, atol=0):
        return None
    factor = float(meta.get("llama.rope.scaling.factor") or target.max())
    old = int(meta.get("llama.rope.scaling.original_context_length") or LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
    candidates = [(1.0, 4.0)]
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    medium = (target > 1 + ROPE_FIT_RTOL) & (target < factor * (1 - ROPE_FIT_RTOL))
    if medium.sum() >= 2 and factor > 1:
        smooth = (1 / target[medium] - 1 / factor) / (1 - 1 / factor)  # = a * old/wavelen + b
        a, b = np.polyfit(old / wavelen[medium], smooth, 1)
        if a > 0:
            lff, hff = -b / a, -b / a + 1 / a
            candidates += [(float(f"{lff:.6g}"), float(f"{hff:.6g}")), (float(lff), float(hff))]
    for lff, hff in candidates:
        scaling: dict[str, Any] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": lff,
            "high_freq_factor": hff,
            "original_max_position_embeddings": old,
        }
        if 0 < lff < hff and np.allclose(
            llama3_factors(scaling, head_dim=head_dim, base=base), target, rtol=ROPE_FIT_RTOL, atol=0
        ):
            return scaling
    raise GGUFImportError("rope_freqs factors match no llama3 rope scaling (factor, low/high freq factors)")
