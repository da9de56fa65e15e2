"""Mixture-of-experts MLPs as one native operation, not ~15.

mlx-lm's `SwitchGLU` runs a decode step's experts as broadcasts, three expert products, the
activation and, in the block around it, the weighting by the router's scores and the sum: each an
MLX operation that costs 10-20 us of scheduling on the CPU, as much as the products of a small
expert. `fuse_moe_blocks` gives each qwen3_moe `Qwen3MoeSparseMoeBlock` and gpt_oss `MLPBlock`
whose experts all run on the kernels (`expert_layers.KernelSwitchLinear`) a `__call__` that
hands x to `moe_routed`: the router product, each token's top k and scores as mlx-lm computes
them, then gate and up of every chosen expert as one pool job, the activation, down, the weighted
sum. A router not on the kernels routes in MLX ops, then `moe_mlp` does the rest.

Prefill chunks take the same operations: past the kernels' row block (kMaxRows, 8 tokens) they
group the (token, expert) pairs by expert and run all experts' products as a few pool jobs a
layer (native/kernels/moe_prefill.h), where mlx-lm's path sorts and copies x for each of its three
expert products and runs the activation, weighting and sum as MLX ops over [tokens, k, ...].

Like `fused_layers`, only the block's class changes (a mixin in front): parameters, modules and
sharding see the same model. `SHOAL_FUSED_LAYERS=0` turns this off too.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx

from node.cpu.expert_layers import KernelSwitchLinear
from node.cpu.fused_layers import fused_layers_enabled, projection
from node.cpu.kernel_layers import KernelQuantizedLinear
from node.cpu.mlx_lm_quirks import put_mixin, swiglu_oai_constants

FUSABLE_BLOCKS = (
    ("mlx_lm.models.qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    ("mlx_lm.models.gpt_oss", "MLPBlock"),
)
"""The mlx-lm MoE blocks whose routing `_FusedMoe.__call__` reproduces."""


def _experts(block: Any) -> Any:
    """The block's SwitchGLU: qwen3_moe calls it `switch_mlp`, gpt_oss `experts`."""
    return block.get("switch_mlp", block.get("experts"))


def _activation(block: Any) -> tuple[str, float, float] | None:
    """moe_mlp's activation (name, alpha, limit) for the block's SwitchGLU, or None."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    act = _experts(block).activation
    if type(act) is SwiGLU:
        return ("swiglu", 1.0, 0.0)
    if type(act) is SwigluOAI:
        return ("swiglu_oai", *swiglu_oai_constants(act))
    return None


def is_fusable_moe(block: Any) -> bool:
    """Whether `block` is a qwen3_moe or gpt_oss MoE block with every expert on the kernels."""
    if (type(block).__module__, type(block).__name__) not in FUSABLE_BLOCKS:
        return False
    experts = _experts(block)
    if experts is None or type(experts).__name__ != "SwitchGLU":
        return False
    if getattr(block, "sharding_group", None) is not None:
        return False
    projections = [experts.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, KernelSwitchLinear) for p in projections):
        return False
    gate, up = projections[0], projections[1]
    same = (gate["weight"].dtype, gate.group_size, gate.bits, gate["scales"].dtype)
    if same != (up["weight"].dtype, up.group_size, up.bits, up["scales"].dtype):
        return False
    if ("bias" in gate) != ("bias" in up) or (gate._biases() is None) != (up._biases() is None):
        return False
    return _activation(block) is not None


class _FusedMoe:
    """Mixed in before a fusable block's class: its tokens go through `moe_routed` / `moe_mlp`."""

    _kernels: ModuleType
    fused_moe = True  # what fused_layers looks for (it cannot import this module: a cycle)

    def __call__(self, x: mx.array) -> mx.array:
        block: Any = self
        experts = _experts(block)
        qwen = "switch_mlp" in block  # qwen3_moe: softmax over all experts, the top k (renormalized)
        router = block["gate"] if qwen else block["router"]  # gpt_oss: the top k logits, softmax over them
        k = block.top_k if qwen else block.num_experts_per_tok
        name, alpha, limit = _activation(block) or ("swiglu", 1.0, 0.0)
        projections = [projection(experts[p]) for p in ("gate_proj", "up_proj", "down_proj")]
        if isinstance(router, KernelQuantizedLinear):  # the routing inside the same operation
            return self._kernels.moe_routed(
                x,
                projection(router),
                *projections,
                top_k=k,
                routing="softmax_topk" if qwen else "topk_softmax",
                norm_topk_prob=bool(qwen and block.norm_topk_prob),
                activation=name,
                alpha=alpha,
                limit=limit,
            )
        if qwen:
            gates = mx.softmax(router(x), axis=-1, precise=True)
            indices = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
            scores = mx.take_along_axis(gates, indices, axis=-1)
            if block.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        else:
            logits = router(x)
            indices = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
            scores = mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1, precise=True)
        return self._kernels.moe_mlp(
            x, indices, scores, *projections, activation=name, alpha=alpha, limit=limit
        )


def fuse_moe_blocks(model: Any, kernels: ModuleType) -> int:
    """Give every fusable MoE block of `model` the one-operation decode; returns how many."""
    if not fused_layers_enabled() or not hasattr(kernels, "moe_mlp"):
        return 0
    fused = 0
    for _, module in model.named_modules():
        if isinstance(module, _FusedMoe) or not is_fusable_moe(module):
            continue
        put_mixin(module, _FusedMoe, _kernels=kernels)
        fused += 1
    return fused
