"""llama.cpp's raw tensor blocks -> MLX affine `weight`/`scales`/`biases`, with vectorized numpy.

MLX's affine form: per group of 32 weights along a row, `w = scale * q + bias`, q an unsigned
`bits`-bit integer; element i of a group sits in bits `(i * bits) % 32` of word `i * bits // 32`
of the row's uint32 words (little end first). The GGUF types map onto it as follows:

| GGUF | block | MLX | exact? |
|---|---|---|---|
| Q4_0 | 32: fp16 d, 4-bit q; w = d * (q - 8) | 4-bit, scale d, bias -8d | yes |
| Q4_1 | 32: fp16 d, m, 4-bit q; w = d * q + m | 4-bit, scale d, bias m | yes |
| Q8_0 | 32: fp16 d, int8 x; w = d * x | 8-bit, q = x + 128, bias -128d | yes |
| Q5_0 | 32: fp16 d, 32 high bits, 4-bit q; w = d * (q - 16) | 8-bit (q 0..31 fits), bias -16d | yes |
| Q5_1 | 32: fp16 d, m, 32 high bits, 4-bit q; w = d * q + m | 8-bit, scale d, bias m | yes |
| Q4_K | 256: fp16 d, dmin; 8 x (6-bit sc, m; 32 4-bit q); w = d*sc*q - dmin*m | 4-bit | fp16 scales |
| Q5_K | as Q4_K with 5-bit q | 8-bit (q 0..31 fits) | fp16 scales |
| Q6_K | 256: fp16 d; 16 x (int8 sc, 16 6-bit q); w = d*sc*(q - 32) | 8-bit symmetric, requantized | no |
| MXFP4 | 32: E8M0 e, 4-bit E2M1 q; w = e2m1(q) * 2^(e-127) | MLX `mxfp4` (scale byte e, no biases) | yes |

Q4_0/Q4_1/Q8_0 come out exactly as `mx.load` of the GGUF gives them (a test checks it); Q5_0/Q5_1
(llama-quantize's Q4_K/Q5_K fallbacks for rows that are not whole 256-weight blocks, as SmolLM2's
576 or gpt-oss's 2880) exactly as gguf-py dequantizes them, at 8 bits (+2.5 bits a weight). For
Q4_K/Q5_K, `d*sc` and `dmin*m` are exact in float32 but stored as float16 like the other types'
scales: each group's scale s and bias b is rounded to fp16 (relative error <= 2^-11, absolute
<= 2^-25 for subnormal values), so a weight moves by <= 2^-11 (q|s| + |b|): 1-2% of a step s
where b is a typical group minimum (float32 scales would be exact but cost a bit per weight more,
and every other type's scales are fp16 already). Q6_K's two 16-weight
sub-blocks in a group of 32 have different scales, so no 32-group affine form holds both exactly:
those tensors are dequantized row chunk by row chunk and requantized to symmetric 8 bits (max|w|
per group, no biases kept; error <= half an 8-bit step, ~1/8 of Q6_K's own step). Every other type is refused.
MXFP4 (llama.cpp's `MXFP4_MOE` experts) is MLX's own `mxfp4` mode: gguf-py writes its values
doubled (`kvalues`) with half the scale (`e8m0_to_fp32_half`), the same numbers; only the nibble
order changes (a test checks every code and scale byte against gguf-py's dequantize).
Work is done on row chunks, so no float32 copy of a whole large tensor is ever made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GROUP_SIZE = 32
"""MLX affine group size for every converted type (llama.cpp's 32-weight blocks and sub-blocks)."""
CHUNK_WEIGHTS = 1 << 22
"""Weights converted at once (~4M: tens of MB of temporaries), whatever the tensor's size."""

Q = GGMLQuantizationType
AFFINE_BITS: dict[GGMLQuantizationType, int] = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q8_0: 8,
    Q.Q5_0: 8,
    Q.Q5_1: 8,
    Q.Q4_K: 4,
    Q.Q5_K: 8,
    Q.Q6_K: 8,
}
"""The quantized GGUF types we read as MLX affine, and the bits each becomes."""
QUANTIZED_BITS: dict[GGMLQuantizationType, int] = {**AFFINE_BITS, Q.MXFP4: 4}
"""Every quantized GGUF type we read, and the MLX bits it becomes (the mode: `quant_mode`)."""
PLAIN_DTYPES: dict[GGMLQuantizationType, str] = {Q.F32: "F32", Q.F16: "F16", Q.BF16: "BF16"}
"""Unquantized GGUF types, kept as stored (safetensors dtype names)."""
REQUANTIZED = frozenset({Q.Q6_K})
"""Types with no exact affine form at group 32: their values change (slightly) on import."""

U8 = npt.NDArray[np.uint8]
Affine = tuple[npt.NDArray[np.uint32], npt.NDArray[np.float16], npt.NDArray[np.float16]]


class UnsupportedQuantError(ValueError):
    """A tensor type with no (faithful) MLX affine form here."""


def pack(q: npt.NDArray[Any], bits: int) -> npt.NDArray[np.uint32]:
    """(rows, cols) integers < 2**bits -> (rows, cols * bits / 32) uint32 words in MLX's order."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 4:
        q = np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << np.uint8(4)))
    elif bits != 8:
        raise ValueError(f"only 4- and 8-bit packing is used, not {bits}")
    return q.view("<u4").astype(np.uint32, copy=False)


def _fp16(x: npt.NDArray[Any], what: str) -> npt.NDArray[np.float16]:
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(x, dtype=np.float32).astype(np.float16)
    if not np.isfinite(out).all():
        raise UnsupportedQuantError(f"{what} overflow float16 (or are not finite in the file)")
    return out


def _half(blocks: U8, start: int) -> npt.NDArray[np.float32]:
    """The fp16 at byte `start` of every block, as float32 (shape (n, 1))."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: U8, width: int) -> U8:
    """Bytes (n, k * width) -> 4-bit values (n, 2k * width): per `width` bytes, low nibbles first."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, width)
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, -1)


def _k_scale_min(scales: U8) -> tuple[U8, U8]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp get_scale_min_k4)."""
    lo, hi, mix = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return sc, mn


def _five_bits(blocks: U8, start: int) -> U8:
    """Q5_0/Q5_1's 32 values from byte `start`: bit i of the little-endian uint32 there is element
    i's fifth bit, the 16 bytes after it their low nibbles (elements 0-15 low, 16-31 high)."""
    qh = np.ascontiguousarray(blocks[:, start : start + 4]).view("<u4")
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    return _nibbles(blocks[:, start + 4 :], 16) | (high << np.uint8(4))


def _legacy(qtype: GGMLQuantizationType, blocks: U8) -> tuple[U8, Any, Any]:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks (n, bytes) -> q (n, 32), scale (n, 1), bias (n, 1)."""
    d = _half(blocks, 0)
    if qtype == Q.Q4_0:
        return _nibbles(blocks[:, 2:], 16), d, -8.0 * d
    if qtype == Q.Q4_1:
        return _nibbles(blocks[:, 4:], 16), d, _half(blocks, 2)
    if qtype == Q.Q5_0:
        return _five_bits(blocks, 2), d, -16.0 * d
    if qtype == Q.Q5_1:
        return _five_bits(blocks, 4), d, _half(blocks, 2)
    q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128.0 * d


def _k_quant(qtype: GGMLQuantizationType, blocks: U8) -> tuple[U8, Any, Any]:
    """Q4_K/Q5_K super-blocks (n, bytes) -> q (n, 256), scale (n, 8), bias (n, 8)."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    if qtype == Q.Q4_K:
        q = _nibbles(blocks[:, 16:144], 32)
    else:
        qh = blocks[:, 16:48]  # bit i of qh[l]: the 5th bit of element l of sub-block i
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        high = ((qh[:, None, :] >> shifts) & np.uint8(1)).reshape(qh.shape[0], -1)
        q = _nibbles(blocks[:, 48:176], 32) | (high << np.uint8(4))
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def requantize8(w: npt.NDArray[np.float32]) -> Affine:
    """Float rows (n, cols) -> symmetric 8-bit affine, group 32: scale max|w| / 127, bias -128 x
    scale (as Q8_0's). Q6_K's values are symmetric about 0 by construction, so a min/max range
    would buy nothing, and runners drop a symmetric layer's biases (8.5 bits a weight, not 9). q is
    rounded against the fp16 scale actually stored: the error stays <= half a step (plus fp16)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    scales = _fp16(np.abs(g).max(axis=2) / 127.0, "requantized scales")
    biases = scales * np.float16(-128)  # exact in fp16: a power of two
    s32 = scales.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(s32 > 0, np.rint(g / s32), 0.0) + 128.0
    q = np.clip(levels, 0, 255).astype(np.uint8).reshape(rows, cols)
    return pack(q, 8), scales, biases


def convert_rows(qtype: GGMLQuantizationType, raw: U8, cols: int) -> Affine:
    """Raw rows (n, bytes per row) of a quantized tensor -> MLX affine (weight, scales, biases)."""
    if qtype not in AFFINE_BITS:
        raise UnsupportedQuantError(f"type {qtype.name} is not supported")
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise UnsupportedQuantError(f"rows of {cols} weights are not whole {qtype.name} blocks")
    rows = raw.shape[0]
    if qtype in REQUANTIZED:
        return requantize8(dequantize(raw, qtype).reshape(rows, cols))
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    q, scale, bias = (_legacy if block == GROUP_SIZE else _k_quant)(qtype, blocks)
    groups = (rows, cols // GROUP_SIZE)
    return (
        pack(q.reshape(rows, cols), AFFINE_BITS[qtype]),
        _fp16(scale.reshape(groups), f"{qtype.name} scales"),
        _fp16(bias.reshape(groups), f"{qtype.name} biases"),
    )


MXFP4_NAN_SCALE = 255
"""The E8M0 byte MLX (like the OCP MX spec) reads as NaN, llama.cpp as 2^128 (no real file has it)."""


def quant_mode(qtype: GGMLQuantizationType) -> str:
    """MLX's quantization mode for a type of `QUANTIZED_BITS`: `mxfp4` has no biases."""
    return "mxfp4" if qtype == Q.MXFP4 else "affine"


def convert_mxfp4_rows(raw: U8, cols: int) -> tuple[npt.NDArray[np.uint32], U8]:
    """Raw MXFP4 rows (n, bytes per row) -> MLX `mxfp4` (weight, scales): codes repacked, scales as stored."""
    block, size = GGML_QUANT_SIZES[Q.MXFP4]
    if cols % block:
        raise UnsupportedQuantError(f"rows of {cols} weights are not whole MXFP4 blocks")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    scales = np.ascontiguousarray(blocks[:, 0]).reshape(rows, cols // block)
    if (scales == MXFP4_NAN_SCALE).any():
        raise UnsupportedQuantError("MXFP4 scale byte 255 (llama.cpp: 2^128, MLX: not a number)")
    q = _nibbles(blocks[:, 1:], block // 2)  # elements 0-15 in the low nibbles, 16-31 in the high ones
    return pack(q.reshape(rows, cols), 4), scales


def row_chunks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of about `CHUNK_WEIGHTS` weights each (at least one row)."""
    step = max(1, CHUNK_WEIGHTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
