"""GGUF import: names, config, tokenizer, and the real SmolLM2 (kept 4-bit) answering a question."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from node.models import GGUFImportError, builtin_gguf_path, import_gguf
from node.models.gguf_arch import build_config, hf_tensor_name, unpermute_order
from node.models.gguf_convert import read_gguf
from node.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer
from tests.model_factory import make_random_model, write_llama_gguf

# ---- pure helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight"),
        ("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj.weight"),
        ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
        ("blk.2.ffn_gate.weight", "model.layers.2.mlp.gate_proj.weight"),
        ("blk.2.ffn_up.weight", "model.layers.2.mlp.up_proj.weight"),
        ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight"),
    ],
)
def test_tensor_names(gguf_name: str, hf_name: str) -> None:
    assert hf_tensor_name(gguf_name) == hf_name


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_shexp.weight", "rope_freqs.weight", "blk.x.attn_q.weight"])
def test_unknown_tensor_names_are_refused(name: str) -> None:
    with pytest.raises(GGUFImportError, match="no llama equivalent"):
        hf_tensor_name(name)


def _meta(**overrides: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.embedding_length": 576,
        "llama.block_count": 30,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06,
        "llama.rope.freq_base": 100000.0,
        "llama.rope.dimension_count": 64,
        "llama.context_length": 8192,
        "llama.vocab_size": 49152,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(overrides)
    return meta


def test_llama_config_from_metadata() -> None:
    config = build_config(_meta(), has_output=False)
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert build_config(_meta(), has_output=True)["tie_word_embeddings"] is False
    with_eot = build_config(_meta(**{"tokenizer.ggml.eot_token_id": 7}), has_output=False)
    assert with_eot["eos_token_id"] == [2, 7]
    linear = build_config(
        _meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}), has_output=False
    )
    assert linear["rope_scaling"] == {"type": "linear", "factor": 4.0}


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"llama.block_count": None}, "llama.block_count"),
        ({"llama.rope.dimension_count": 32}, "partial rotary"),
        ({"llama.rope.scaling.type": "yarn"}, "rope scaling 'yarn'"),
        ({"llama.expert_count": 8}, "mixture-of-experts"),
    ],
)
def test_unsupported_llama_metadata_is_refused(overrides: dict[str, Any], fragment: str) -> None:
    meta = {k: v for k, v in _meta(**overrides).items() if v is not None}
    with pytest.raises(GGUFImportError, match=fragment):
        build_config(meta, has_output=False)


# ---- the tokenizer from SmolLM2's GGUF metadata ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_meta() -> dict[str, Any]:
    _tensors, meta = read_gguf(builtin_gguf_path())
    return meta


def test_tokenizer_from_gguf_metadata(smollm2_meta: dict[str, Any]) -> None:
    tok = build_tokenizer(smollm2_meta)
    assert tok.get_vocab_size() == 49152
    ids = tok.encode("Year 2024: 12345 apples").ids
    pieces = [tok.decode([i]) for i in ids]
    assert pieces == ["Year", " ", "2", "0", "2", "4", ":", " ", "1", "2", "3", "4", "5", " apples"]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    text = "Ünïcode ✓ 中文 🙂 and  two  spaces\n\nnew"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.decode([1, 4093, 2]) == "user"  # special tokens are skipped when decoding


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama'"),
        ({"tokenizer.ggml.pre": "chatglm-bpe"}, "pre-tokenizer 'chatglm-bpe'"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
    ],
)
def test_unsupported_tokenizers_are_refused(
    smollm2_meta: dict[str, Any], overrides: dict[str, Any], fragment: str
) -> None:
    meta = {k: v for k, v in {**smollm2_meta, **overrides}.items() if v is not None}
    with pytest.raises(GGUFTokenizerError, match=fragment):
        build_tokenizer(meta)


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "gemma3"})
    with pytest.raises(GGUFImportError, match="architecture 'gemma3'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF but not really")
    with pytest.raises(GGUFImportError, match="cannot read"):
        import_gguf(path, tmp_path / "out")


# ---- a random F32 model through a GGUF and back ------------------------------------------------------


def test_f32_gguf_round_trip_gives_the_same_model(builtin_model_dir: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    original = make_random_model(
        tmp_path / "original", tokenizer_from=builtin_model_dir, num_heads=4, num_kv_heads=2
    )
    gguf = write_llama_gguf(original, tmp_path / "tiny.gguf", tokenizer_gguf=builtin_gguf_path())
    imported = import_gguf(gguf, tmp_path / "imported")

    before = mx.load(str(original / "model.safetensors"))
    after = mx.load(str(imported / "model.safetensors"))
    assert isinstance(before, dict) and isinstance(after, dict)
    assert sorted(before) == sorted(after)
    for name in before:
        assert mx.array_equal(before[name], after[name]).item(), name

    model_a, tok_a = load(str(original))[:2]
    model_b, tok_b = load(str(imported))[:2]
    ids = tok_b.encode("The capital of France is 42")
    assert ids == tok_a.encode("The capital of France is 42")
    tokens = mx.array([ids])
    assert mx.allclose(model_a(tokens), model_b(tokens)).item()


# ---- the real SmolLM2-135M-Instruct ----------------------------------------------------------------------


def test_imported_tensors_are_kept_as_stored(builtin_model_dir: Path) -> None:
    """Q4_1 layers and the Q8_0 embedding stay MLX affine triples, bit for bit what mx.load reads."""
    raw = mx.load(str(builtin_gguf_path()))
    weights = mx.load(str(builtin_model_dir / "model.safetensors"))
    assert isinstance(raw, dict) and isinstance(weights, dict)
    assert "lm_head.weight" not in weights  # tied embeddings

    def same(gguf_name: str, hf_name: str, *, heads: int | None = None) -> bool:
        for part in ("weight", "scales", "biases"):
            stored = raw[f"{gguf_name}.{part}"]
            if heads is not None:  # q and k rows back in Hugging Face order, all three parts alike
                stored = stored[mx.array(unpermute_order(stored.shape[0], heads))]
            imported = weights[f"{hf_name}.{part}"]
            if imported.dtype != stored.dtype or not mx.array_equal(imported, stored).item():
                return False
        return True

    assert same("blk.3.attn_v", "model.layers.3.self_attn.v_proj")
    assert same("token_embd", "model.embed_tokens")
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)  # Q8_0: 8 bits
    assert weights["model.layers.3.self_attn.v_proj.weight"].shape == (192, 576 * 4 // 32)  # Q4_1
    assert same("blk.0.attn_q", "model.layers.0.self_attn.q_proj", heads=9)
    assert same("blk.0.attn_k", "model.layers.0.self_attn.k_proj", heads=3)
    assert not same("blk.0.attn_q", "model.layers.0.self_attn.q_proj")  # the permutation is undone
    norm = weights["model.norm.weight"]
    assert norm.dtype == mx.float32 and mx.array_equal(norm, raw["output_norm.weight"]).item()
    config = json.loads((builtin_model_dir / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }


def test_imported_tokenizer_files(builtin_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builtin_model_dir))
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.encode("2025", add_special_tokens=False) == [34, 32, 34, 37]
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)  # the GGUF says: no BOS
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    config = json.loads((builtin_model_dir / "config.json").read_text())
    assert (config["eos_token_id"], config["vocab_size"], config["tie_word_embeddings"]) == (2, 49152, True)


def test_smollm2_answers_the_capital_of_france(builtin_model_dir: Path) -> None:
    import mlx.nn as nn
    from mlx_lm import generate, load

    model, tokenizer = load(str(builtin_model_dir))[:2]
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer
    assert 2 in tokenizer.eos_token_ids
