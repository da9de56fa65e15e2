"""Shoal's expert products (gather_matmul, the CPU side of mx.gather_qmm) against mx.dequantize +
float32 matmuls, one chosen expert at a time."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import pytest

from node.native import load_kernels
from tests.isa_children import CAPS, capped_env, run_capped
from tests.kernel_error import RELATIVE, excess, int8_rows

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
EXPERTS = 6
TOKENS = (1, 3, 8, 64)
"""Decode (1), small batches (3, 8), prefill (64: several blocks of one expert go to the dense gemm)."""


def _kernels() -> ModuleType:
    assert KERNELS is not None
    return KERNELS


def _experts(n: int, k: int, bits: int, group: int, symmetric: bool = False) -> tuple[mx.array, ...]:
    w = mx.random.normal((EXPERTS, n, k)) * 0.05
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    if symmetric:  # GGUF-style symmetric experts: b = -2^(bits-1) s, stored without biases
        biases = -(2 ** (bits - 1)) * scales
    return wq, scales.astype(mx.float16), biases.astype(mx.float16)


def _chosen(tokens: int, top: int) -> mx.array:
    """Top-k choices with repeats across tokens and gaps: experts 1 and 4 are never chosen."""
    used = mx.array([0, 2, 3, 5], dtype=mx.int32)
    picks = mx.random.randint(0, 4, (tokens, top))
    return used[picks]


def _reference(
    wq: mx.array, scales: mx.array, biases: mx.array, idx: mx.array, group: int, bits: int
) -> mx.array:
    """Each block's expert's dequantized weights, transposed ([..., K, N]): x [..., R, K] times
    them (broadcast with idx [...]) is the product gather_matmul computes."""
    dense = mx.dequantize(
        wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
    )
    return mx.swapaxes(dense[idx], -1, -2)


def _error(got: mx.array, x: mx.array, chosen: mx.array, group: int, bits: int) -> float:
    """Largest error relative to the product's own scale, past int8 rounding of x where the rows
    kernel does that (tests/kernel_error.py; groups of more rows go to the gemm, well inside)."""
    return excess(got, x.astype(mx.float32), chosen, group, int8_rows(bits, experts=True))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_expert_products_match_dequantize_then_matmul(bits: int, group: int) -> None:
    mx.random.seed(bits + group)
    n, k, top = 40, 7 * group, 2  # K = 7 groups: whole steps, then a half step and a lone chunk
    wq, scales, biases = _experts(n, k, bits, group)
    for tokens in TOKENS:
        idx = _chosen(tokens, top)
        # gate/up as SwitchGLU calls them: one row per token, broadcast over its chosen experts
        x = mx.random.normal((tokens, 1, 1, k))
        got = _kernels().gather_matmul(x, wq, scales, biases, idx, group_size=group, bits=bits)
        assert got.shape == (tokens, top, 1, n) and got.dtype == mx.float32
        assert _error(got, x, _reference(wq, scales, biases, idx, group, bits), group, bits) < RELATIVE, (
            tokens,
            "broadcast",
        )
        # down: a row per (token, expert)
        x = mx.random.normal((tokens, top, 1, k))
        got = _kernels().gather_matmul(x, wq, scales, biases, idx, group_size=group, bits=bits)
        assert _error(got, x, _reference(wq, scales, biases, idx, group, bits), group, bits) < RELATIVE, (
            tokens,
            "rows",
        )
        # sorted, flattened, as SwitchGLU passes many tokens (sorted_indices=True)
        flat = mx.sort(idx.flatten())
        x = mx.random.normal((flat.size, 1, k))
        got = _kernels().gather_matmul(x, wq, scales, biases, flat, group_size=group, bits=bits)
        assert _error(got, x, _reference(wq, scales, biases, flat, group, bits), group, bits) < RELATIVE, (
            tokens,
            "sorted",
        )


def test_matches_mlx_gather_qmm_symmetric_and_half_x() -> None:
    mx.random.seed(3)
    wq, scales, biases = _experts(64, 288, 4, 32)  # K = 9 groups of 32
    idx = _chosen(5, 4)
    x = mx.random.normal((5, 1, 1, 288)).astype(mx.bfloat16)
    got = _kernels().gather_matmul(x, wq, scales, biases, idx, group_size=32, bits=4)
    want = mx.gather_qmm(
        x.astype(mx.float32), wq, scales, biases, rhs_indices=idx, transpose=True, group_size=32, bits=4
    )
    chosen = _reference(wq, scales, biases, idx, 32, 4)
    assert excess(want, x.astype(mx.float32), chosen, 32, rounded=False) < RELATIVE  # MLX's meaning
    assert _error(got, x, chosen, 32, 4) < RELATIVE
    wq, scales, biases = _experts(16, 256, 8, 64, symmetric=True)
    x = mx.random.normal((3, 2, 1, 256))
    got = _kernels().gather_matmul(x, wq, scales, None, idx[:3, :2], group_size=64, bits=8)
    assert _error(got, x, _reference(wq, scales, biases, idx[:3, :2], 64, 8), 64, 8) < RELATIVE


def test_an_index_outside_the_experts_gives_zeros_and_bad_arguments_are_clear() -> None:
    wq, scales, biases = _experts(16, 64, 4, 32)
    x = mx.random.normal((2, 1, 64))
    got = _kernels().gather_matmul(x, wq, scales, biases, mx.array([1, EXPERTS]), group_size=32, bits=4)
    assert mx.all(got[1] == 0).item() and mx.any(got[0] != 0).item()
    k = _kernels()
    with pytest.raises(ValueError, match="x has 32 features, w 64"):
        k.gather_matmul(mx.zeros((1, 1, 32)), wq, scales, biases, mx.array([0]), group_size=32, bits=4)
    with pytest.raises(ValueError, match="must be 3-D"):
        k.gather_matmul(
            mx.zeros((1, 1, 64)), wq[0], scales[0], biases[0], mx.array([0]), group_size=32, bits=4
        )
    with pytest.raises(ValueError, match="indices must be integers"):
        k.gather_matmul(mx.zeros((1, 1, 64)), wq, scales, biases, mx.array([0.0]), group_size=32, bits=4)


@pytest.mark.parametrize("isa", CAPS)
def test_each_narrower_instruction_set_passes_these_tests_too(isa: str) -> None:
    """As tests/test_kernels.py does for the dense products: a child runs this file's product tests
    with SHOAL_KERNEL_ISA capping the kernels."""
    run_capped(__file__, capped_env(_kernels().kernel_name(), isa), "match")
