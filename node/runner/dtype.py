"""Load-time weight dtype policy: run the weights in the dtype that is fastest on the device.

On the CPU that is float32: MLX's float32 matmuls go to BLAS (an optimized OpenBLAS on the fast
path, see `node.runner.fastpath`), while its bfloat16, float16 and quantized CPU kernels are
single-threaded and 10-50x slower here (a 4-bit model with bf16 scales decodes at ~0.3 tok/s on a
Qwen3-0.6B shape). So on the CPU, when memory allows, bf16/fp16 parameters are converted to
float32 and quantized layers (`QuantizedLinear`, `QuantizedEmbedding`, mlx-lm's
`QuantizedSwitchLinear`) are dequantized to their float32 dense equivalents. On a GPU (Metal,
CUDA) the weights stay as stored: there the quantized and half-precision kernels are the fast ones.

The model must come from `mlx_lm.load(..., lazy=True)`: nothing is read from disk until this
module evaluates it, one layer at a time, so the peak is about the float32 size, not stored plus
float32. It always ends with every parameter evaluated. It logs one line saying what it chose
and why, and never raises for a policy reason (a model that cannot be converted stays as stored).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

log = logging.getLogger("shoal.runner")

HEADROOM_FRACTION = 0.2
"""Kept free beyond the float32 weights, as a fraction of them: KV cache and activations grow with
the model (Qwen3-0.6B's float32 KV cache for 4096 tokens is ~0.9 GB, 40% of its weights)."""
HEADROOM_MIN_BYTES = 512 * 1024**2
"""Kept free at least: the Python runtime, tokenizer and MLX's buffers."""

_MEMINFO = Path("/proc/meminfo")
_CGROUP_MEMORY = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class DtypeDecision:
    converted: bool
    stored: str
    """What the checkpoint holds, e.g. "bfloat16", "4-bit affine + bfloat16", "float32"."""
    message: str
    """The log line."""


def available_memory_bytes(meminfo: Path = _MEMINFO, cgroup: Path = _CGROUP_MEMORY) -> int | None:
    """Memory a new allocation can get: MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    available: int | None = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def _quantized_classes() -> tuple[type, ...]:
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    except ImportError:
        return (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


def _dense_weight_shape(module: Any) -> tuple[int, ...]:
    """Shape of a quantized module's weight once dequantized: packed uint32 words hold 32/bits each."""
    *lead, packed = module.weight.shape
    return (*lead, packed * 32 // module.bits)


def _is_float(a: mx.array) -> bool:
    return bool(mx.issubdtype(a.dtype, mx.floating))


def _flat(module: nn.Module) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))


def _plain_parameters(model: nn.Module, quantized: list[tuple[str, Any]]) -> list[mx.array]:
    """The model's float parameters outside its quantized modules."""
    inside = {f"{name}.{key}" for name, module in quantized for key, _ in _flat(module)}
    return [v for k, v in _flat(model) if k not in inside and _is_float(v)]


def _float_bytes(model: nn.Module, quantized: list[tuple[str, Any]]) -> int:
    """Bytes of the model's weights once every float and quantized parameter is float32."""
    total = sum(value.size * 4 for value in _plain_parameters(model, quantized))
    for _, module in quantized:
        size = 1
        for dim in _dense_weight_shape(module):
            size *= dim
        bias = module.get("bias")
        total += size * 4 + (bias.size * 4 if bias is not None else 0)
    return total


def _describe(model: nn.Module, quantized: list[tuple[str, Any]]) -> str:
    """What the checkpoint holds, e.g. "4-bit affine + bfloat16"."""
    kinds = sorted({f"{m.bits}-bit {m.mode}" for _, m in quantized})
    floats = sorted({str(v.dtype).removeprefix("mlx.core.") for v in _plain_parameters(model, quantized)})
    return " + ".join(kinds + floats) or "no parameters"


def _dequantized(module: Any) -> nn.Module:
    """The float32 dense module equivalent to one quantized module (evaluated)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    def f32(a: mx.array) -> mx.array:
        return a.astype(mx.float32) if _is_float(a) else a

    biases = getattr(module, "biases", None)

    extra: dict[str, Any] = {}
    if (scale := getattr(module, "global_scale", None)) is not None:
        extra["global_scale"] = scale
    weight = mx.dequantize(
        module.weight,
        f32(module.scales),
        None if biases is None else f32(biases),
        module.group_size,
        module.bits,
        module.mode,
        dtype=mx.float32,
        **extra,
    )
    bias = module.get("bias")
    dense: nn.Module
    if isinstance(module, nn.QuantizedEmbedding):
        dense = nn.Embedding(weight.shape[0], weight.shape[1])
    elif isinstance(module, nn.QuantizedLinear):
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    else:
        dense = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias=bias is not None)
    dense.weight = weight
    if bias is not None:
        dense.bias = bias.astype(mx.float32)
    mx.eval(dense.parameters())
    return dense


def _to_float32(model: nn.Module, quantized: list[tuple[str, Any]]) -> None:
    """Dequantize and upcast in place, one module at a time so that the peak stays near float32."""
    for name, module in quantized:
        model.update_modules(tree_unflatten([(name, _dequantized(module))]))
    for _, module in model.named_modules():
        own = {k: v for k, v in module.items() if isinstance(v, mx.array)}
        if changed := {k: v.astype(mx.float32) for k, v in own.items() if _is_float(v)}:
            module.update(changed)
            mx.eval(list(changed.values()))
    model.set_dtype(mx.float32)  # anything held outside a module's own attributes (no-op otherwise)


def apply_dtype_policy(
    model: nn.Module, *, device: mx.Device | None = None, available: int | None = None
) -> DtypeDecision:
    """Convert `model` (loaded lazily) for `device` (default: MLX's), evaluate it, log the choice.

    `available` is the free memory in bytes (default: measured; if unknown, convert).
    """
    device = mx.default_device() if device is None else device
    quantized = [(name, m) for name, m in model.named_modules() if isinstance(m, _quantized_classes())]
    stored = _describe(model, quantized)
    decision = _decide(model, quantized, stored, device, available)
    if decision.converted:
        _to_float32(model, quantized)
    mx.eval(model.parameters())
    log.info("%s", decision.message)
    return decision


def _decide(
    model: nn.Module, quantized: list[tuple[str, Any]], stored: str, device: mx.Device, available: int | None
) -> DtypeDecision:
    if device.type != mx.DeviceType.cpu:
        message = f"weights: {stored} as stored (on the GPU the stored dtype is fastest)"
        return DtypeDecision(False, stored, message)
    if stored == "float32":
        return DtypeDecision(False, stored, "weights: float32 as stored (the fastest dtype on the CPU)")
    need = _float_bytes(model, quantized)
    headroom = max(HEADROOM_MIN_BYTES, int(need * HEADROOM_FRACTION))
    free = available_memory_bytes() if available is None else available
    gb = 1e9
    if free is not None and need + headroom > free:
        return DtypeDecision(
            False,
            stored,
            f"weights: {stored} as stored, NOT converted to float32 (the fastest dtype on the CPU): "
            f"float32 needs {need / gb:.1f} GB + {headroom / gb:.1f} GB headroom, only "
            f"{free / gb:.1f} GB available; expect slow CPU kernels",
        )
    action = "dequantized" if quantized else "converted"
    memory = "available memory unknown" if free is None else f"{free / gb:.1f} GB available"
    return DtypeDecision(
        True,
        stored,
        f"weights: float32, {action} at load from {stored} (float32 is the fastest dtype on the CPU; "
        f"{need / gb:.2f} GB, {memory})",
    )
