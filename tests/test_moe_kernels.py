"""Shoal's whole expert MLP in one operation (moe_mlp) against a plain float64 reference: each
token's chosen experts dequantized by mx.dequantize, gate and up, the activation, down, and the
sum weighted by the scores, one (token, expert) pair at a time."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from node.native import load_kernels
from tests.isa_children import CAPS, capped_env, run_capped
from tests.moe_reference import ALPHA, LIMIT, TOLERANCE, error, reference, router_input

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
EXPERTS = 6
TOP = 3


def _kernels() -> ModuleType:
    assert KERNELS is not None
    return KERNELS


def _projection(n: int, k: int, kind: str, bias: bool) -> tuple[Any, ...]:
    """An expert projection in the op's tuple form: affine 4-bit g64 (bf16 scales) or MXFP4."""
    w = mx.random.normal((EXPERTS, n, k)) * (1.5 / k**0.5)
    b = mx.random.normal((EXPERTS, n)) * 0.1 if bias else None
    if kind == "mxfp4":
        wq, scales, *_ = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        return (wq, scales, None, b, 32, 4)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    return (wq, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16), b, 64, 4)


def _chosen(tokens: int) -> mx.array:
    """Top-3 choices with repeats across tokens and gaps: experts 1 and 4 are never chosen."""
    used = np.array([0, 2, 3, 5])
    rng = np.random.default_rng(tokens)
    return mx.array(np.stack([rng.permutation(used)[:TOP] for _ in range(tokens)]).astype(np.int32))


CASES = [("swiglu", "affine4", False), ("swiglu_oai", "mxfp4", True), ("swiglu_oai", "affine4", True)]


@pytest.mark.parametrize("activation, kind, bias", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 8, 11])
def test_moe_mlp_matches_the_plainreference(activation: str, kind: str, bias: bool, tokens: int) -> None:
    """D = 7 groups of 64 (K not a multiple of a 64-byte step), ffn 192; 11 tokens: two blocks."""
    mx.random.seed(tokens)
    dim, ffn = 448, 192
    projections = [_projection(ffn, dim, kind, bias), _projection(ffn, dim, kind, bias)]
    projections.append(_projection(dim, ffn, kind, bias))
    x = mx.random.normal((tokens, dim))
    idx = _chosen(tokens)
    scores = mx.softmax(mx.random.normal((tokens, TOP)), axis=-1)
    got = _kernels().moe_mlp(x, idx, scores, *projections, activation=activation, alpha=ALPHA, limit=LIMIT)
    assert got.dtype == mx.float32 and got.shape == x.shape
    off = error(got, reference(x, idx, scores, projections, activation))
    assert off < TOLERANCE, off
    # Batch axes are the tokens': [B, L, D] gives the same rows.
    again = _kernels().moe_mlp(
        x.reshape(1, tokens, dim),
        idx.reshape(1, tokens, TOP),
        scores.reshape(1, tokens, TOP),
        *projections,
        activation=activation,
        alpha=ALPHA,
        limit=LIMIT,
    )
    assert mx.array_equal(again.reshape(tokens, dim), got)


def _routing(logits: np.ndarray, routing: str, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top TOP experts and their scores, as qwen3_moe ('softmax_topk') or gpt_oss route."""
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
    top = np.take_along_axis(logits, idx, axis=-1)
    if routing == "topk_softmax":
        e = np.exp(top - top.max(-1, keepdims=True))
        return idx, e / e.sum(-1, keepdims=True)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    scores = np.take_along_axis(p / p.sum(-1, keepdims=True), idx, axis=-1)
    return idx, scores / scores.sum(-1, keepdims=True) if norm else scores


@pytest.mark.parametrize(
    "routing, norm", [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)]
)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_match_moe_routed_routes_as_thereference(routing: str, norm: bool, tokens: int) -> None:
    """The router inside the operation (8-bit g64 weights; gpt_oss's with a bias) against float64
    routing of the dequantized router, then the same expert MLP."""
    mx.random.seed(10 + tokens)
    dim, ffn = 448, 192
    kind, act = ("mxfp4", "swiglu_oai") if routing == "topk_softmax" else ("affine4", "swiglu")
    projections = [_projection(ffn, dim, kind, True), _projection(ffn, dim, kind, True)]
    projections.append(_projection(dim, ffn, kind, True))
    wq, scales, biases = mx.quantize(mx.random.normal((EXPERTS, dim)) * 0.03, group_size=64, bits=8)
    bias = mx.random.normal((EXPERTS,)) if routing == "topk_softmax" else None
    router = (wq, scales, biases, bias, 64, 8)
    x = mx.random.normal((tokens, dim))
    dense = np.array(mx.dequantize(wq, scales, biases, group_size=64, bits=8), dtype=np.float64)
    logits = router_input(x, 64) @ dense.T + (0 if bias is None else np.array(bias, dtype=np.float64))
    idx, scores = _routing(logits, routing, norm)
    got = _kernels().moe_routed(
        x,
        router,
        *projections,
        top_k=TOP,
        routing=routing,
        norm_topk_prob=norm,
        activation=act,
        alpha=ALPHA,
        limit=LIMIT,
    )
    assert got.shape == x.shape
    off = error(got, reference(x, mx.array(idx), mx.array(scores.astype(np.float32)), projections, act))
    assert off < TOLERANCE, off


def test_match_a_token_choosing_one_expert_twice_and_an_index_outside_adds_nothing() -> None:
    mx.random.seed(1)
    projections = [_projection(64, 128, "affine4", False) for _ in range(2)]
    projections.append(_projection(128, 64, "affine4", False))
    x = mx.random.normal((2, 128))
    idx = mx.array([[2, 2, 5], [0, EXPERTS, 3]])
    scores = mx.array([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    got = np.array(_kernels().moe_mlp(x, idx, scores, *projections), dtype=np.float64)
    kept = np.array([[2, 2, 5], [0, 0, 3]])
    zeroed = np.array([[0.5, 0.25, 0.25], [0.2, 0.0, 0.5]])
    assert (
        error(mx.array(got), reference(x, mx.array(kept), mx.array(zeroed), projections, "swiglu"))
        < TOLERANCE
    )


def test_bad_arguments_are_clear() -> None:
    k = _kernels()
    gate = _projection(64, 128, "affine4", False)
    down = _projection(128, 64, "affine4", False)
    x, idx, scores = mx.zeros((1, 128)), mx.zeros((1, 2), dtype=mx.int32), mx.ones((1, 2))
    with pytest.raises(ValueError, match="activation"):
        k.moe_mlp(x, idx, scores, gate, gate, down, activation="gelu")
    with pytest.raises(ValueError, match="down must take"):
        k.moe_mlp(x, idx, scores, gate, gate, gate)
    with pytest.raises(ValueError, match="x must be"):
        k.moe_mlp(mx.zeros((1, 64)), idx, scores, gate, gate, down)
    with pytest.raises(ValueError, match="indices and scores"):
        k.moe_mlp(x, idx, mx.ones((1, 3)), gate, gate, down)
    with pytest.raises(ValueError, match="gate and up"):
        k.moe_mlp(x, idx, scores, gate, _projection(64, 128, "mxfp4", False), down)
    router = (*mx.quantize(mx.zeros((EXPERTS, 128)), group_size=64, bits=8), None, 64, 8)
    with pytest.raises(ValueError, match="routing"):
        k.moe_routed(x, router, gate, gate, down, top_k=2, routing="sigmoid")
    with pytest.raises(ValueError, match="top_k"):
        k.moe_routed(x, router, gate, gate, down, top_k=EXPERTS + 1, routing="topk_softmax")


@pytest.mark.parametrize("isa", CAPS)
def test_each_narrower_instruction_set_passes_these_tests_too(isa: str) -> None:
    """The same products and activations with the kernels capped at each narrower set."""
    run_capped(__file__, capped_env(_kernels().kernel_name(), isa), "match")
