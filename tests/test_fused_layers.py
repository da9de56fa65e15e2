"""Fused decoder layers (`node.cpu.fused_layers`) give the bits of mlx-lm's own layers.

Each architecture the fusion takes (llama; qwen2, with q/k/v biases; qwen3, with per-head norms)
is loaded twice through the dtype policy, fused and not (`SHOAL_FUSED_LAYERS=0`), in 4-bit,
8-bit and bfloat16: a prefill chunk and decode steps give equal logits, alone and in a padded
batch (mlx-lm's `BatchGenerator`, as the runner runs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from node.cpu.fused import uninstall_fused_ops
from node.cpu.fused_layers import _FusedBlock, fuse_decoder_layers, is_fusable
from node.native import load_kernels
from node.runner.engine import load_model
from tests.decode_runs import BATCHED_TOKENS, batched, logits_alone
from tests.model_factory import ModelType, make_random_model, quantized_copy

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "decoder_head"), reason="the native kernels are not built"
)
LAYOUTS = {"q4": (4, 32), "q8": (8, 64), "bf16": None}


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    uninstall_fused_ops()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def bf16_model(request: Any, builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type: ModelType = request.param
    return make_random_model(
        tmp_path_factory.mktemp(model_type) / "bf16",
        model_type=model_type,
        tokenizer_from=builtin_model_dir,
        dtype="bfloat16",
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model_dir(request: Any, bf16_model: Path) -> Path:
    layout = LAYOUTS[request.param]
    if layout is None:
        return bf16_model
    bits, group = layout
    return quantized_copy(bf16_model, bf16_model.parent / request.param, bits=bits, group_size=group)


def _loaded(model_dir: Path, monkeypatch: pytest.MonkeyPatch, *, fused: bool) -> Any:
    monkeypatch.setenv("SHOAL_FUSED_LAYERS", "1" if fused else "0")
    model = load_model(model_dir, vocab_dir=None).model
    assert all(isinstance(layer, _FusedBlock) == fused for layer in model.layers)
    return model


def test_fused_layers_give_the_bits_of_mlx_lms_layers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = _loaded(model_dir, monkeypatch, fused=True)
    plain = _loaded(model_dir, monkeypatch, fused=False)
    # mlx-lm's swiglu is compiled, and keeps the silu of its first trace in this process (MLX's
    # own if another test traced it without the fused ops); uncompiled it calls the runner's.
    mx.disable_compile()
    try:
        want_alone, want_batch = logits_alone(plain), batched(plain)
    finally:
        mx.enable_compile()
    for got, want in zip(logits_alone(fused), want_alone, strict=True):
        assert got.shape == want.shape and bool(mx.array_equal(got, want).item())
    got_batch = batched(fused)
    assert len(got_batch) == len(want_batch) == BATCHED_TOKENS
    for (uid, token, logprobs), (uid2, token2, logprobs2) in zip(got_batch, want_batch, strict=True):
        assert (uid, token) == (uid2, token2)
        assert bool(mx.array_equal(logprobs, logprobs2).item())


def test_only_kernel_layers_are_fused(bf16_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.utils import load

    float_model: Any = load(str(bf16_model))[0]  # bfloat16 on MLX's own layers: nothing to fuse
    assert not any(is_fusable(layer) for layer in float_model.layers)
    assert KERNELS is not None and fuse_decoder_layers(float_model, KERNELS) == 0
    monkeypatch.setenv("SHOAL_FUSED_LAYERS", "0")
    kernel_model = load_model(bf16_model, vocab_dir=None).model
    assert all(is_fusable(layer) for layer in kernel_model.layers)
    assert fuse_decoder_layers(kernel_model, KERNELS) == 0  # turned off
    monkeypatch.setenv("SHOAL_FUSED_LAYERS", "1")
    assert fuse_decoder_layers(kernel_model, KERNELS) == len(kernel_model.layers)


def test_bad_shapes_are_refused_by_name() -> None:
    assert KERNELS is not None
    x = mx.zeros((1, 1, 64))
    norm = mx.ones((64,))
    w = mx.zeros((96, 64), dtype=mx.bfloat16)
    projection = (w, None, None, None, 0, 16)
    with pytest.raises(ValueError, match="heads"):
        KERNELS.decoder_head(x, norm, 1e-5, [projection], [5])
    with pytest.raises(ValueError, match="features"):
        KERNELS.decoder_head(mx.zeros((1, 1, 32)), mx.ones((32,)), 1e-5, [projection], [2])
    square, up = (mx.zeros((64, 64), dtype=mx.bfloat16), mx.zeros((80, 64), dtype=mx.bfloat16))
    down = mx.zeros((64, 96), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="chain"):  # up gives 80 features where gate gives 96
        KERNELS.decoder_tail(
            x,
            x,
            (square, None, None, None, 0, 16),
            norm,
            1e-5,
            projection,
            (up, None, None, None, 0, 16),
            (down, None, None, None, 0, 16),
        )


def _projection(n: int, k: int, bits: int, group: int) -> tuple[Any, ...]:
    w = mx.random.normal((n, k)) * 0.05
    if bits == 16:
        return (w.astype(mx.bfloat16), None, None, None, 0, 16)
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return (q, scales.astype(mx.float16), biases.astype(mx.float16), None, group, bits)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("mixed", [False, True], ids=["one-layout", "mixed"])
def test_decoder_head_projections_have_the_bits_of_single_products(rows: int, mixed: bool) -> None:
    """q/k/v of one layout share one pool job; mixed ones go one by one: both give each product's bits."""
    assert KERNELS is not None
    mx.random.seed(3)
    layouts = [(4, 32), (8, 64), (16, 0)] if mixed else [(4, 32)] * 3
    # 82 KB of 4-bit weights: above the size that splits a product over the threads
    sizes = zip((384, 128, 128), layouts, strict=True)
    projections = [_projection(n, 256, bits, group) for n, (bits, group) in sizes]
    x, norm = mx.random.normal((rows, 1, 256)), mx.random.uniform(0.5, 1.5, (256,))
    got = KERNELS.decoder_head(x, norm, 1e-5, projections, [6, 2, 2])
    normed = KERNELS.rms_norm(x, norm, 1e-5)
    for out, (w, scales, biases, _, group, bits), heads in zip(got, projections, (6, 2, 2), strict=True):
        want = KERNELS.weight_matmul(normed, w, scales, biases, group_size=group, bits=bits)
        want = want.reshape(rows, 1, heads, -1).transpose(0, 2, 1, 3)
        assert out.shape == want.shape and bool(mx.array_equal(out, want).item())
