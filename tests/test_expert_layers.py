"""The weight policy keeps affine 4-bit experts as stored on the expert kernels (gather_matmul):
a random qwen3_moe folder gives the greedy text its float32-dequantized route gives."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from node.cpu.dtype import apply_dtype_policy
from node.cpu.expert_layers import KernelSwitchLinear
from node.native import KernelLoad, load_kernels
from node.runner.engine import load_model
from tests.decode_agreement import assert_same_text, greedy_tokens
from tests.kernel_error import int8_rows
from tests.model_factory import (
    _random_parameters,
    _special_ids,
    quantized_copy,
    tokenizer_vocab_size,
    write_model_folder,
)

pytestmark = pytest.mark.skipif(
    load_kernels().module is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)


def _params(model: Any) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def make_qwen3_moe(out_dir: Path, *, tokenizer_from: Path, seed: int = 0) -> Path:
    """A random bfloat16 qwen3_moe folder: 2 layers, 8 experts of width 64, top 2 (wide enough for
    groups of 64)."""
    config: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "vocab_size": tokenizer_vocab_size(tokenizer_from),
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "rope_theta": 1_000_000.0,
        "norm_topk_prob": True,
        **_special_ids(tokenizer_from),
    }
    module = importlib.import_module("mlx_lm.models.qwen3_moe")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = _random_parameters(dict(_params(model)), seed, mx.bfloat16)
    model.update(tree_unflatten(list(weights.items())))
    return write_model_folder(out_dir, weights, config, tokenizer_from=tokenizer_from)


def test_quantized_experts_stay_as_stored_and_give_the_float32_text(
    builtin_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    from mlx_lm.utils import load

    source = make_qwen3_moe(tmp_path / "f32", tokenizer_from=builtin_model_dir)
    quantized = quantized_copy(source, tmp_path / "q4", bits=4, group_size=64)
    weights = mx.load(str(quantized / "model.safetensors"))
    assert isinstance(weights, dict)
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        loaded = load_model(quantized, vocab_dir=None)
    assert "kept as stored" in caplog.messages[-1] and "dequantized" not in caplog.messages[-1]
    assert "2 expert MLPs one operation at decode" in caplog.messages[-1]  # moe_blocks: moe_mlp
    assert "2 decoder layers fused" in caplog.messages[-1]  # fused_layers: head, attention, MoE tail
    modules = dict(loaded.model.named_modules())
    experts = [m for m in modules.values() if isinstance(m, KernelSwitchLinear)]
    assert len(experts) == 2 * 3 and all(m.weight.dtype == mx.uint32 for m in experts)
    assert all(m.scales.dtype == mx.bfloat16 for m in experts)  # not upcast as small parameters are
    stored = sum(v.nbytes for v in weights.values())
    held = sum(v.nbytes for _, v in _params(loaded.model))
    assert held < 1.1 * stored, (held, stored)

    # Without the kernels: every quantized layer, experts included, dequantized to float32.
    reference = load(str(quantized), lazy=True)
    decision = apply_dtype_policy(reference[0], kernels=KernelLoad(None, "kernels left out by the test"))
    assert decision.converted
    for prompt in (list(range(300, 340)), [1000]):  # prefill of 40 tokens (grouped by expert), one token
        want = greedy_tokens(reference[0], reference[1], prompt)
        assert greedy_tokens(loaded.model, loaded.tokenizer, prompt) == want


def test_mxfp4_experts_stay_as_stored_and_give_the_float32_text(
    builtin_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    """Experts MXFP4 and the rest 8-bit, as mlx-community's gpt-oss folders are written."""
    from mlx_lm.utils import load, quantize_model

    source = make_qwen3_moe(tmp_path / "f32", tokenizer_from=builtin_model_dir, seed=1)
    loaded_source: Any = load(str(source), return_config=True)
    model, _, config = loaded_source

    def predicate(path: str, _module: Any) -> bool | dict[str, Any]:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"} if "switch_mlp" in path else True

    model, config = quantize_model(model, config, 64, 8, quant_predicate=predicate)
    folder = write_model_folder(
        tmp_path / "mxfp4", dict(_params(model)), config, tokenizer_from=builtin_model_dir
    )
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        loaded = load_model(folder, vocab_dir=None)
    assert "kept as stored" in caplog.messages[-1] and "dequantized" not in caplog.messages[-1]
    experts = [m for m in dict(loaded.model.named_modules()).values() if isinstance(m, KernelSwitchLinear)]
    assert len(experts) == 2 * 3 and all(m.scales.dtype == mx.uint8 for m in experts)
    stored = mx.load(str(folder / "model.safetensors"))
    assert isinstance(stored, dict)
    held = sum(v.nbytes for _, v in _params(loaded.model))
    assert held < 1.1 * sum(v.nbytes for v in stored.values())

    reference = load(str(folder), lazy=True)
    assert apply_dtype_policy(
        reference[0], kernels=KernelLoad(None, "kernels left out by the test")
    ).converted
    for prompt in (list(range(300, 340)), [1000]):
        want = greedy_tokens(reference[0], reference[1], prompt)
        assert greedy_tokens(loaded.model, loaded.tokenizer, prompt) == want


@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_gpt_oss_mxfp4_experts_and_an_all_mxfp4_llama_give_the_float32_text(
    builtin_model_dir: Path, tmp_path: Path, family: str
) -> None:
    """gpt_oss: MXFP4 experts with their biases, the rest 4-bit affine. llama: every layer MXFP4,
    embedding and head included, through the fused decoder layers."""
    from mlx_lm.utils import load, quantize_model

    from tests.family_models import make_family_model
    from tests.model_factory import make_random_model

    if family == "gpt_oss":
        source = make_family_model(
            tmp_path / "src", "gpt_oss", tokenizer_from=builtin_model_dir, num_layers=2
        )
    else:
        source = make_random_model(tmp_path / "src", tokenizer_from=builtin_model_dir)
    loaded_source: Any = load(str(source), return_config=True)
    model, _, config = loaded_source
    mxfp4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}

    def predicate(path: str, _module: Any) -> bool | dict[str, Any]:
        return mxfp4 if family == "llama" or "experts" in path else True

    model, config = quantize_model(model, config, 32, 4, quant_predicate=predicate)
    folder = write_model_folder(
        tmp_path / "q", dict(_params(model)), config, tokenizer_from=builtin_model_dir
    )
    kept, reference = load(str(folder), lazy=True), load(str(folder), lazy=True)
    decision = apply_dtype_policy(kept[0])
    assert "kept as stored" in decision.message and "dequantized" not in decision.message
    assert ("2 expert MLPs one operation at decode" in decision.message) == (family == "gpt_oss")
    assert apply_dtype_policy(
        reference[0], kernels=KernelLoad(None, "kernels left out by the test")
    ).converted
    for prompt in (list(range(300, 340)), [1000]):
        assert_same_text(kept[0], kept[1], reference[0], reference[1], prompt)


def test_moe_blocks_as_one_operation_give_the_text_and_rows_of_the_switchglu_route(
    builtin_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode through moe_routed (node/cpu/moe_blocks.py) in fused decoder layers against the same
    kernels through mlx-lm's layers and SwitchGLU (SHOAL_FUSED_LAYERS=0): the same text, and
    for a batch of 3 rows (continuous batching) and 9 (the prefill path) the same block outputs within
    the activations' rounding: int16 at prefill (moe_prefill's gemm), where SwitchGLU's groups of up
    to 8 rows take the rows kernel, whose 4-bit activations may be int8 (tests/kernel_error.py)."""
    from mlx_lm.utils import load

    from node.cpu.fused_layers import _FusedBlock
    from node.cpu.moe_blocks import _FusedMoe

    source = make_qwen3_moe(tmp_path / "f32", tokenizer_from=builtin_model_dir, seed=2)
    folder = quantized_copy(source, tmp_path / "q4", bits=4, group_size=64)
    fused = load(str(folder), lazy=True)
    apply_dtype_policy(fused[0])
    monkeypatch.setenv("SHOAL_FUSED_LAYERS", "0")
    plain = load(str(folder), lazy=True)
    apply_dtype_policy(plain[0])
    blocks = [layer.mlp for layer in fused[0].layers]
    assert all(isinstance(b, _FusedMoe) for b in blocks)
    assert all(isinstance(layer, _FusedBlock) for layer in fused[0].layers)
    assert not any(isinstance(layer.mlp, _FusedMoe) for layer in plain[0].layers)
    for prompt in ([1000], list(range(300, 312))):
        assert_same_text(fused[0], fused[1], plain[0], plain[1], prompt)
    for rows in (3, 9):
        x = mx.random.normal((rows, 1, 128))
        got, want = blocks[0](x), plain[0].layers[0].mlp(x)
        assert got.shape == want.shape == (rows, 1, 128)
        # SwitchGLU's int8 steps of max |x| / 254 through the activation: 1.1-1.8% of max |y|
        # measured (int16: 1e-5); a wrong expert, row or activation: ~100%
        tolerance = 4e-2 if rows > 8 and int8_rows(4, experts=True) else 1e-3
        assert mx.all(mx.abs(got - want) < tolerance * mx.abs(want).max()).item()
