"""A decode step's attention in one native operation: rope of q and k, the KV-cache write, attention.

mlx-lm does this step as ~9 MLX operations a layer (rope twice, two cache slice updates, two
slices, attention, a reshape, and for a batch cache an offset add), each ~5 us of scheduling on
the CPU stream (measured here: 4.3-5.5 us for `x + 1` and for a cache slice update). SmolLM2-135M
has 30 layers, so that was ~1.5 ms of a ~12 ms token. `node.native._kernels.decode_attention`
does the same arithmetic as mx.fast.rope + the cache update + our fused attention (the same
loops), so the step's bits do not change; tests/test_decode_attention.py holds it to that.

It covers what a decode step on the CPU meets: one new position per sequence, mlx-lm's `KVCache`
(one sequence) and `BatchKVCache` (continuous batching) with room left in their buffers, float32
or float16 caches (`node.cpu.kv_cache`), plain or Llama-3 rope. Anything else (a cache that must
grow, rotating or quantized caches, other rope variants) returns None and the caller takes mlx-lm's own path.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from node.cpu.kv_cache import readable_caches
from node.cpu.mlx_lm_quirks import advance_batch, rope_frequencies, write_index


@dataclass(frozen=True)
class RopeSpec:
    """What mx.fast.rope is called with by a rope module, but the input and offset."""

    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None

    def kwargs(self) -> dict[str, Any]:
        """As the native decode operations take it."""
        return {
            "dims": self.dims,
            "traditional": self.traditional,
            "base": self.base,
            "rope_scale": self.scale,
            "freqs": self.freqs,
        }


def rope_spec(rope: Any) -> RopeSpec | None:
    """The spec of an `nn.RoPE` or mlx-lm `Llama3RoPE` (exact types); None for any other rope."""
    if type(rope) is nn.RoPE:
        return RopeSpec(rope.dims, rope.traditional, float(rope.base), float(rope.scale), None)
    if type(rope) is Llama3RoPE:
        return RopeSpec(rope.dims, rope.traditional, None, 1.0, rope_frequencies(rope))
    return None


def cached_attention(
    kernels: ModuleType, attn: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: Any
) -> mx.array | None:
    """Attention output [B, 1, Hq * Dv] of one decode step, with `cache` updated as mlx-lm would
    (keys, values, offset); None, with nothing changed, where the native step does not apply.

    q, k, v: [B, heads, 1, head_dim], not yet roped. `mask` as mlx-lm's model made it for this
    step (None, "causal", or an array over the keys after this one is added).
    """
    kind = type(cache)
    if (kind is not KVCache and kind is not BatchKVCache) or cache.keys is None:
        return None
    index = write_index(cache)
    keys, values = cache.keys, cache.values
    if index >= keys.shape[2] or not readable_caches(keys, values):
        return None
    if q.shape[2] != 1 or not (mask is None or isinstance(mask, mx.array) or mask == "causal"):
        return None
    spec = rope_spec(attn.rope)
    if spec is None:
        return None
    out, cache.keys, cache.values = kernels.decode_attention(
        q,
        k,
        v,
        keys,
        values,
        index=index,
        offset=cache.offset,
        scale=attn.scale,
        mask=mask if isinstance(mask, mx.array) else None,  # one query: "causal" sees every key
        **spec.kwargs(),
    )
    if kind is KVCache:
        cache.offset += 1
    else:
        advance_batch(cache)
    return out
