"""Expert products of many tokens (prefill): moe_mlp / moe_routed past kMaxRows tokens (every
expert's products as a few pool jobs, moe_prefill.h) and gather_matmul's large groups (every
expert on one `gemm` job), against mx.dequantize and float64 products, pair by pair."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from node.native import load_kernels
from tests.isa_children import CAPS, capped_env, run_capped
from tests.kernel_error import RELATIVE, excess, int8_rows
from tests.moe_reference import ALPHA, LIMIT, TOLERANCE, dense, error, reference, router_input

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
EXPERTS = 12
TOP = 8
USED = np.array([0, 1, 3, 4, 6, 7, 8, 10, 11])
"""Experts 2, 5 and 9 are never chosen (gaps); 9 experts for 8 choices: many repeats."""
LAYOUTS = {
    "mlx4": ("affine4", 64, "affine4", 64),  # MLX affine 4-bit g64, bf16 scales and biases
    "q4_k_m": ("affine4", 32, "sym8", 32),  # GGUF Q4_K (f16 scales and mins) with Q6_K's 8-bit down
    "q4_0": ("sym4", 32, "sym4", 32),  # GGUF Q4_0: symmetric, no biases
    "mxfp4": ("mxfp4", 32, "mxfp4", 32),  # gpt_oss
}
TOKENS = (9, 64, 300)


def _kernels() -> ModuleType:
    assert KERNELS is not None
    return KERNELS


def _projection(n: int, k: int, kind: str, group: int, bias: bool) -> tuple[Any, ...]:
    """An expert projection in the ops' tuple form: (w, scales, biases, bias, group, bits)."""
    w = mx.random.normal((EXPERTS, n, k)) * (1.5 / k**0.5)
    b = mx.random.normal((EXPERTS, n)) * 0.1 if bias else None
    if kind == "mxfp4":
        wq, scales, *_ = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        return (wq, scales, None, b, 32, 4)
    bits = 8 if kind == "sym8" else 4
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    if kind.startswith("sym"):  # symmetric, stored without biases: b = -2^(bits-1) s
        return (wq, scales.astype(mx.float16), None, b, group, bits)
    dtype = mx.bfloat16 if group == 64 else mx.float16
    return (wq, scales.astype(dtype), biases.astype(dtype), b, group, bits)


def _projections(layout: str, dim: int, ffn: int, bias: bool) -> list[tuple[Any, ...]]:
    kind, group, down_kind, down_group = LAYOUTS[layout]
    gate, up = (_projection(ffn, dim, kind, group, bias) for _ in range(2))
    return [gate, up, _projection(dim, ffn, down_kind, down_group, bias)]


def _chosen(tokens: int) -> np.ndarray:
    """Each token's TOP experts out of USED; token 0 chooses expert 3 twice, token 1 one outside."""
    rng = np.random.default_rng(tokens)
    idx = np.stack([rng.permutation(USED)[:TOP] for _ in range(tokens)]).astype(np.int32)
    idx[0, :2] = 3
    idx[1, -1] = EXPERTS
    return idx


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tokens", TOKENS)
def test_many_tokens_match_the_reference(layout: str, tokens: int) -> None:
    """D = 11 groups of 32 or 7 of 64 (not whole 64-byte steps), ffn 96 or 192 (panels of 32)."""
    mx.random.seed(tokens)
    dim, ffn = (448, 192) if layout == "mlx4" else (352, 96)
    activation, bias = ("swiglu_oai", True) if layout == "mxfp4" else ("swiglu", False)
    projections = _projections(layout, dim, ffn, bias)
    x = mx.random.normal((tokens, dim))
    idx = _chosen(tokens)
    scores = np.array(mx.softmax(mx.random.normal((tokens, TOP)), axis=-1))
    got = _kernels().moe_mlp(
        x, mx.array(idx), mx.array(scores), *projections, activation=activation, alpha=ALPHA, limit=LIMIT
    )
    assert got.dtype == mx.float32 and got.shape == x.shape
    off = error(got, reference(x, idx, scores, projections, activation))
    assert off < TOLERANCE, off
    # [B, L, D] gives the same rows: the batch axes are the tokens'.
    again = (
        _kernels().moe_mlp(
            x.reshape(2, tokens // 2, dim)[:, :],
            mx.array(idx[: tokens // 2 * 2]).reshape(2, tokens // 2, TOP),
            mx.array(scores[: tokens // 2 * 2]).reshape(2, tokens // 2, TOP),
            *projections,
            activation=activation,
            alpha=ALPHA,
            limit=LIMIT,
        )
        if tokens % 2 == 0
        else None
    )
    if again is not None:
        assert mx.array_equal(again.reshape(tokens, dim), got)


@pytest.mark.parametrize("tokens", TOKENS)
def test_many_tokens_routed_match_the_reference(tokens: int) -> None:
    """moe_routed past kMaxRows: the router's choices, then the same MLP as moe_mlp's."""
    mx.random.seed(100 + tokens)
    dim, ffn = 352, 96
    projections = _projections("q4_k_m", dim, ffn, False)
    wq, scales, biases = mx.quantize(mx.random.normal((EXPERTS, dim)) * 0.03, group_size=32, bits=8)
    x = mx.random.normal((tokens, dim))
    got = _kernels().moe_routed(
        x,
        (wq, scales, biases, None, 32, 8),
        *projections,
        top_k=TOP,
        routing="softmax_topk",
        norm_topk_prob=True,
    )
    dense = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=8), dtype=np.float64)
    logits = router_input(x, 32) @ dense.T
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    chosen = np.take_along_axis(p, idx, axis=-1)
    off = error(got, reference(x, idx, chosen / chosen.sum(-1, keepdims=True), projections, "swiglu"))
    assert off < TOLERANCE, off


@pytest.mark.parametrize("layout", ["mlx4", "q4_k_m", "q4_0", "mxfp4"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_many_tokens_gather_matmul_match_the_reference(layout: str, tokens: int) -> None:
    """gather_matmul as SwitchGLU calls it (x [T, 1, 1, K], indices [T, k]), every expert's large
    group on one gemm job, and blocks of 12 rows each ([B, 12, K], indices [B])."""
    mx.random.seed(200 + tokens)
    kind, group = LAYOUTS[layout][2:] if layout == "q4_k_m" else LAYOUTS[layout][:2]
    dim = 448 if group == 64 else 352
    wq, scales, biases, _, group, bits = _projection(96, dim, kind, group, False)
    weights = dense((wq, scales, biases, None, group, bits))
    idx = _chosen(tokens)
    idx[1, -1] = 3  # gather_matmul's indices outside give zeros: checked by test_expert_kernels
    for x, ids in (
        (mx.random.normal((tokens, 1, 1, dim)), idx),
        (mx.random.normal((tokens, 12, dim)), idx[:, 0]),
    ):
        got = _kernels().gather_matmul(x, wq, scales, biases, mx.array(ids), group_size=group, bits=bits)
        chosen = np.swapaxes(weights[ids], -1, -2)
        # past int8 rounding where the kernels round x so (tests/kernel_error.py)
        assert excess(got, x, chosen, group, int8_rows(bits, experts=True)) < RELATIVE


@pytest.mark.parametrize("isa", CAPS)
def test_each_narrower_instruction_set_passes_these_tests_too(isa: str) -> None:
    """Without `gemm` (AVX2, portable) the products go to `product` one expert at a time."""
    run_capped(__file__, capped_env(_kernels().kernel_name(), isa), "many_tokens")
