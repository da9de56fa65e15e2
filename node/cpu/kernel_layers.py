"""Layers that keep their weights as stored and multiply with Shoal's CPU kernels.

MLX's own CPU kernels for quantized and 16-bit matmuls are single-threaded and scalar (a 4-bit
Qwen3-0.6B shape decodes at ~0.3 tok/s here), so on the CPU each supported layer is swapped for
an equivalent one whose product is `node.native._kernels.weight_matmul` (an MLX primitive:
lazy, on MLX's CPU stream, all cores):

- `nn.QuantizedLinear` (affine, 4 or 8 bits, groups of 32/64/128;
  or MXFP4, known to the kernels by its uint8 E8M0 scales)         -> `KernelQuantizedLinear`
- `nn.QuantizedEmbedding` (same)                                  -> `KernelQuantizedEmbedding`
- `nn.Linear` / `nn.Embedding` with float16, bfloat16 or float32 -> `KernelDenseLinear` / `...Embedding`
  weights (float32: what a quantized file keeps so, such as GGUF's expert routers, whose products
  would otherwise wake the BLAS shim's threads, which then spin beside the kernels' at every step)

The replacements hold the very same arrays under the same names (`weight`, `scales`,
`biases`, `bias`), so memory stays at the stored size and nothing that walks parameters changes.
One exception: symmetric layers (GGUF Q4_0 and Q8_0, whose bias is -2^(bits-1) x scale in every
group) drop `biases`; the kernels derive it, which saves its bytes in memory and in every product
(Q4_0: 2 of 20 bytes per 32 weights).
Embeddings look rows up as MLX does and hand them on as float32; their `as_linear` (a tied
output head) runs on the kernels. Activations are float32 throughout.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
DENSE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def is_supported_quantized(module: Any) -> bool:
    """Whether the kernels hold this quantized layer as stored."""
    return isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding) and readable_quantization(module)


def readable_quantization(module: Any) -> bool:
    """Whether the kernels read a quantized layer's format (dense or experts): affine 4/8-bit in
    groups of 32/64/128 with biases, or MXFP4."""
    mode = getattr(module, "mode", "affine")
    if mode == "mxfp4":
        return is_mxfp4(module)
    return (
        mode == "affine"
        and module.bits in SUPPORTED_BITS
        and module.group_size in SUPPORTED_GROUPS
        and getattr(module, "biases", None) is not None
    )


def is_mxfp4(module: Any) -> bool:
    """MXFP4 as the kernels read it: 4-bit E2M1 codes, one uint8 E8M0 scale per 32, no biases."""
    return module.bits == 4 and module.group_size == 32 and module["scales"].dtype == mx.uint8


def is_plain_dense(module: Any) -> bool:
    """A plain Linear or Embedding with 16- or 32-bit float weights (K a multiple of 8, as every
    model has). Only models kept as stored come here: a float32 model stays on MLX and the shim."""
    return (
        type(module) in (nn.Linear, nn.Embedding)
        and module.weight.dtype in DENSE_DTYPES
        and module.weight.shape[-1] % 8 == 0
    )


def is_symmetric(scales: mx.array, biases: mx.array, bits: int) -> bool:
    """Whether every group's bias is -2^(bits-1) x its scale, exactly (GGUF Q4_0 and Q8_0 imports)."""
    return bool(mx.array_equal(biases, scales * -(2 ** (bits - 1))).item())


class _KernelLayer(nn.Module):
    """Shared: the kernels module and the product with this layer's stored weight."""

    def __init__(
        self, kernels: ModuleType, source: nn.Module, *, group_size: int = 0, bits: int = 16
    ) -> None:
        super().__init__()
        self._kernels = kernels
        self.group_size = group_size
        self.bits = bits
        # No biases at all (MXFP4: E8M0 scales) reads as symmetric: the kernels derive what they need.
        self.symmetric = bits < 16 and (
            source.get("biases") is None or is_symmetric(source["scales"], source["biases"], bits)
        )
        for key in ("weight", "scales", "biases", "bias"):
            if key in source and not (key == "biases" and self.symmetric):
                setattr(self, key, source[key])
        self.freeze()

    def _biases(self) -> mx.array | None:
        # By item: `Module.__getattr__` is Python, and decode steps ask for this on every layer.
        return None if self.symmetric else self["biases"]

    def _product(self, x: mx.array) -> mx.array:
        if self.bits == 16:
            return self._kernels.weight_matmul(x, self.weight)
        return self._kernels.weight_matmul(
            x, self.weight, self.scales, self._biases(), group_size=self.group_size, bits=self.bits
        )


class KernelQuantizedLinear(_KernelLayer):
    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y


class KernelDenseLinear(KernelQuantizedLinear):
    """Same call as the quantized one: the kernels tell the layouts apart by the weight's dtype
    (`bits` 16 stands for every dense one)."""


class KernelQuantizedEmbedding(_KernelLayer):
    def __call__(self, ids: mx.array) -> mx.array:
        # float32 scales first: mx.dequantize computes in their dtype, and bf16 rows would round
        # every embedding (greedy text then differs from the float32 weights at near-ties).
        if self.scales.dtype == mx.uint8:  # MXFP4
            rows = mx.dequantize(self.weight[ids], self.scales[ids], group_size=32, bits=4, mode="mxfp4")
            return rows.astype(mx.float32)
        scales = self.scales[ids].astype(mx.float32)
        stored = self._biases()
        biases = scales * -(2 ** (self.bits - 1)) if stored is None else stored[ids].astype(mx.float32)
        return mx.dequantize(self.weight[ids], scales, biases, group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)


class KernelDenseEmbedding(_KernelLayer):
    def __call__(self, ids: mx.array) -> mx.array:
        return self.weight[ids].astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)


def kernel_layer(kernels: ModuleType, module: Any) -> nn.Module | None:
    """The replacement for `module`, or None when the kernels do not take it."""
    if is_supported_quantized(module):
        cls = KernelQuantizedEmbedding if isinstance(module, nn.QuantizedEmbedding) else KernelQuantizedLinear
        return cls(kernels, module, group_size=module.group_size, bits=module.bits)
    if is_plain_dense(module):
        dense = KernelDenseEmbedding if isinstance(module, nn.Embedding) else KernelDenseLinear
        return dense(kernels, module)
    return None
