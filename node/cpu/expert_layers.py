"""Mixture-of-experts layers that keep their experts as stored on Shoal's CPU kernels.

mlx-lm's `QuantizedSwitchLinear` (affine 4/8-bit, groups of 32/64/128; the experts of qwen3_moe,
mixtral, ...) calls `mx.gather_qmm`, whose CPU kernel is single-threaded and scalar, so without
this the weight policy dequantizes every expert to float32 (several times the stored bytes).
`KernelSwitchLinear` holds the very same arrays and multiplies with
`node.native._kernels.gather_matmul`: each token's rows times only its chosen experts' stored
rows, on all cores; `SwitchGLU` around it sorts many tokens by expert as before. Symmetric
experts (bias -2^(bits-1) x scale in every group) drop `biases`, as the dense layers do.
MXFP4 experts (mode "mxfp4": gpt_oss folders, GGUF MXFP4 imports; E2M1 codes, an E8M0 scale byte per
32, no biases) run as stored too: the kernels know them by their uint8 scales.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx

from node.cpu.kernel_layers import _KernelLayer, readable_quantization


def is_supported_switch(module: Any) -> bool:
    """Whether the kernels hold this expert layer as stored."""
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    except ImportError:
        return False
    if not isinstance(module, QuantizedSwitchLinear) or getattr(module, "global_scale", None) is not None:
        return False
    return readable_quantization(module)


class KernelSwitchLinear(_KernelLayer):
    """The call of `QuantizedSwitchLinear` (x [..., rows, K], indices [...]), float32 out."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self._kernels.gather_matmul(
            x, self.weight, self.scales, self._biases(), indices, group_size=self.group_size, bits=self.bits
        )
        return y + mx.expand_dims(self.bias[indices], -2) if "bias" in self else y


def switch_layer(kernels: ModuleType, module: Any) -> KernelSwitchLinear | None:
    """The replacement for an expert layer, or None when the kernels do not take it."""
    if not is_supported_switch(module):
        return None
    return KernelSwitchLinear(kernels, module, group_size=module.group_size, bits=module.bits)
