"""Random-weight models of the mlx-lm families a pipeline stage runs by their own forward.

    make_family_model(tmp_path / "g", "gemma3_text", tokenizer_from=builtin_model_dir)

Tiny (hidden 64, 6 layers, float32) so that each loads in well under a second; windows of 4
tokens, so that sliding-window masks differ from full ones on a chat prompt.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from tests.model_factory import _random_parameters, _special_ids, tokenizer_vocab_size, write_model_folder

Family = Literal["gemma3_text", "phi3", "qwen3_moe", "gpt_oss"]

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
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = _random_parameters(dict(tree_flatten(model.parameters())), seed, mx.float32)
    model.update(tree_unflatten(list(weights.items())))
    if tied:
        weights.pop("lm_head.weight")
    return write_model_folder(Path(out_dir), weights, config, tokenizer_from=tokenizer_from)
