"""`mx.fast.rms_norm`, `rope` and `scaled_dot_product_attention` on Shoal's fused CPU kernels.

MLX 0.32 has no CPU kernels for these three: on the CPU each runs its fallback graph of 10-30
tiny ops (measured in a graph: rms_norm of one 576-vector 47 us, rope of 9 heads 124 us, decode
attention over 80 keys 166 us, against 6.5 us for `x + 1`), about half of SmolLM2-135M's decode
step. `node.native._kernels` has one-pass primitives for them (native/kernels/fused.cpp).

`install_fused_ops` replaces the three functions in `mx.fast`, and `nn.silu`, for the whole
process by wrappers: a call the kernels cover (default device the CPU, float32, shapes and masks
below) goes to the kernel, any other to the original function with the same arguments. mlx-lm
and mlx.nn look them up at call time (`nn.RMSNorm`, `nn.RoPE`, `rope_utils.Llama3RoPE`,
`models.base.scaled_dot_product_attention`, `models.activations.swiglu` when it is traced), so
every model picks the wrappers up.

Covered natively: rms_norm of float32 x with no weight or a 1-D float one; rope of float32 x with
ndim >= 3, even dims, base or freqs, an int offset or an integer array of 1 or x.shape[0] offsets;
attention with float32 q and float32 or float16 k/v (`node.cpu.kv_cache`), any number of queries
(decode and prefill: the kernel streams keys per block of queries, never materialising the scores;
at 512 prompt tokens it ran in 21 ms where the fallback took 170-775 ms), mask None, "causal", a
bool or float32 array, sinks or none; `nn.silu` of float32 arrays (MLX's CPU sigmoid is scalar: 113
ms for a prefill MLP's 512 x 8192 gate, 1.9 ms here); `mx.logsumexp` of float32 over the last axis
(mlx-lm's generators normalize every decode step's logits with it: 690 us over a 49k vocabulary in
MLX, whose exp is scalar too, 32 us here). Everything else (16-bit activations, an explicit stream,
other axes) is MLX's own.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
"""Norm weights of these types are cast to float32, as MLX does for float32 activations."""
_CPU = mx.Device(mx.DeviceType.cpu)
_NAMES = ("rms_norm", "rope", "scaled_dot_product_attention")
_OWNERS: dict[str, Any] = {"silu": nn, "logsumexp": mx}
"""Where each replaced function lives: `mx.fast` unless named here."""
_originals: dict[str, Callable[..., Any]] = {}
_description = ""


def _on_cpu(stream: object) -> bool:
    return stream is None and mx.default_device() == _CPU


def _make_rms_norm(kernels: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    native = kernels.rms_norm

    def rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream: Any = None) -> mx.array:
        if (
            _on_cpu(stream)
            and x.dtype == mx.float32
            and x.ndim >= 1
            and (
                weight is None
                or (weight.ndim == 1 and weight.size == x.shape[-1] and weight.dtype in _FLOATS)
            )
        ):
            return native(x, weight, eps)
        return original(x, weight, eps, stream=stream)

    return rms_norm


def _offset_ok(offset: object, batch: int) -> bool:
    if isinstance(offset, int) and not isinstance(offset, bool):
        return True
    return (
        isinstance(offset, mx.array)
        and mx.issubdtype(offset.dtype, mx.integer)
        and offset.ndim <= 1
        and offset.size in (1, batch)
    )


def _make_rope(kernels: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    native = kernels.rope

    def rope(
        a: mx.array,
        dims: int,
        *,
        traditional: bool,
        base: float | None,
        scale: float,
        offset: int | mx.array,
        freqs: mx.array | None = None,
        stream: Any = None,
    ) -> mx.array:
        if (
            _on_cpu(stream)
            and a.dtype == mx.float32
            and a.ndim >= 3
            and 0 < dims <= a.shape[-1]
            and dims % 2 == 0
            and (base is None) != (freqs is None)
            and _offset_ok(offset, a.shape[0])
        ):
            return native(
                a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
            )
        return original(
            a,
            dims,
            traditional=traditional,
            base=base,
            scale=scale,
            offset=offset,
            freqs=freqs,
            stream=stream,
        )

    return rope


def _mask_ok(mask: object) -> bool:
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    return isinstance(mask, mx.array) and mask.ndim <= 4 and mask.dtype in (mx.bool_, mx.float32)


def _make_sdpa(kernels: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    native = kernels.scaled_dot_product_attention

    def scaled_dot_product_attention(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        *,
        scale: float,
        mask: str | mx.array | None = None,
        sinks: mx.array | None = None,
        force_fused: bool = False,
        stream: Any = None,
    ) -> mx.array:
        if (
            _on_cpu(stream)
            and not force_fused
            and q.ndim == 4
            and q.dtype == mx.float32
            and k.dtype == v.dtype
            and k.dtype in (mx.float32, mx.float16)
            and (sinks is None or sinks.dtype == mx.float32)
            and _mask_ok(mask)
        ):
            return native(q, k, v, scale=scale, mask=mask, sinks=sinks)
        extra: dict[str, Any] = {"force_fused": True} if force_fused else {}
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **extra)

    return scaled_dot_product_attention


def _make_silu(kernels: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    native = kernels.silu

    def silu(x: mx.array) -> mx.array:
        # Any size: mlx-lm's swiglu is compiled shapeless, so its first trace serves every shape.
        if mx.default_device() == _CPU and x.dtype == mx.float32:
            return native(x)
        return original(x)

    return silu


def _make_logsumexp(kernels: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    native = kernels.logsumexp

    def logsumexp(a: mx.array, axis: Any = None, keepdims: bool = False, *, stream: Any = None) -> mx.array:
        if isinstance(axis, (list, tuple)) and len(axis) == 1:
            axis = axis[0]
        if axis is None and isinstance(a, mx.array) and a.ndim >= 1 and a.size == a.shape[-1]:
            # One row (generate_step's and a pipeline's last stage's call): the same sum, as a scalar
            # unless keepdims.
            out = logsumexp(a, -1, keepdims, stream=stream)
            return out if keepdims else out.reshape(())
        if (
            _on_cpu(stream)
            and isinstance(a, mx.array)
            and a.dtype == mx.float32
            and a.ndim >= 1
            and a.shape[-1] > 0
            and isinstance(axis, int)
            and axis in (-1, a.ndim - 1)
        ):
            return native(a, keepdims=keepdims)
        return original(a, axis=axis, keepdims=keepdims, stream=stream)

    return logsumexp


def install_fused_ops(kernels: ModuleType) -> str:
    """Route `mx.fast`'s three CPU fallbacks to `kernels` in this process; returns a log phrase.

    Idempotent (a second call changes nothing and returns the same phrase). A kernels module
    built without the fused ops leaves `mx.fast` alone and says so.
    """
    global _description
    if _originals:
        return _description
    if not all(hasattr(kernels, name) for name in _NAMES):
        return "no fused rms_norm/rope/attention (the kernels were built without them)"
    makers = {"rms_norm": _make_rms_norm, "rope": _make_rope, "scaled_dot_product_attention": _make_sdpa}
    for name in _NAMES:
        original = getattr(mx.fast, name)
        _originals[name] = original
        setattr(mx.fast, name, makers[name](kernels, original))
    # mlx-lm's swiglu looks nn.silu up when it is traced, its generators mx.logsumexp at each step.
    for name, maker in (("silu", _make_silu), ("logsumexp", _make_logsumexp)):
        if hasattr(kernels, name):
            _originals[name] = getattr(_OWNERS[name], name)
            setattr(_OWNERS[name], name, maker(kernels, _originals[name]))
    loops = kernels.fused_kernel_name() if hasattr(kernels, "fused_kernel_name") else "native"
    _description = f"fused rms_norm/rope/attention/silu/logsumexp on the CPU ({loops} loops)"
    return _description


def uninstall_fused_ops() -> None:
    """Put MLX's own functions back (tests; a runner never needs it)."""
    global _description
    for name, original in _originals.items():
        setattr(_OWNERS.get(name, mx.fast), name, original)
    _originals.clear()
    _description = ""


def original_op(name: str) -> Callable[..., Any]:
    """MLX's own `mx.fast.<name>` (or `nn.silu`, `mx.logsumexp`), installed or not (the reference
    in tests and benchmarks)."""
    return _originals.get(name) or getattr(_OWNERS.get(name, mx.fast), name)
