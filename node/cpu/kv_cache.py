"""The KV cache's dtype on the CPU kernels: float16 by default, as llama.cpp keeps its cache.

A decode step reads the whole cache once per layer, so past a few thousand tokens the cache, not
the weights, is most of what a step reads (1B shape at 4,096 tokens: 16 layers x 2 x 8 heads x 64
x 4,096 x 4 bytes = 268 MB in float32, against ~0.8 GB of 4-bit weights). Stored as float16 it is
half that, in memory and in every step. The native attention (`decode_attention`, the layer stack,
the fused sdpa) reads float16 keys and values back exactly as float32, so the only change is each
key and value rounded to float16 once, when written (relative error <= 2^-11); queries, scores,
softmax and sums stay float32.

`SHOAL_KV_CACHE=float32` keeps float32 caches (bit-for-bit the old results; a model whose keys
exceed float16's range, 65504, would need it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import mlx.core as mx

from node.cpu.mlx_lm_quirks import store_caches_as

KV_DTYPES = {"float16": mx.float16, "float32": mx.float32}
"""`SHOAL_KV_CACHE` values, and the cache dtypes the native attention reads."""
DEFAULT_KV_DTYPE = "float16"


def kv_cache_dtype(environ: Mapping[str, str] | None = None) -> mx.Dtype:
    """The configured cache dtype; an unknown value is an error naming the choices."""
    value = (os.environ if environ is None else environ).get("SHOAL_KV_CACHE", DEFAULT_KV_DTYPE)
    name = value.strip().lower()
    if name not in KV_DTYPES:
        raise ValueError(f"SHOAL_KV_CACHE={value!r}: use one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def readable_caches(keys: mx.array, values: mx.array) -> bool:
    """Whether the native attention reads these caches as they are (both float32 or both float16)."""
    return keys.dtype == values.dtype and keys.dtype in KV_DTYPES.values()


def install_kv_cache(environ: Mapping[str, str] | None = None) -> str:
    """Make this process's caches store keys and values as configured; returns a log phrase."""
    dtype = kv_cache_dtype(environ)
    store_caches_as(None if dtype == mx.float32 else dtype)
    return f"KV cache {'float32' if dtype == mx.float32 else 'float16'}"
