"""A decode step of a model's whole layer stack as one native operation, not three a layer.

After `fuse_decoder_layers` a llama-family layer is three native operations a decode step (head,
attention, tail). Each still costs ~5 us of scheduling on the CPU stream and ~15 us of Python to
build: for SmolLM2-135M's 30 layers that was ~0.9 ms of a ~6.5 ms token. `stack_decoder` gives the
model's inner module (mlx-lm's `LlamaModel`, `Qwen2Model`, `Qwen3Model`) a `__call__` that runs a
decode step's layers as `decoder_stack`: the functions of the three operations, in their order, so
the same bits (tests/test_fused_stack.py). Everything else goes to the module's own `__call__`:
prefill chunks, caches that must grow, caches other than mlx-lm's `KVCache` / `BatchKVCache`,
sliding windows, and layers that are not all fused.

The operation writes each layer's keys and values in place, so it takes only caches whose buffers
no other array shares (`exclusive`); where a view of one is held, that step goes the per-layer way,
whose cache update copies, as MLX's own does. (mlx-lm's views of a cache read the positions below
the one a step writes, and the prefix cache deep-copies what it hands out.)
`SHOAL_DECODER_STACK=0` turns it off (benchmarks compare both).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from node.cpu.decode_attention import RopeSpec, rope_spec
from node.cpu.fused_layers import _FusedBlock, projection, tail_args, tensor_link
from node.cpu.kv_cache import readable_caches
from node.cpu.mlx_lm_quirks import advance_batch, put_mixin, write_index

STACKABLE_MODELS = {
    ("mlx_lm.models.llama", "LlamaModel"),
    ("mlx_lm.models.qwen2", "Qwen2Model"),
    ("mlx_lm.models.qwen3", "Qwen3Model"),
}
"""mlx-lm's inner model modules whose `__call__` is embed, mask, layers, norm, with fusable layers."""


def stack_enabled(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get("SHOAL_DECODER_STACK", "1")
    return value.strip().lower() not in ("0", "off", "no", "false")


@dataclass
class _Stack:
    """The plan for one list of layers (rebuilt if the module gets another list, e.g. when sharded)."""

    plan: Any
    rope: RopeSpec
    scale: float
    steps: int = 0
    """Decode steps run as one operation (tests read it)."""
    written: tuple[weakref.ref[mx.array], ...] = ()
    """The caches the last step wrote in place. The same arrays again need no new check: they were
    exclusive then, and the views taken of them since read only positions written before. Any step
    the per-layer way clears it (mlx-lm's cache update rewrites an array under the same object)."""

    def checked(self, arrays: list[mx.array]) -> bool:
        if len(arrays) != len(self.written):
            return False
        return all(r() is a for r, a in zip(self.written, arrays, strict=True))


def _layer_args(layer: Any) -> tuple[Any, ...]:
    attn, norm = layer["self_attn"], layer["input_layernorm"]
    q_norm, k_norm = attn.get("q_norm"), attn.get("k_norm")
    return (
        norm["weight"],
        norm.eps,
        projection(attn["q_proj"]),
        projection(attn["k_proj"]),
        projection(attn["v_proj"]),
        None if q_norm is None else q_norm["weight"],
        None if k_norm is None else k_norm["weight"],
        0.0 if q_norm is None else q_norm.eps,
        *tail_args(layer),
    )


def _same_rope(a: RopeSpec, b: RopeSpec) -> bool:
    if (a.dims, a.traditional, a.base, a.scale) != (b.dims, b.traditional, b.base, b.scale):
        return False
    if a.freqs is None or b.freqs is None:
        return a.freqs is None and b.freqs is None
    return a.freqs is b.freqs or bool(mx.array_equal(a.freqs, b.freqs).item())


def _plan(kernels: ModuleType, layers: list[Any]) -> _Stack | None:
    """The stack plan of `layers`, or None where one operation cannot run them all."""
    if not layers or not all(isinstance(layer, _FusedBlock) for layer in layers):
        return None
    attns = [layer["self_attn"] for layer in layers]
    first = attns[0]
    specs = [rope_spec(attn.rope) for attn in attns]
    rope = specs[0]
    if rope is None or not all(s is not None and _same_rope(rope, s) for s in specs):
        return None
    shape = (first.n_heads, first.n_kv_heads, first.scale)
    if any((a.n_heads, a.n_kv_heads, a.scale) != shape for a in attns):
        return None
    norms = [(a.get("q_norm"), a.get("k_norm")) for a in attns]
    if any(q is not None and k is not None and q.eps != k.eps for q, k in norms):
        return None
    links = {id(tensor_link(layer)) for layer in layers}
    if len(links) != 1:
        return None
    try:
        args = [_layer_args(layer) for layer in layers]
        plan = kernels.StackPlan(args, first.n_heads, first.n_kv_heads, link=tensor_link(layers[0]))
    except ValueError:  # shapes the operation does not take (it says which): the per-layer way
        return None
    return _Stack(plan, rope, float(first.scale))


class _StackedModel:
    """Mixed in before an inner model module's class: decode steps through `decoder_stack`."""

    _kernels: ModuleType

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> Any:
        out = self._stacked(inputs, cache, input_embeddings)
        if out is not None:
            return out
        held = self.__dict__.get("_shoal_stack")
        if held is not None and held[1] is not None:
            held[1].written = ()
        return super().__call__(inputs, cache, input_embeddings)  # type: ignore[misc]

    def stack(self) -> _Stack | None:
        """The plan for the module's current layers (built on first use, and again if they change)."""
        module: Any = self
        layers = module.layers
        held = self.__dict__.get("_shoal_stack")  # (the layers it was built for, the plan or None)
        if held is None or held[0] is not layers or len(held[0]) != held[2]:
            held = (layers, _plan(self._kernels, layers), len(layers))
            self.__dict__["_shoal_stack"] = held
        return held[1]

    def _stacked(self, inputs: mx.array, cache: Any, embeddings: mx.array | None) -> mx.array | None:
        module: Any = self
        length = (embeddings if embeddings is not None else inputs).shape[1]
        if length != 1 or not isinstance(cache, list) or getattr(module, "swa_idx", None) is not None:
            return None
        stack = self.stack()
        if stack is None or len(cache) != len(module.layers):
            return None
        first = cache[0]
        kind = type(first)
        if kind is not KVCache and kind is not BatchKVCache:
            return None
        index = write_index(first)
        keys, values = [], []
        for c in cache:
            if type(c) is not kind or c.keys is None or write_index(c) != index:
                return None
            keys.append(c.keys)
            values.append(c.values)
        arrays = keys + values
        if any(a.shape[2] <= index or not readable_caches(a, keys[0]) for a in arrays):
            return None  # a cache must grow (mlx-lm's update does it), or is of another dtype
        # MLX holds an operation's inputs until it has run, so a pipelined step finds the caches
        # the previous one is still writing shared: only new caches are checked.
        checked = stack.checked(arrays)
        if not checked and not self._kernels.exclusive(arrays):
            mx.eval(arrays)  # a step the per-layer way leaves them lazy
            if not self._kernels.exclusive(arrays):
                return None
        h = module.embed_tokens(inputs) if embeddings is None else embeddings
        mask = create_attention_mask(h, first)
        h = self._kernels.decoder_stack(
            h,
            stack.plan,
            keys,
            values,
            index=index,
            offset=first.offset,
            scale=stack.scale,
            mask=mask if isinstance(mask, mx.array) else None,
            **stack.rope.kwargs(),
        )
        if kind is KVCache:
            for c in cache:
                c.offset += 1
        else:  # every layer's offsets are the same values: one add, one array for all
            offset = first.offset + 1
            for c in cache:
                advance_batch(c, offset)
        stack.steps += 1
        if not checked:
            stack.written = tuple(weakref.ref(a) for a in arrays)
        return module.norm(h)


def restack(model: Any) -> bool:
    """Build the stacked step's plan again (its layers changed in place, e.g. got a tensor link);
    whether the model has one."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, _StackedModel):
        return False
    inner.__dict__.pop("_shoal_stack", None)
    return inner.stack() is not None


def stack_decoder(model: Any, kernels: ModuleType) -> bool:
    """Give `model`'s inner module the stacked decode step where it applies; whether it did."""
    inner = getattr(model, "model", None)
    if inner is None or not stack_enabled() or not hasattr(kernels, "decoder_stack"):
        return False
    cls = type(inner)
    if not issubclass(cls, _StackedModel):
        if (cls.__module__, cls.__name__) not in STACKABLE_MODELS:
            return False
        put_mixin(inner, _StackedModel, _kernels=kernels)
    return inner.stack() is not None
