"""GGUF architectures in mlx-lm terms: config.json per arch, tensor sets, q/k order, llama3 rope."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from node.models.gguf_arch import (
    GGUFImportError,
    build_config,
    check_tensor_names,
    expected_tensors,
    fit_llama3_rope,
    hf_tensor_name,
    is_quantizable,
    permute_order,
    unpermute_order,
    weight_rank,
)
from tests.model_factory import llama_cpp_permute


def _meta(arch: str, **overrides: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 1024,
        f"{arch}.block_count": 28,
        f"{arch}.feed_forward_length": 3072,
        f"{arch}.attention.head_count": 16,
        f"{arch}.attention.head_count_kv": 8,
        f"{arch}.attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.context_length": 40960,
        "tokenizer.ggml.tokens": ["a"] * 151936,
        "tokenizer.ggml.eos_token_id": 151645,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_qwen3_config_takes_head_dim_from_key_length() -> None:
    config = build_config(_meta("qwen3", **{"qwen3.attention.key_length": 128}), has_output=False)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["head_dim"], config["num_attention_heads"], config["hidden_size"]) == (128, 16, 1024)
    assert (config["rms_norm_eps"], config["rope_theta"], config["vocab_size"]) == (1e-06, 1000000.0, 151936)
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 151645


def test_qwen2_config_and_its_head_dim_limit() -> None:
    config = build_config(_meta("qwen2"), has_output=True)
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == ("qwen2", 64, False)
    with pytest.raises(GGUFImportError, match="head_dim 128"):
        build_config(_meta("qwen2", **{"qwen2.attention.key_length": 128}), has_output=True)


def test_qwen3moe_config_has_qwen3_moe_expert_fields() -> None:
    experts = {"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8}
    meta = _meta("qwen3moe", **experts, **{"qwen3moe.expert_feed_forward_length": 768})
    config = build_config(meta, has_output=True)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (
        128,
        8,
        768,
    )
    assert (config["decoder_sparse_step"], config["mlp_only_layers"], config["norm_topk_prob"]) == (
        1,
        [],
        True,
    )
    assert config["intermediate_size"] == 3072  # the file's feed_forward_length (used by no layer)
    del meta["qwen3moe.feed_forward_length"]
    assert build_config(meta, has_output=True)["intermediate_size"] == 768
    for key, value in [("expert_used_count", None), ("expert_used_count", 129), ("expert_shared_count", 1)]:
        broken = _meta(
            "qwen3moe", **{**experts, "qwen3moe.expert_feed_forward_length": 768, f"qwen3moe.{key}": value}
        )
        with pytest.raises(GGUFImportError, match="expert"):
            build_config(broken, has_output=True)


def test_gpt_oss_config_tensors_and_yarn() -> None:
    keys = {"expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 2880}
    yarn = {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
    }
    meta = _meta(
        "gpt-oss", **{f"gpt-oss.{k}": v for k, v in {**keys, **yarn, "attention.sliding_window": 128}.items()}
    )
    config = build_config(meta, has_output=True)
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == (
        "gpt_oss",
        32,
        4,
    )
    assert (config["intermediate_size"], config["sliding_window"]) == (2880, 128)  # the experts' width
    assert config["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    for key, value in [("rope.scaling.yarn_attn_factor", 0.5), ("attention.sliding_window", None)]:
        with pytest.raises(GGUFImportError, match=r"yarn_attn_factor|sliding_window"):
            build_config({**meta, f"gpt-oss.{key}": value}, has_output=True)
    names = expected_tensors("gpt-oss", 2, has_output=False)  # the head is never tied
    assert {"output.weight", "blk.1.attn_sinks.weight", "blk.0.ffn_down_exps.bias"} <= names
    assert hf_tensor_name("blk.1.attn_sinks.weight", "gpt-oss") == "model.layers.1.self_attn.sinks"
    assert hf_tensor_name("blk.0.ffn_gate_inp.bias", "gpt-oss") == "model.layers.0.mlp.router.bias"
    assert (
        hf_tensor_name("blk.0.ffn_up_exps.weight", "gpt-oss") == "model.layers.0.mlp.experts.up_proj.weight"
    )
    assert weight_rank("model.layers.0.mlp.experts.up_proj.weight") == 3
    with pytest.raises(GGUFImportError, match="no qwen3moe equivalent"):
        hf_tensor_name("blk.1.attn_sinks.weight", "qwen3moe")


@pytest.mark.parametrize(
    ("arch", "overrides", "fragment"),
    [
        ("gemma3", {}, "architecture 'gemma3'"),
        ("qwen3", {"qwen3.expert_count": 128}, "mixture-of-experts"),
        ("qwen2", {"qwen2.rope.scaling.type": "yarn"}, "rope scaling 'yarn'"),
        ("qwen3", {"qwen3.rope.dimension_count": 32}, "partial rotary"),
        ("qwen3", {"qwen3.block_count": None}, "'qwen3.block_count'"),
    ],
)
def test_unsupported_metadata_is_refused(arch: str, overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(GGUFImportError, match=fragment):
        build_config(_meta(arch, **overrides), has_output=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_tensor_sets_per_architecture(arch: str) -> None:
    names = expected_tensors(arch, 2, has_output=True)
    check_tensor_names(names, arch, 2)
    moe = arch == "qwen3moe"
    assert ("blk.1.attn_q.bias" in names) is (arch == "qwen2")
    assert ("blk.0.attn_k_norm.weight" in names) is (arch in ("qwen3", "qwen3moe"))
    assert ("blk.1.ffn_up_exps.weight" in names) is moe and ("blk.1.ffn_up.weight" in names) is not moe
    with pytest.raises(GGUFImportError, match="lacks tensors"):
        check_tensor_names(
            names - {"blk.1.ffn_down_exps.weight" if moe else "blk.1.ffn_down.weight"}, arch, 2
        )
    with pytest.raises(GGUFImportError, match="not part of an mlx-lm"):
        check_tensor_names(names | {"blk.0.attn_output.bias"}, arch, 2)
    with pytest.raises(GGUFImportError, match="not part of an mlx-lm"):  # the other kind of ffn
        check_tensor_names(
            names | {"blk.0.ffn_gate.weight" if moe else "blk.0.ffn_gate_exps.weight"}, arch, 2
        )
    with pytest.raises(GGUFImportError, match=r"no .* equivalent"):  # shared experts: not in qwen3_moe
        check_tensor_names(names | {"blk.0.ffn_gate_shexp.weight"}, arch, 2)
    check_tensor_names(names - {"output.weight"}, arch, 2)  # tied: fine too


def test_only_linear_and_embedding_weights_are_quantizable() -> None:
    assert is_quantizable("model.layers.0.self_attn.q_proj.weight")
    assert is_quantizable("model.embed_tokens.weight") and is_quantizable("lm_head.weight")
    assert not is_quantizable("model.layers.0.self_attn.q_proj.bias")
    assert not is_quantizable("model.layers.0.self_attn.q_norm.weight")
    assert not is_quantizable("model.norm.weight")
    assert is_quantizable("model.layers.0.mlp.gate.weight")  # a MoE router is a Linear
    assert is_quantizable("model.layers.0.mlp.switch_mlp.down_proj.weight")
    assert weight_rank("model.layers.0.mlp.switch_mlp.down_proj.weight") == 3
    assert weight_rank("model.layers.0.mlp.down_proj.weight") == 2


@pytest.mark.parametrize(("n_heads", "head_dim"), [(9, 64), (3, 64), (4, 16), (1, 2)])
def test_row_orders_match_llama_cpp_permute(n_heads: int, head_dim: int) -> None:
    hf = mx.arange(n_heads * head_dim * 3).reshape(n_heads * head_dim, 3)
    gguf = llama_cpp_permute(hf, n_heads)
    rows = n_heads * head_dim
    assert mx.array_equal(hf[mx.array(permute_order(rows, n_heads))], gguf).item()
    assert mx.array_equal(gguf[mx.array(unpermute_order(rows, n_heads))], hf).item()


# ---- llama3 rope scaling ---------------------------------------------------------------------------


def llama_cpp_rope_factors(
    *, factor: float, low: float, high: float, old: int, head_dim: int, base: float
) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, as written there (float32 out)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def mlx_lm_factors(scaling: dict[str, Any], *, head_dim: int, base: float) -> np.ndarray[Any, Any]:
    """What mlx-lm's own Llama3RoPE makes of `scaling`, as factors on the plain rope periods."""
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(head_dim, base, False, scaling_config=scaling, max_position_embeddings=131072)
    periods = base ** (np.arange(0, head_dim, 2) / head_dim)
    return np.array(rope._freqs) / periods


@pytest.mark.parametrize(
    ("factor", "low", "high", "old", "head_dim", "meta"),
    [
        (8.0, 1.0, 4.0, 8192, 128, {}),  # Llama 3.1
        (32.0, 1.0, 4.0, 8192, 64, {"llama.rope.scaling.factor": 32.0}),  # Llama 3.2 1B
        (16.0, 2.0, 8.0, 4096, 128, {"llama.rope.scaling.original_context_length": 4096}),  # solved
        (8.0, 1.5, 6.0, 8192, 128, {}),  # solved, no metadata at all
    ],
)
def test_llama3_rope_is_fitted_so_mlx_lm_reproduces_the_factors(
    factor: float, low: float, high: float, old: int, head_dim: int, meta: dict[str, Any]
) -> None:
    base = 500000.0
    target = llama_cpp_rope_factors(factor=factor, low=low, high=high, old=old, head_dim=head_dim, base=base)
    scaling = fit_llama3_rope(target, head_dim=head_dim, base=base, meta=meta)
    assert scaling is not None and scaling["rope_type"] == "llama3"
    assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (factor, old)
    assert scaling["low_freq_factor"] == pytest.approx(low, rel=1e-4)
    assert scaling["high_freq_factor"] == pytest.approx(high, rel=1e-4)
    np.testing.assert_allclose(mlx_lm_factors(scaling, head_dim=head_dim, base=base), target, rtol=1e-5)


def test_rope_factors_that_fit_nothing_are_refused() -> None:
    assert fit_llama3_rope(np.ones(32, np.float32), head_dim=64, base=1e4, meta={}) is None
    noisy = np.random.default_rng(0).uniform(1, 8, 32).astype(np.float32)
    with pytest.raises(GGUFImportError, match="match no llama3"):
        fit_llama3_rope(noisy, head_dim=64, base=1e4, meta={})
    with pytest.raises(GGUFImportError, match="does not fit head_dim"):
        fit_llama3_rope(np.ones(16, np.float32), head_dim=64, base=1e4, meta={})


def test_rope_freqs_go_into_the_llama_config_only() -> None:
    target = llama_cpp_rope_factors(factor=8.0, low=1.0, high=4.0, old=8192, head_dim=64, base=500000.0)
    meta = _meta("llama", **{"llama.rope.freq_base": 500000.0, "llama.embedding_length": 1024})
    config = build_config(meta, has_output=False, rope_freqs=target)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["head_dim"] == 64
    with pytest.raises(GGUFImportError, match="rope_freqs with qwen3"):
        build_config(_meta("qwen3"), has_output=False, rope_freqs=target)
