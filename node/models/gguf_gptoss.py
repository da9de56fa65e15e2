"""GGUF `gpt-oss` in mlx-lm `gpt_oss` terms: tensor names, the tensor set, config.json fields.

llama.cpp's converter stores gpt-oss with its experts split (HF's interleaved `gate_up_proj` is
already `ffn_gate_exps` / `ffn_up_exps`, as mlx-lm's `sanitize` makes them), biases on attention,
router and experts, a per-head `attn_sinks` vector, and the pre-MLP norm as `post_attention_norm`.
Its graph routes as mlx-lm's does (top-k of the router logits, softmax over those k), uses the same
clamped SwiGLU (alpha 1.702, limit 7) and sinks, and alternates sliding-window and full attention
starting with a sliding layer (mlx-lm's `layer_types` default). Rope scaling is yarn: llama.cpp's
`ggml_rope_yarn_corr_dims` and mlx-lm's YarnRoPE both floor/ceil the correction range, clamp it to
[0, dims - 1] and ramp linearly between it, and scale q and k by 1 + 0.1 ln(factor) (llama.cpp:
with `attn_factor` 1). Real gpt-oss GGUFs name the `gpt-4o` pre-tokenizer (o200k's split,
`gguf_tokenizer`). Pure functions of metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from node.models.json_child import GGUFImportError

GPT_OSS = "gpt-oss"
LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
"""gpt-oss's own GGUF part -> mlx-lm names (the attention's are the common ones)."""
BARE_PARAMETERS = frozenset({"attn_sinks"})
"""Parts that are a plain array of the module above (`self_attn.sinks`), not a `.weight`."""
LAYER_TENSORS = (
    *("attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight"),
    *(
        f"{part}.{kind}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_output")
        for kind in ("weight", "bias")
    ),
    *(
        f"{part}.{kind}"
        for part in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        for kind in ("weight", "bias")
    ),
)
"""Every layer's tensors; the output head is never tied (mlx-lm's gpt_oss always has `lm_head`)."""
YARN_DEFAULTS = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
"""llama.cpp's yarn correction betas when the file names none (as HF's and mlx-lm's defaults)."""
YARN_NEUTRAL: dict[str, tuple[float, ...]] = {
    "yarn_log_multiplier": (0.0,),
    "yarn_ext_factor": (-1.0, 1.0),
    "yarn_attn_factor": (1.0,),
}
"""llama.cpp yarn settings mlx-lm's YarnRoPE has no counterpart for, and their values that change
nothing (ext_factor -1: llama.cpp's "1 for yarn"); a file with other values is refused."""


def gptoss_config(meta: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """mlx-lm gpt_oss's fields beyond the common ones. Raises `GGUFImportError`."""

    def need(key: str) -> int:
        if not (value := int(meta.get(f"{GPT_OSS}.{key}") or 0)):
            raise GGUFImportError(f"the GGUF metadata has no '{GPT_OSS}.{key}'")
        return value

    experts, used = need("expert_count"), need("expert_used_count")
    if used > experts:
        raise GGUFImportError(f"{used} experts per token of {experts}")
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "intermediate_size": need("expert_feed_forward_length"),  # gpt_oss: each expert's width
        "sliding_window": need("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }


def yarn_scaling(meta: Mapping[str, Any]) -> dict[str, Any]:
    """HF/mlx-lm yarn `rope_scaling` for a gpt-oss GGUF's `rope.scaling.*`. Raises `GGUFImportError`."""
    prefix = f"{GPT_OSS}.rope.scaling."
    if odd := [
        k for k, ok in YARN_NEUTRAL.items() if prefix + k in meta and float(meta[prefix + k]) not in ok
    ]:
        raise GGUFImportError(f"yarn settings {odd} are not supported")
    for key in ("factor", "original_context_length"):
        if not meta.get(prefix + key):
            raise GGUFImportError(f"yarn rope scaling without '{prefix}{key}'")
    return {
        "rope_type": "yarn",
        "factor": float(meta[prefix + "factor"]),
        "original_max_position_embeddings": int(meta[prefix + "original_context_length"]),
        "beta_fast": float(meta.get(prefix + "yarn_beta_fast") or YARN_DEFAULTS["yarn_beta_fast"]),
        "beta_slow": float(meta.get(prefix + "yarn_beta_slow") or YARN_DEFAULTS["yarn_beta_slow"]),
    }
