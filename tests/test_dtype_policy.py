"""The load-time weight policy: weights stay as stored on the kernels, else become float32."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from node.cpu import kernel_layers
from node.cpu.dtype import apply_dtype_policy
from node.native import KernelLoad, load_kernels
from node.runner.engine import load_model
from tests.decode_agreement import assert_same_text, greedy_tokens
from tests.kernel_error import int8_rows
from tests.model_factory import dequantized_copy, make_random_model, quantized_copy, write_model_folder

NO_KERNELS = KernelLoad(None, "kernels left out by the test")
needs_kernels = pytest.mark.skipif(
    load_kernels().module is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)


def _params(model: Any) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def _float32_model(model_dir: Path) -> Any:
    loaded = load_model(model_dir, vocab_dir=None)
    assert {v.dtype for _, v in _params(loaded.model)} == {mx.float32}
    return loaded


def _float32_tokens(model_dir: Path, prompt: list[int]) -> list[int]:
    loaded = _float32_model(model_dir)
    return greedy_tokens(loaded.model, loaded.tokenizer, prompt)


@pytest.fixture(scope="module")
def bf16_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("models") / "bf16", tokenizer_from=builtin_model_dir, dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def float32_twin(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16 model's weights upcast to float32 (a 16-bit "quantization" is just the dtype)."""
    weights = mx.load(str(bf16_model / "model.safetensors"))
    assert isinstance(weights, dict)
    config = json.loads((bf16_model / "config.json").read_text())
    f32 = {k: v.astype(mx.float32) for k, v in weights.items()}
    return write_model_folder(
        tmp_path_factory.mktemp("models") / "f32", f32, config, tokenizer_from=bf16_model
    )


@needs_kernels
def test_bf16_model_stays_bf16_on_the_kernels(bf16_model: Path, float32_twin: Path, caplog: Any) -> None:
    prompt = list(range(200, 232))
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        loaded = load_model(bf16_model, vocab_dir=None)
    assert caplog.messages[-1].startswith("weights: bfloat16 kept as stored in ")
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, kernel_layers.KernelDenseLinear)]
    assert layers and all(m.weight.dtype == mx.bfloat16 for m in layers)
    norms = [v for k, v in _params(loaded.model) if k.endswith("norm.weight")]
    assert norms and all(v.dtype == mx.float32 for v in norms)  # small parameters: the activations' dtype
    assert greedy_tokens(loaded.model, loaded.tokenizer, prompt) == _float32_tokens(float32_twin, prompt)


@needs_kernels
def test_quantized_model_stays_quantized_and_matches_its_float32_weights(
    bf16_model: Path, tmp_path: Path, caplog: Any
) -> None:
    for bits, group in ((4, 32), (8, 64)):
        quantized = quantized_copy(bf16_model, tmp_path / f"q{bits}", bits=bits, group_size=group)
        weights = mx.load(str(quantized / "model.safetensors"))
        assert isinstance(weights, dict)
        ahead = dequantized_copy(quantized, tmp_path / f"f32-{bits}")
        with caplog.at_level(logging.INFO, logger="shoal.runner"):
            loaded = load_model(quantized, vocab_dir=None)
        assert f"weights: {bits}-bit affine + bfloat16 kept as stored" in caplog.messages[-1]
        modules = dict(loaded.model.named_modules())
        up = modules["model.layers.0.mlp.up_proj"]
        assert isinstance(up, kernel_layers.KernelQuantizedLinear) and up.weight.dtype == mx.uint32
        assert isinstance(modules["model.embed_tokens"], kernel_layers.KernelQuantizedEmbedding)
        stored = sum(v.nbytes for v in weights.values())
        held = sum(v.nbytes for _, v in _params(loaded.model))
        assert held < 1.1 * stored, (held, stored)  # as stored, not float32 (which would be ~4-8x)
        assert loaded.stepwise_replay == int8_rows(bits)  # a dense model: int8 only if asked for
        prompt = list(range(300, 340))
        reference = _float32_model(ahead)
        assert_same_text(loaded.model, loaded.tokenizer, reference.model, reference.tokenizer, prompt)


def test_without_kernels_bf16_and_quantized_become_float32(bf16_model: Path, tmp_path: Path) -> None:
    from mlx_lm.utils import load

    for path in (bf16_model, quantized_copy(bf16_model, tmp_path / "q4", bits=4, group_size=32)):
        model = load(str(path), lazy=True)[0]
        decision = apply_dtype_policy(model, kernels=NO_KERNELS)
        assert decision.converted and not decision.kernels
        assert "(kernels left out by the test;" in decision.message
        assert {v.dtype for _, v in _params(model)} == {mx.float32}
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


def test_dtype_kept_as_stored_without_memory_or_on_a_gpu(bf16_model: Path) -> None:
    from mlx_lm.utils import load

    model = load(str(bf16_model), lazy=True)[0]
    decision = apply_dtype_policy(model, available=10_000_000, kernels=NO_KERNELS)  # 10 MB free
    assert not decision.converted and decision.stored == "bfloat16"
    assert "NOT converted to float32" in decision.message and "only 0.0 GB available" in decision.message
    assert {v.dtype for _, v in _params(model)} == {mx.bfloat16}

    model = load(str(bf16_model), lazy=True)[0]
    decision = apply_dtype_policy(model, device=mx.Device(mx.gpu))
    assert not decision.converted
    assert decision.message == "weights: bfloat16 as stored (on the GPU the stored dtype is fastest)"
