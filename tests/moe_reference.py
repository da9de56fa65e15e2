"""The plain float64 expert MLP that moe_mlp / moe_routed are checked against (decode and prefill):
each (token, expert) pair's gate and up products of the dequantized experts, the activation, down,
the sum weighted by the scores; an index outside the experts adds nothing.

Where the kernels round activations to int8 (tests/kernel_error.py), x is rounded here exactly as
they do (it comes in as it is), while h is the kernel's only within float error, so its rounding
is bounded instead (`slack`) rather than copied."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from tests.kernel_error import half_steps, int8_rounded, int8_rows

ALPHA, LIMIT = 1.702, 1.5
"""gpt_oss's clamped SwiGLU (its limit is 7; 1.5 clamps many of these gate and up values)."""
TOLERANCE = 4e-4
"""Of max |y|, past the int8 slack: float rounding and int16 activations (a wrong activation: > 0.4)."""


def dense(p: tuple[Any, ...]) -> np.ndarray:
    """An expert projection (w, scales, biases, bias, group, bits) as float64 [E, N, K]: MXFP4
    (uint8 scales, no biases), symmetric (no biases: b = -2^(bits-1) s) or affine."""
    wq, scales, biases, _, group, bits = p
    if biases is None and scales.dtype == mx.uint8:
        w = mx.dequantize(wq, scales, group_size=group, bits=bits, mode="mxfp4")
    else:
        s = scales.astype(mx.float32)
        b = -(2 ** (bits - 1)) * s if biases is None else biases.astype(mx.float32)
        w = mx.dequantize(wq, s, b, group_size=group, bits=bits)
    return np.array(w.astype(mx.float32), dtype=np.float64)


def reference(
    x: Any, idx: Any, scores: Any, projections: list[tuple[Any, ...]], activation: str
) -> tuple[np.ndarray, np.ndarray]:
    """The MLP's output [T, D] and each output's int8 slack (zeros where x stays int16)."""
    gate, up, down = (dense(p) for p in projections)
    gate_bias, up_bias, down_bias = (
        np.zeros(p[0].shape[:2]) if p[3] is None else np.array(p[3], np.float64) for p in projections
    )
    xs = np.array(x, dtype=np.float64)
    rounded = int8_rows(projections[0][5], experts=True)
    seen = int8_rounded(xs, projections[0][4]) if rounded else xs
    ids, ss = np.array(idx), np.array(scores, dtype=np.float64)
    out, slack = np.zeros_like(xs), np.zeros_like(xs)
    for t in range(xs.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= gate.shape[0]:
                continue
            g, u = gate[e] @ seen[t] + gate_bias[e], up[e] @ seen[t] + up_bias[e]
            if activation == "swiglu":
                h = g / (1 + np.exp(-g)) * u
            else:
                g = np.minimum(g, LIMIT)
                h = (np.clip(u, -LIMIT, LIMIT) + 1) * g / (1 + np.exp(-ALPHA * g))
            out[t] += ss[t, j] * (down[e] @ h + down_bias[e])
            if rounded:
                slack[t] += abs(ss[t, j]) * (np.abs(down[e]) @ half_steps(h, projections[2][4]))
    return out, slack


def router_input(x: Any, group: int) -> np.ndarray:
    """x as a quantized router's product sees it (int8-rounded where the kernels round it), so
    the reference routes as the kernels do rather than tipping near-ties the other way."""
    xs = np.array(x, dtype=np.float64)
    return int8_rounded(xs, group) if int8_rows(8) else xs


def error(got: Any, ref: tuple[np.ndarray, np.ndarray]) -> float:
    """The largest error past the int8 slack, relative to max |y|."""
    want, slack = ref
    excess = np.maximum(np.abs(np.array(got, dtype=np.float64) - want) - slack, 0.0)
    return float(excess.max() / np.abs(want).max())
