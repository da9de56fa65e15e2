"""GGUF blocks -> MLX affine: packing order, exactness per type, K-quant and Q6_K error bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from node.models.gguf_quants import (
    AFFINE_BITS,
    UnsupportedQuantError,
    convert_mxfp4_rows,
    convert_rows,
    pack,
    requantize8,
    row_chunks,
)

Q = GGMLQuantizationType
ROWS, COLS = 12, 512


def random_k_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Valid raw K-quant rows: random bytes, with every fp16 d (and dmin) set to a realistic value."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(2e-5, 2e-4, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, -2:] = d[:, 0:2]
    else:
        raw[:, 0:4] = d  # d and dmin
    return raw.reshape(rows, -1)


def affine_dequantize(parts: tuple[Any, Any, Any], bits: int) -> np.ndarray[Any, Any]:
    """MLX's own dequantization of converted parts, with scales/biases widened to float32 first."""
    w, s, b = (mx.array(p) for p in parts)
    out = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
    return np.array(out)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_order_is_mlx_affine(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(3, 64), dtype=np.uint8)
    words = pack(q, bits)
    assert words.dtype == np.uint32 and words.shape == (3, 64 * bits // 32)
    for i in range(64):  # element i sits in bits (i*bits) % 32 of word i*bits // 32, little end first
        got = (words[:, i * bits // 32] >> np.uint32(i * bits % 32)) & np.uint32(2**bits - 1)
        assert np.array_equal(got, q[:, i])
    ones, zeros = np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32)
    assert np.array_equal(affine_dequantize((words, ones, zeros), bits), q.astype(np.float32))
    # and mx.quantize packs the same way: groups spanning 0..2**bits-1 come out as q (a positive
    # scale) or as 2**bits-1-q (MLX picks a negative scale, bias = max, when that edge is larger)
    q[:, 0::32], q[:, 1::32] = 0, 2**bits - 1
    w_mlx, scales, _biases = mx.quantize(mx.array(q.astype(np.float32)), group_size=32, bits=bits)
    flip = np.repeat(np.array(scales) < 0, 32, axis=1)
    assert np.array_equal(np.array(w_mlx), pack(np.where(flip, 2**bits - 1 - q, q), bits))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_legacy_types_are_exactly_what_mx_load_gives(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    data = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    raw = quantize(data, qtype)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stored = gguf.GGUFReader(path).tensors[0].data
    parts = convert_rows(qtype, np.asarray(stored), COLS)

    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    arrays: tuple[np.ndarray[Any, Any], ...] = parts
    for part, suffix in zip(arrays, ("weight", "scales", "biases"), strict=True):
        expected = np.array(loaded[f"blk.0.attn_q.{suffix}"])
        assert part.dtype == expected.dtype and np.array_equal(part, expected), suffix
    bits = AFFINE_BITS[qtype]
    assert np.array_equal(affine_dequantize(parts, bits), dequantize(raw, qtype))  # exact


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_five_bit_legacy_types_are_exactly_gguf_pys_values(qtype: GGMLQuantizationType) -> None:
    """No MLX reader takes them: checked against gguf-py's dequantize, every one of the 32 levels."""
    data = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    raw = quantize(data, qtype)
    parts = convert_rows(qtype, raw, COLS)
    assert parts[0].shape == (ROWS, COLS // 4) and parts[1].dtype == np.float16
    assert np.array_equal(affine_dequantize(parts, 8), dequantize(raw, qtype))
    levels = np.array(
        mx.dequantize(
            mx.array(parts[0]), mx.ones(parts[1].shape), mx.zeros(parts[1].shape), group_size=32, bits=8
        )
    )
    assert set(np.unique(levels)) == set(range(32))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_k_quants_only_round_their_scales_to_fp16(qtype: GGMLQuantizationType) -> None:
    raw = random_k_blocks(qtype, ROWS, COLS)
    reference = dequantize(raw, qtype)
    parts = convert_rows(qtype, raw, COLS)
    bits = AFFINE_BITS[qtype]
    assert (bits, parts[0].shape, parts[1].dtype) == (
        {Q.Q4_K: 4, Q.Q5_K: 8}[qtype],
        (ROWS, COLS * bits // 32),
        np.float16,
    )
    got = affine_dequantize(parts, bits)

    # The only change: each group's scale d*sc and bias -dmin*m rounded to fp16 (2^-11 relative,
    # 2^-25 absolute below fp16's normal range), so |error| <= 2^-11 (q|s| + |b|) + (q+1) 2^-25.
    q = np.array(
        mx.dequantize(
            mx.array(parts[0]), mx.ones(parts[1].shape), mx.zeros(parts[1].shape), group_size=32, bits=bits
        )
    )
    scale = np.repeat(parts[1].astype(np.float32), 32, axis=1)
    bias = np.repeat(parts[2].astype(np.float32), 32, axis=1)
    bound = 2.0**-11 * (q * np.abs(scale) + np.abs(bias)) + (q + 1) * 2.0**-25 + 1e-9
    error = np.abs(got - reference)
    assert (error <= bound).all()
    # relative to the step s: <= 2^-11 (q + |b|/s). Where the bias is a typical group minimum
    # (|b| <= 16 s: a group around zero), that is under 2.5% of a step (q <= 31); measured
    # on 64x1024 weights: max 0.9% (Q4_K), 1.8% (Q5_K).
    typical = (scale > 0) & (np.abs(bias) <= 16 * scale)
    assert typical.mean() > 0.05
    assert float((error[typical] / scale[typical]).max()) < 0.025
    assert q.max() == {Q.Q4_K: 15, Q.Q5_K: 31}[qtype]  # the full range of q is exercised


def test_q6_k_is_requantized_to_8_bits_within_half_a_step() -> None:
    raw = random_k_blocks(Q.Q6_K, ROWS, COLS)
    reference = dequantize(raw, Q.Q6_K)
    parts = convert_rows(Q.Q6_K, raw, COLS)
    got = affine_dequantize(parts, 8)
    scale = np.repeat(parts[1].astype(np.float32), 32, axis=1)
    group_max = np.repeat(np.abs(reference).reshape(ROWS, -1, 32).max(axis=2), 32, axis=1)
    assert (np.abs(got - reference) <= 0.5 * scale + 2.0**-10 * group_max + 1e-9).all()
    # an 8-bit step is ~1/4 of Q6_K's own (64 levels over the same range): the error is ~1/8 of one
    q6_step = np.repeat(np.abs(reference).reshape(ROWS, -1, 32).max(axis=2) / 32, 32, axis=1)
    assert float(np.median(np.abs(got - reference) / q6_step)) < 0.125


def test_requantize_is_symmetric_and_handles_constant_groups() -> None:
    w = np.zeros((2, 64), np.float32)
    w[1, :32] = 0.25
    weight, scales, biases = requantize8(w)
    assert np.array_equal(biases, scales * np.float16(-128))  # what runners drop (kernel_layers)
    got = affine_dequantize((weight, scales, biases), 8)
    assert np.array_equal(got[:, 32:], w[:, 32:]) and np.array_equal(got[0], w[0])  # zeros stay exact
    assert np.allclose(got[1, :32], 0.25, rtol=2.0**-10, atol=0)  # max|w| -> 127 steps of an fp16 scale


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ2_XS, Q.F16])
def test_other_types_are_refused_by_name(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(UnsupportedQuantError, match=qtype.name):
        convert_rows(qtype, np.zeros((1, 8), np.uint8), 256)


def test_scales_that_overflow_fp16_are_refused() -> None:
    raw = random_k_blocks(Q.Q4_K, 1, 256)
    raw[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # d * sc > 65504
    raw[0, 4:16] = 0xFF
    with pytest.raises(UnsupportedQuantError, match="overflow"):
        convert_rows(Q.Q4_K, raw, 256)


def test_row_chunks_cover_every_row_once() -> None:
    chunks = list(row_chunks(1000, 1 << 20))
    assert chunks[0] == (0, 4) and chunks[-1] == (996, 1000) and len(chunks) == 250
    assert list(row_chunks(3, 10)) == [(0, 3)]


def test_mxfp4_is_mlx_mxfp4_exactly_for_every_code_and_scale_byte() -> None:
    """Random blocks whose scale bytes take all values but 255 and whose codes all 16 (both signs of 0)."""
    rng = np.random.default_rng(4)
    block, size = GGML_QUANT_SIZES[Q.MXFP4]
    rows = 256 * block // COLS  # 256 blocks
    blocks = rng.integers(0, 256, size=(rows * COLS // block, size), dtype=np.uint8)
    blocks[:, 0] = np.arange(256) % 255  # every E8M0 byte MLX reads as a number, subnormal results included
    blocks[0, 1:9] = np.arange(0, 256, 17)[:8]  # codes 0-15 among the low and high nibbles
    raw = blocks.reshape(rows, -1)
    weight, scales = convert_mxfp4_rows(raw, COLS)
    assert (weight.shape, scales.shape, scales.dtype) == ((rows, COLS // 8), (rows, COLS // 32), np.uint8)
    with np.errstate(over="ignore"):  # 12 x 2^126 is inf in float32, to both
        want = dequantize(raw, Q.MXFP4)
    got = mx.dequantize(
        mx.array(weight), mx.array(scales), None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32
    )
    assert np.array_equal(np.array(got), want)
    raw[-1, 0] = 255  # 2^128 to llama.cpp, NaN to MLX: refused
    with pytest.raises(UnsupportedQuantError, match="scale byte 255"):
        convert_mxfp4_rows(raw, COLS)
