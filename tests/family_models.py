"""Random-weight models of the mlx-lm families a pipeline stage runs by their own forward.

    make_family_model(tmp_path / "g", "gemma3_text", tokenizer_from=builtin_model_dir)

Tiny (hidden 64, 6 layers, float32) so that each loads in well under a second; windows of 4
tokens, so that sliding-window masks differ from full ones on a chat prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from tests.model_factory import _special_ids, tokenizer_vocab_size, write_random_model

Family = Literal[
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "gpt_oss",
    "mixtral",
    "deepseek_v3",
    "qwen3_next",
    "lfm2",
    "nanochat",
    "baichuan_m1",
    "gpt_neox",
    "gptj",
]

_SHARED: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
_FAMILY: dict[str, dict[str, Any]] = {
    # Scaled embeddings, (1 + w) norms, a global layer every third, 4-token windows elsewhere.
    "gemma3_text": {"query_pre_attn_scalar": 16, "sliding_window": 4, "sliding_window_pattern": 3},
    # Fused qkv and gate/up projections.
    "phi3": {"rope_theta": 10_000.0},
    # Every layer's MLP is 4 experts, top 2.
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 1_000_000.0,
        "norm_topk_prob": True,
    },
    # Alternating 4-token windows and full attention, attention sinks, 4 experts top 2.
    "gpt_oss": {
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "rope_theta": 150_000,
    },
    # 4 experts, top 2, every layer (mlx-lm's mistral is its llama: no family of its own).
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1_000_000.0},
    # MLA attention (compressed q and kv, decoupled rope dims), a dense first layer, then 4
    # routed experts top 2 in 1 group plus a shared expert, sigmoid gating with a correction bias.
    "deepseek_v3": {
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rope_theta": 10_000.0,
    },
    # Hybrid: gated delta-net layers (conv + recurrent state: ArraysCache) and full attention
    # every third layer; 4 experts top 2 plus a gated shared expert.
    "qwen3_next": {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 3,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10_000.0,
    },
    # Hybrid: short-convolution layers (ArraysCache) and attention; the final norm is `embedding_norm`.
    "lfm2": {
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
    },
    # Layers under `transformer.h`, not `model.layers`.
    "nanochat": {"rope_theta": 10_000.0},
    # Each layer's cache is a `CacheList` (convolution state + full or 4-token window KVCache).
    "baichuan_m1": {
        "sliding_window": 4,
        "sliding_window_layers": [0, 2, 4],
        "conv_window": 2,
        "rope_theta": 10_000.0,
    },
    # The head `embed_out` and `final_layer_norm` sit beside the layers; partial rotary.
    "gpt_neox": {"layer_norm_eps": 1e-5, "rotary_emb_base": 10_000, "rotary_pct": 0.25},
    # Its loop passes the hidden state by name (`block(inputs=h, ...)`).
    "gptj": {"n_embd": 64, "n_head": 4, "n_layer": 6, "rotary_dim": 8, "n_positions": 2048},
}


def make_family_model(
    out_dir: Path,
    family: Family,
    *,
    tokenizer_from: Path,
    num_layers: int = 6,
    seed: int = 0,
    tied: bool = False,
) -> Path:
    """Write a random float32 `family` model folder to `out_dir` and return it (gpt_oss must be
    float32 on the CPU: MLX's `GatherMM` has no other dtype there). `tied`: no `lm_head`, the
    embedding is the head (as gemma3 checkpoints come)."""
    config: dict[str, Any] = {
        "model_type": family,
        "vocab_size": tokenizer_vocab_size(tokenizer_from),
        "num_hidden_layers": num_layers,
        **_SHARED,
        **_FAMILY[family],
        **_special_ids(tokenizer_from),
        "tie_word_embeddings": tied,
    }
    if family == "gpt_oss":
        config["layer_types"] = ["sliding_attention", "full_attention"] * (num_layers // 2)
    if family == "lfm2":
        config["layer_types"] = ["conv", "conv", "full_attention"] * (num_layers // 3)
    return write_random_model(Path(out_dir), config, tokenizer_from=tokenizer_from, seed=seed)
