"""How far a kernel product may be from the float64 product of the same weights, as the kernel
tests measure it: relative to the product's own scale |x| @ |w| (outputs can cancel to ~0).

Where the rows kernel rounds quantized weights' activations to int8 (native/kernels/kernels.h, Acts),
each x moves by at most half its group's step, max |x| / 254: an error the test knows exactly,
so it allows that bound (|w| @ half steps) and holds the rest to float rounding (RELATIVE). A
wrong layout, scale or bias gives errors of the product's own size, far past both."""

from __future__ import annotations

import numpy as np

from node.native import load_kernels

RELATIVE = 1e-4
"""Float rounding left after the int8 bound (int16 activations alone stay near 1e-5)."""


def int8_rows(bits: int, experts: bool = False) -> bool:
    """Whether the kernels round x to int8 for `bits`-bit weights (decode's rows kernel and
    prefill's gemm alike; 16-bit weights take x as it is): in experts' products (moe_mlp,
    moe_routed, gather_matmul; by default where the CPU has int8 bodies) or in the rest
    (SHOAL_KERNEL_ACTS=int8 only)."""
    module = load_kernels().module
    if module is None or bits not in (4, 8):
        return False
    return bool(module.expert_int8_activations() if experts else module.int8_activations())


def half_steps(x: np.ndarray, group: int) -> np.ndarray:
    """Half the int8 step of each x's group, max |x| / 254, per element of x [..., K]."""
    steps = np.abs(x).reshape(*x.shape[:-1], -1, group).max(axis=-1) / 254.0
    return np.repeat(steps, group, axis=-1)


def int8_rounded(x: np.ndarray, group: int) -> np.ndarray:
    """x [..., K] as the int8 rows kernel sees it: rounded per group to max |x| / 127 a step (for
    references through a nonlinearity, where a bound on each product does not carry over)."""
    shaped = x.reshape(*x.shape[:-1], -1, group)
    step = np.abs(shaped).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(step > 0, step, 1.0)
    return (np.round(shaped / safe) * step).reshape(x.shape)


def excess(got: object, x: object, w_t: object, group: int, rounded: bool) -> float:
    """The largest error of got = x @ w_t ([..., K] @ [..., K, N]) past what int8 rounding of x
    may move it (when `rounded`), relative to |x| @ |w_t|."""
    x64 = np.asarray(x, dtype=np.float64)
    w64 = np.asarray(w_t, dtype=np.float64)
    want = x64 @ w64
    error = np.abs(np.asarray(got, dtype=np.float64) - want)
    assert error.shape == want.shape, (error.shape, want.shape)
    if rounded:
        error = np.maximum(error - half_steps(x64, group) @ np.abs(w64), 0.0)
    scale = max(float((np.abs(x64) @ np.abs(w64)).max()), 1e-30)
    return float(error.max() / scale)
