"""Symmetric quantized layers (GGUF Q4_0, Q8_0) run without their biases array, bit for bit."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as Q

from node.cpu import kernel_layers
from node.models import import_gguf
from node.native import load_kernels
from node.runner.engine import load_model
from tests.test_gguf_import import TinyModel, write_tiny_gguf

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_no_biases_means_minus_half_range_times_scale(bits: int, scale_dtype: mx.Dtype) -> None:
    assert KERNELS is not None
    wq, scales, _ = mx.quantize(mx.random.normal((75, 96)), group_size=32, bits=bits)
    scales = scales.astype(scale_dtype)
    biases = scales * -(2 ** (bits - 1))
    for rows in (1, 3, 8, 64):
        x = mx.random.normal((rows, 96))
        explicit = KERNELS.weight_matmul(x, wq, scales, biases, group_size=32, bits=bits)
        derived = KERNELS.weight_matmul(x, wq, scales, None, group_size=32, bits=bits)
        assert mx.array_equal(explicit, derived).item(), rows


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q6_K])
def test_symmetric_imports_drop_their_biases_and_keep_their_tokens(qtype: Q, tmp_path: Path) -> None:
    """Q4_0 and Q8_0 as stored, Q6_K as requantized (symmetric 8-bit)."""
    write_tiny_gguf(TinyModel("llama", default=qtype), tmp_path / "t.gguf")
    folder = import_gguf(tmp_path / "t.gguf", tmp_path / "m")
    model = load_model(folder, vocab_dir=None).model
    layers = [m for _, m in model.named_modules() if isinstance(m, kernel_layers.KernelQuantizedLinear)]
    assert layers and all(m.symmetric and "biases" not in m for m in layers)
    ids = mx.array([[1, 5, 9, 2, 7]])
    logits = model(ids)
    for layer in layers:  # the same layers with the biases the kernels derived, passed explicitly
        layer.symmetric = False
        layer.biases = layer.scales * -(2 ** (layer.bits - 1))
    embed = model.model.embed_tokens
    embed.symmetric, embed.biases = False, embed.scales * -(2 ** (embed.bits - 1))
    assert mx.array_equal(logits, model(ids)).item()


def test_asymmetric_layers_keep_their_biases(tmp_path: Path) -> None:
    write_tiny_gguf(TinyModel("llama", default=Q.Q4_1), tmp_path / "t.gguf")
    folder = import_gguf(tmp_path / "t.gguf", tmp_path / "m")
    model = load_model(folder, vocab_dir=None).model
    layers = [m for _, m in model.named_modules() if isinstance(m, kernel_layers.KernelQuantizedLinear)]
    assert layers and not any(m.symmetric for m in layers) and all("biases" in m for m in layers)
