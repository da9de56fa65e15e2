"""Shoal's MXFP4 products (E2M1 codes, an E8M0 scale byte per 32 weights, as MLX's mode "mxfp4"
stores them) against a plain numpy E2M1 table and against mx.dequantize + float32 matmuls, dense
(weight_matmul) and per expert (gather_matmul), with every scale byte 0..254."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from node.native import load_kernels
from tests.isa_children import CAPS, capped_env, run_capped
from tests.kernel_error import RELATIVE, half_steps, int8_rows
from tests.test_expert_kernels import TOKENS

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
"""The 16 E2M1 codes' values (OCP MX spec): sign bit 3, then exponent and mantissa."""
K = 7 * 32  # 7 chunks: an AVX-512 step of 4, an AVX2 pair, and a lone chunk


def _kernels() -> ModuleType:
    assert KERNELS is not None
    return KERNELS


def _table_dequantize(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 weights from packed codes (8 a uint32, element i at bits 4i) and E8M0 bytes."""
    codes = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    values = E2M1[codes.reshape(*words.shape[:-1], -1)]
    return values * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1)


def _random_mxfp4(
    rng: np.random.Generator, shape: tuple[int, ...], scales: np.ndarray, mask: int
) -> tuple[mx.array, mx.array]:
    words = rng.integers(0, 2**32, size=(*shape, K // 8), dtype=np.uint64).astype(np.uint32) & np.uint32(mask)
    return mx.array(words), mx.array(scales.astype(np.uint8))


def _check(
    got: mx.array, x: np.ndarray, dense: np.ndarray, rows: slice = slice(None), experts: bool = False
) -> None:
    """Each output within RELATIVE of the float64 product, relative to its own |x| @ |w|.T, past
    int8 rounding of x where the rows kernel does that (tests/kernel_error.py; experts: gather_matmul)."""
    w_t = np.swapaxes(dense, -1, -2).astype(np.float64)
    x64 = x.astype(np.float64)
    want = x64 @ w_t
    scale = np.abs(x64) @ np.abs(w_t)
    err = np.abs(np.array(got, dtype=np.float64) - want)
    if int8_rows(4, experts):
        err = np.maximum(err - half_steps(x64, 32) @ np.abs(w_t), 0.0)
    err = err[..., rows] / np.maximum(scale[..., rows], 1e-300)
    assert np.isfinite(err).all() and err.max() < RELATIVE, err.max()


def test_the_numpy_table_is_what_mx_dequantize_gives_for_every_scale_byte() -> None:
    rng = np.random.default_rng(0)
    scales = np.arange(255, dtype=np.uint8).reshape(255, 1).repeat(K // 32, axis=1)
    w, s = _random_mxfp4(rng, (255,), scales, 0xFFFFFFFF)
    dense = np.array(mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4").astype(mx.float32))
    table = _table_dequantize(np.array(w), scales)
    finite = np.abs(table) < np.finfo(np.float32).max
    assert finite.mean() > 0.95 and np.array_equal(dense[finite], table[finite].astype(np.float32))


def test_mxfp4_products_match_the_table_and_mx_dequantize_for_every_token_count() -> None:
    rng = np.random.default_rng(1)
    experts, n, top = 6, 40, 2
    scales = rng.integers(118, 136, size=(experts, n, K // 32))
    w, s = _random_mxfp4(rng, (experts, n), scales, 0xFFFFFFFF)
    dense = _table_dequantize(np.array(w), scales)
    mlx_dense = mx.dequantize(w, s, group_size=32, bits=4, mode="mxfp4")
    used = np.array([0, 2, 3, 5])  # repeats across tokens and gaps: experts 1 and 4 never chosen
    for tokens in TOKENS:
        x = rng.normal(size=(tokens, K)).astype(np.float32)
        got = _kernels().weight_matmul(mx.array(x), w[3], s[3], None, group_size=32, bits=4)
        _check(got, x, dense[3])
        _check(
            got, x, np.array(mlx_dense[3].astype(mx.float32))
        )  # and the float32 route the runner took before
        idx = used[rng.integers(0, 4, size=(tokens, top))]
        # gate/up (a token's row broadcast over its experts), down (a row per expert), sorted flat
        for xs, ids in (
            (x[:, None, None, :], idx),
            (rng.normal(size=(tokens, top, 1, K)).astype(np.float32), idx),
            (rng.normal(size=(tokens * top, 1, K)).astype(np.float32), np.sort(idx.flatten())),
        ):
            got = _kernels().gather_matmul(mx.array(xs), w, s, None, mx.array(ids), group_size=32, bits=4)
            _check(got, xs, dense[ids], rows=slice(None), experts=True)


@pytest.mark.parametrize("tokens", TOKENS)
def test_mxfp4_products_match_at_every_scale_byte(tokens: int) -> None:
    """Row r of 255 has scale byte r in every group. Rows 0..127 meet large x, 128..254 small x,
    so that neither x's int16 scale times 2^(e-128) nor the products leave float32's normal range;
    codes up to 1.5 (6 x 2^127 is no float32, for MLX either)."""
    rng = np.random.default_rng(2 + tokens)
    scales = np.arange(255).reshape(5, 51, 1).repeat(K // 32, axis=2)
    w, s = _random_mxfp4(rng, (5, 51), scales, 0xBBBBBBBB)  # codes 0..3, 8..11: |value| <= 1.5
    dense = _table_dequantize(np.array(w), scales).reshape(255, K)
    for magnitude, rows in ((1e30, slice(0, 128)), (1e-3, slice(128, 255))):
        x = (rng.uniform(-1, 1, size=(tokens, K)) * magnitude).astype(np.float32)
        got = _kernels().weight_matmul(
            mx.array(x), w.reshape(255, -1), s.reshape(255, -1), None, group_size=32, bits=4
        )
        _check(got, x, dense, rows)
        ids = np.arange(5)[None].repeat(tokens, axis=0)  # every expert for every token
        got = _kernels().gather_matmul(
            mx.array(x)[:, None, None, :], w, s, None, mx.array(ids), group_size=32, bits=4
        )
        _check(got.reshape(tokens, 255), x, dense, rows, experts=True)


def test_mxfp4_arguments_the_kernels_refuse_are_clear() -> None:
    w = mx.zeros((16, K // 8), dtype=mx.uint32)
    s = mx.zeros((16, K // 32), dtype=mx.uint8)
    with pytest.raises(ValueError, match="MXFP4's: 4 bits, group size 32, no biases"):
        _kernels().weight_matmul(mx.zeros((1, K)), w, s, s, group_size=32, bits=4)
    with pytest.raises(ValueError, match="group size 32"):
        _kernels().weight_matmul(mx.zeros((1, K)), w, s[:, : K // 64], None, group_size=64, bits=4)


@pytest.mark.parametrize("isa", CAPS)
def test_each_narrower_instruction_set_passes_these_tests_too(isa: str) -> None:
    """As tests/test_kernels.py does for the dense products: a child runs this file's product tests
    with SHOAL_KERNEL_ISA capping the kernels."""
    run_capped(__file__, capped_env(_kernels().kernel_name(), isa), "match")
