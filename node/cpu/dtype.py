"""Load-time weight policy: keep weights as stored where Shoal's kernels read them fast.

On the CPU, MLX's own bfloat16, float16 and quantized kernels are single-threaded and scalar
(a 4-bit Qwen3-0.6B shape decodes at ~0.3 tok/s here). So:

1. With the native kernels (`node.native`, built at install), affine 4/8-bit and MXFP4 layers
   and 16-bit Linear/Embedding layers stay as stored and multiply on the kernels
   (`node.cpu.kernel_layers`): memory is the stored size and decode reads the stored bytes; so do
   affine 4/8-bit and MXFP4 experts (`node.cpu.expert_layers`). What the kernels cannot hold
   (other bit widths, nvfp4/mxfp8, experts with a global scale) is
   dequantized to float32 when memory allows, and small float parameters (norms, biases) become
   float32, the activations' dtype.
2. Without them (not built, `--no-fast-path`, SHOAL_KERNELS=0), as before: bf16/fp16 parameters
   become float32 and quantized layers their float32 dense equivalents, whose matmuls go to
   OpenBLAS through the BLAS shim (`node.cpu.fastpath`), when memory allows.

On a GPU (Metal, CUDA) the weights stay as stored: there MLX's own kernels are the fast ones.
The model must come from `mlx_lm.load(..., lazy=True)`, so that conversion reads each weight
once. It always ends with every parameter evaluated, logs one line saying what it chose and why,
and never raises for a policy reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from node.cpu.calibration import calibrate
from node.cpu.expert_layers import KernelSwitchLinear, switch_layer
from node.cpu.fused import install_fused_ops
from node.cpu.fused_layers import fuse_decoder_layers
from node.cpu.fused_stack import stack_decoder
from node.cpu.kernel_layers import (
    KernelDenseEmbedding,
    KernelDenseLinear,
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    kernel_layer,
)
from node.cpu.kv_cache import install_kv_cache
from node.cpu.layer_eval import evaluate_layers_in_prefill
from node.cpu.memory import available_memory_bytes
from node.cpu.moe_blocks import fuse_moe_blocks
from node.native import KernelLoad, load_kernels

log = logging.getLogger("shoal.runner")

HEADROOM_FRACTION = 0.2
"""Kept free beyond the float32 weights, as a fraction of them: KV cache and activations grow with
the model (Qwen3-0.6B's float32 KV cache for 4096 tokens is ~0.9 GB, 40% of its weights)."""
HEADROOM_MIN_BYTES = 512 * 1024**2
"""Kept free at least: the Python runtime, tokenizer and MLX's buffers."""

KERNEL_LAYERS = (
    KernelQuantizedLinear,
    KernelDenseLinear,
    KernelQuantizedEmbedding,
    KernelDenseEmbedding,
    KernelSwitchLinear,
)


@dataclass(frozen=True)
class DtypeDecision:
    converted: bool
    stored: str
    """What the checkpoint holds, e.g. "bfloat16", "4-bit affine + bfloat16", "float32"."""
    message: str
    """The log line."""
    kernels: bool = False
    """Whether the big weights stay as stored on Shoal's CPU kernels."""


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


def _dense_bytes(module: Any) -> int:
    """Bytes of one quantized module once dequantized to float32."""
    size = 1
    for dim in _dense_weight_shape(module):
        size *= dim
    bias = module.get("bias")
    return size * 4 + (bias.size * 4 if bias is not None else 0)


def _float_bytes(model: nn.Module, quantized: list[tuple[str, Any]]) -> int:
    """Bytes of the model's weights once every float and quantized parameter is float32."""
    plain = sum(value.size * 4 for value in _plain_parameters(model, quantized))
    return plain + sum(_dense_bytes(module) for _, module in quantized)


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


def rounds_to_int8(model: nn.Module | None) -> bool:
    """Whether some of this model's quantized products round activations to int8 in this process
    (native/kernels/kernels.h, Acts: experts' by default, every one with SHOAL_KERNEL_ACTS=int8): a
    prefill chunk and a decode step then differ by more than their float sums' last bits (a
    rounding can tip), enough to turn a near-tie, so a failover replays step by step (`Admitted`).
    A pipeline's first stage answers for its instance: a MoE model has experts in every stage."""
    if model is None or not kernels_enabled() or (module := load_kernels().module) is None:
        return False
    experts, others = module.expert_int8_activations(), module.int8_activations()
    dense = (KernelQuantizedLinear, KernelQuantizedEmbedding)
    return any(
        (experts and isinstance(m, KernelSwitchLinear)) or (others and isinstance(m, dense) and m.bits < 16)
        for _, m in model.named_modules()
    )


def kernels_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when the user turned the fast path off: `--no-fast-path` puts SHOAL_KERNELS=0 in the
    runner's environment (`node.cpu.fastpath.decide`); SHOAL_FAST_PATH=0 does the same."""
    environ = os.environ if environ is None else environ
    off = ("0", "off", "no", "false")
    return all(
        environ.get(name, "1").strip().lower() not in off for name in ("SHOAL_FAST_PATH", "SHOAL_KERNELS")
    )


def apply_dtype_policy(
    model: nn.Module,
    *,
    device: mx.Device | None = None,
    available: int | None = None,
    kernels: KernelLoad | None = None,
) -> DtypeDecision:
    """Prepare `model` (loaded lazily) for `device` (default: MLX's), evaluate it, log the choice.

    `available` is the free memory in bytes (default: `node.cpu.memory`'s probe, as placement). `kernels`
    is the native kernels' load result (default: `load_kernels()` unless turned off).
    """
    device = mx.default_device() if device is None else device
    quantized = [(name, m) for name, m in model.named_modules() if isinstance(m, _quantized_classes())]
    stored = _describe(model, quantized)
    if device.type != mx.DeviceType.cpu:
        message = f"weights: {stored} as stored (on the GPU the stored dtype is fastest)"
        decision = DtypeDecision(False, stored, message)
    else:
        evaluate_layers_in_prefill(model)  # prefill's peak memory: one layer's, not a chunk's graph
        if kernels is None:
            kernels = load_kernels() if kernels_enabled() else KernelLoad(None, "turned off by configuration")
        if kernels.module is not None:
            # Every CPU model gains from these (float32 ones too); process-wide, idempotent.
            log.info("%s; %s", install_fused_ops(kernels.module), install_kv_cache())
        if kernels.module is not None and stored != "float32":
            decision = _keep_as_stored(model, kernels, stored, available)
        else:
            decision = _decide(model, quantized, stored, available, kernels.reason)
            if decision.converted:
                _to_float32(model, quantized)
    mx.eval(model.parameters())
    if decision.kernels and kernels is not None and kernels.module is not None:
        log.info("%s", calibrate(model, kernels.module))
    log.info("%s", decision.message)  # last: what the runner did with the weights
    return decision


def _keep_as_stored(
    model: nn.Module, kernels: KernelLoad, stored: str, available: int | None
) -> DtypeDecision:
    """Swap in the kernel layers; what they cannot hold goes to float32 as before."""
    assert kernels.module is not None
    swapped = []
    for name, module in model.named_modules():
        layer = kernel_layer(kernels.module, module)
        if layer is None:  # (not `or`: a Module is a dict, an empty one is falsy)
            layer = switch_layer(kernels.module, module)
        if layer is not None:
            swapped.append((name, layer))
    if swapped:
        model.update_modules(tree_unflatten(swapped))
    rest = [(name, m) for name, m in model.named_modules() if isinstance(m, _quantized_classes())]
    need = sum(_dense_bytes(m) for _, m in rest)
    free = available_memory_bytes() if available is None else available
    note = ""
    if rest and need + HEADROOM_MIN_BYTES > free:
        note = f"; {len(rest)} other quantized layers stay on MLX's slow kernels (no memory for float32)"
        rest = []
    elif rest:
        note = f"; {len(rest)} quantized layers the kernels cannot hold dequantized to float32"
    for name, module in rest:
        model.update_modules(tree_unflatten([(name, _dequantized(module))]))
    _small_to_float32(model)
    moe = fuse_moe_blocks(model, kernels.module)  # first: fused decoder layers may hold these blocks
    fused = fuse_decoder_layers(model, kernels.module)
    if fused:
        note += f"; {fused} decoder layers fused"
    if moe:
        note += f"; {moe} expert MLPs one operation at decode"
    if stack_decoder(model, kernels.module):
        note += " (a decode step's layers as one operation)"
    held = sum(v.nbytes for _, layer in swapped for _, v in _flat(layer))
    return DtypeDecision(
        False,
        stored,
        f"weights: {stored} kept as stored in {len(swapped)} layers on Shoal's CPU kernels "
        f"({kernels.reason}; {held / 1e9:.2f} GB){note}",
        kernels=True,
    )


def _small_to_float32(model: nn.Module) -> None:
    """Float parameters outside the kernel layers (norms, biases) to float32: the activations' dtype."""
    for _, module in model.named_modules():
        if isinstance(module, KERNEL_LAYERS):
            continue
        own = {k: v for k, v in module.items() if isinstance(v, mx.array)}
        if changed := {k: v.astype(mx.float32) for k, v in own.items() if _is_float(v)}:
            module.update(changed)
            mx.eval(list(changed.values()))


def _decide(
    model: nn.Module, quantized: list[tuple[str, Any]], stored: str, available: int | None, no_kernels: str
) -> DtypeDecision:
    if stored == "float32":
        return DtypeDecision(False, stored, "weights: float32 as stored (the fastest dtype on the CPU)")
    need = _float_bytes(model, quantized)
    headroom = max(HEADROOM_MIN_BYTES, int(need * HEADROOM_FRACTION))
    free = available_memory_bytes() if available is None else available
    gb = 1e9
    if need + headroom > free:
        return DtypeDecision(
            False,
            stored,
            f"weights: {stored} as stored, NOT converted to float32 ({no_kernels}): "
            f"float32 needs {need / gb:.1f} GB + {headroom / gb:.1f} GB headroom, only "
            f"{free / gb:.1f} GB available; expect slow CPU kernels",
        )
    action = "dequantized" if quantized else "converted"
    return DtypeDecision(
        True,
        stored,
        f"weights: float32, {action} at load from {stored} ({no_kernels}; {need / gb:.2f} GB, "
        f"{free / gb:.1f} GB available)",
    )
