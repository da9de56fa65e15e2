"""Llama-family decoder layers on the CPU as three native operations each (a decode step), not ~27.

Each MLX operation costs 10-20 us of scheduling on the CPU stream and a few more of Python to
build, and mlx-lm's llama / qwen2 / qwen3 layer is ~27 of them per decode step. For SmolLM2-135M
(30 layers) that overhead was most of a token's time; the weights themselves take a third of it.
`fuse_decoder_layers` gives each layer whose products all run on the kernels (`kernel_layers`) a
`__call__` that does the same arithmetic with `decoder_head` (norm, q/k/v products written in the
layout attention reads) and `decoder_tail` (o product, residual, norm, gate/up, silu * up, down,
residual). In between, a decode step's rope, KV-cache write and attention are one more native
operation (`decode_attention`); prefill chunks, and caches it does not cover, keep mlx-lm's own.
qwen3_moe layers (same attention; the MLP a MoE block on `moe_blocks`' one operation) fuse their
head and attention the same way, their tail as o, residual, norm, that block and residual.
The result has the bits of the unfused layer (same kernels, same order);
tests/test_fused_layers.py holds it to that.

The layer keeps its class name, parameters and modules (only its class gets a mixin in front),
so sharding, `named_modules()` and the prefill's per-layer evaluation (`layer_eval`) see the same
model. `SHOAL_FUSED_LAYERS=0` leaves the layers as mlx-lm wrote them (benchmarks compare both).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from node.cpu.decode_attention import cached_attention
from node.cpu.kernel_layers import KernelQuantizedLinear
from node.cpu.layer_eval import _EvaluatedInPrefill
from node.cpu.mlx_lm_quirks import put_mixin

FUSABLE_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
"""The mlx-lm architectures whose `TransformerBlock` is the plain pre-norm llama layer fused here."""
MOE_LAYERS = (("mlx_lm.models.qwen3_moe", "Qwen3MoeDecoderLayer"),)
"""Layers with qwen3's attention whose MLP is a MoE block on one operation (`moe_blocks`): the head
and attention fuse as above; the tail is o, the residual, the norm, that block and the residual."""

Projection = tuple[mx.array, mx.array | None, mx.array | None, mx.array | None, int, int]


def fused_layers_enabled(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get("SHOAL_FUSED_LAYERS", "1")
    return value.strip().lower() not in ("0", "off", "no", "false")


def projection(layer: Any) -> Projection:
    # Item access throughout: a module is a dict, and `Module.__getattr__` (Python) for every
    # child and weight cost ~0.6 ms of the runner's main thread per SmolLM2 token.
    bias = layer.get("bias")
    if layer.bits == 16:
        return (layer["weight"], None, None, bias, 0, 16)
    return (layer["weight"], layer["scales"], layer._biases(), bias, layer.group_size, layer.bits)


def tail_args(block: Any) -> tuple[Any, ...]:
    """`decoder_tail`'s arguments after the attention output and x: o, norm weight and eps, gate, up, down."""
    attn, mlp, post = block["self_attn"], block["mlp"], block["post_attention_layernorm"]
    return (
        projection(attn["o_proj"]),
        post["weight"],
        post.eps,
        projection(mlp["gate_proj"]),
        projection(mlp["up_proj"]),
        projection(mlp["down_proj"]),
    )


def tensor_link(block: Any) -> Any:
    """The tensor-parallel link o's and down's outputs are summed over (`node.tensor`), or None."""
    return getattr(block["self_attn"]["o_proj"], "_shoal_link", None)


def _is_norm(module: Any) -> bool:
    return isinstance(module, nn.RMSNorm) and "weight" in module


def _moe_layer(layer: Any) -> bool:
    """A MOE_LAYERS layer whose MLP runs as one operation (`moe_blocks._FusedMoe`)."""
    kind = (type(layer).__module__, type(layer).__name__)
    return kind in MOE_LAYERS and getattr(layer.get("mlp"), "fused_moe", False)


def is_fusable(layer: Any) -> bool:
    """Whether `layer` is an mlx-lm llama-family block with every product on the kernels."""
    moe = _moe_layer(layer)
    if not moe and (
        type(layer).__name__ != "TransformerBlock" or type(layer).__module__ not in FUSABLE_MODULES
    ):
        return False
    attn, mlp = layer.get("self_attn"), layer.get("mlp")
    if (
        attn is None
        or mlp is None
        or not (_is_norm(layer.get("input_layernorm")) and _is_norm(layer.get("post_attention_layernorm")))
    ):
        return False
    heads = [attn.get(name) for name in ("q_proj", "k_proj", "v_proj")]
    tail = [attn.get("o_proj")]
    if not moe:
        tail += [mlp.get("gate_proj"), mlp.get("up_proj"), mlp.get("down_proj")]
    if not all(isinstance(p, KernelQuantizedLinear) for p in heads + tail):
        return False
    if any("bias" in p for p in tail):
        return False
    norms = [attn.get("q_norm"), attn.get("k_norm")]
    return all(n is None for n in norms) or all(_is_norm(n) for n in norms)


class _FusedBlock:
    """Mixed in before a fusable block's class: its `__call__` on `decoder_head` / `decoder_tail`."""

    _kernels: ModuleType

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        block: Any = self
        attn, norm = block["self_attn"], block["input_layernorm"]
        length = x.shape[1]
        q, k, v = self._kernels.decoder_head(
            x,
            norm["weight"],
            norm.eps,
            [projection(attn["q_proj"]), projection(attn["k_proj"]), projection(attn["v_proj"])],
            [attn.n_heads, attn.n_kv_heads, attn.n_kv_heads],
        )
        if "q_norm" in attn:  # qwen3: per-head norms (over head_dim, whatever the axis order)
            q, k = attn["q_norm"](q), attn["k_norm"](k)
        out = cached_attention(self._kernels, attn, q, k, v, cache, mask) if length == 1 else None
        if out is None:
            out = self._attention(q, k, v, cache, mask)
        if _moe_layer(block):  # o + residual, norm, the MoE block (one operation at decode), residual
            h = x + attn["o_proj"](out)
            y = h + block["mlp"](block["post_attention_layernorm"](h))
        else:
            y = self._kernels.decoder_tail(out, x, *tail_args(block), link=tensor_link(block))
        if length > 1 and isinstance(self, _EvaluatedInPrefill):
            mx.eval(y)  # what layer_eval's mixin (now behind this one) would do
        return y

    def _attention(self, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: Any) -> mx.array:
        """mlx-lm's own rope, cache update and attention; [B, L, H * D] out."""
        attn: Any = self.self_attn  # type: ignore[attr-defined]
        batch, _, length, _ = q.shape
        if cache is not None:
            q, k = attn.rope(q, offset=cache.offset), attn.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = attn.rope(q), attn.rope(k)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        # [B, H, 1, D] already is [B, 1, H * D] in memory; longer inputs need the transpose.
        if length == 1:
            return out.reshape(batch, 1, -1)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def fuse_decoder_layers(model: Any, kernels: ModuleType) -> int:
    """Give every fusable layer of `model.layers` the fused `__call__`; returns how many."""
    if not fused_layers_enabled() or not hasattr(kernels, "decoder_head"):
        return 0
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return 0
    fused = 0
    for layer in layers:
        if isinstance(layer, _FusedBlock) or not is_fusable(layer):
            continue
        put_mixin(layer, _FusedBlock, _kernels=kernels)
        fused += 1
    return fused
