"""Every mlx-lm (and MLX) internal Shoal relies on, in one place: read in mlx-lm 0.32.2 and mlx
0.32.4 (`READ_FROM`; `pyproject.toml` bounds both). When a new version changes one of these facts,
the fix is here, and `tests/test_mlx_lm_quirks.py` says which fact broke.

Class swaps (`put_mixin`): the fused CPU paths (`fused_layers`, `fused_stack`, `moe_blocks`,
`layer_eval`) change only a module's `__class__`, putting a mixin in front of its own class, so
parameters, children, names and `isinstance` checks see the same model. mlx-lm's modules are plain
Python classes over `mlx.nn.Module` (a dict subclass), which allows the assignment. Each (mixin,
class) pair is made once, so every layer of a model shares one class, named and placed as the
original.

Private attributes (`node.cpu.decode_attention`, `fused_stack`, `moe_blocks`):
- `rope_frequencies`: `Llama3RoPE` keeps its scaled frequencies in `_freqs` (dims // 2 floats) and
  passes them to `mx.fast.rope(..., base=None, freqs=_freqs)`.
- `write_index`, `advance_batch`: `BatchKVCache` writes the next position at `_idx` (shared
  by the batch; `offset` is an array per sequence) and advances both in `update_and_fetch`.
- `swiglu_oai_constants`: `SwigluOAI` (gpt_oss's experts) keeps alpha and limit in `_alpha`,
  `_limit`.
- `store_caches_as` (`node.cpu.kv_cache`): `KVCache`, `BatchKVCache`, `RotatingKVCache` and
  `BatchRotatingKVCache` allocate their buffers as the keys and values `update_and_fetch` is given
  (`mx.zeros(shape, keys.dtype)`, concatenation) and write them by slice assignment, which casts;
  their merges, trims and states copy the dtype they hold. So keys and values handed over as
  float16 make float16 caches, and every view of them is float16.

What a generic pipeline stage relies on (`node.pipeline.generic`):

- `decoder_owner`: a model's decoder layers are a list of one module (`Model.model.layers` in
  llama, gemma3_text, phi3, qwen3_moe, gpt_oss; `transformer.h` in nanochat, `model.blocks` in
  talkie), which also holds the embedding and final norm;
  the outer `Model` holds the head (`lm_head`), absent when tied (gemma3_text's `sanitize` pops
  it). `Model.layers` is a property returning that list, or a copy of it for models with
  `pipeline.PipelineMixin` (qwen3_moe: `pipeline_layers`, all layers until `pipeline()` is called,
  which Shoal never calls).
- `full_cache`: `cache.make_prompt_cache` builds the per-layer caches as generation does
  (`Model.make_cache` where defined: gemma3_text and gpt_oss alternate `KVCache` and
  `RotatingKVCache(max_size=sliding_window)`).
- `cache_kind`: masks are built by `base.create_attention_mask(h, cache[i])`, which calls
  `cache.make_mask(N, ...)`; that depends only on the cache's type, `offset`, `max_size` and `_idx`
  (`RotatingKVCache.make_mask`). Caches of one kind in one stage are always in the same state.
  A layer's `CacheList` (baichuan_m1: a convolution state and a full or sliding `KVCache`) is of
  the kind of its parts: the model reads the mask off `cache[i][1]`.
- `plain_attributes`: besides calling its layers, a model's own loop and `make_cache` read only
  plain attributes of them and their submodules (llama's `use_sliding`, qwen3_next's `is_linear`,
  exaone4's `self_attn.is_local`).
- `hidden_state_parameter`: a layer takes the hidden state first; gptj's loop passes it by name.
- `is_embedding`: token embeddings are `nn.Embedding` or `nn.QuantizedEmbedding` children of the
  layers' owner.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

READ_FROM = {"mlx": "0.32.4", "mlx-lm": "0.32.2"}
"""The versions whose source these facts were read from."""
_CLASSES: dict[tuple[type, type], type] = {}


def put_mixin(module: nn.Module, mixin: type, **namespace: Any) -> None:
    """Put `mixin` in front of `module`'s class (and `namespace`, e.g. the kernels module, as class
    attributes); a module that has it already is left as it is."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    if (mixin, cls) not in _CLASSES:
        attributes = {"__module__": cls.__module__, **namespace}
        _CLASSES[mixin, cls] = type(cls.__name__, (mixin, cls), attributes)
    module.__class__ = _CLASSES[mixin, cls]


def rope_frequencies(rope: Any) -> mx.array:
    """A `Llama3RoPE`'s scaled frequencies."""
    freqs: mx.array = rope._freqs
    return freqs


def write_index(cache: Any) -> int:
    """Where a `KVCache` (its `offset`) or a `BatchKVCache` writes the next position."""
    return int(cache.offset if type(cache) is KVCache else cache._idx)


def advance_batch(cache: Any, offset: mx.array | None = None) -> None:
    """Count one position written into a `BatchKVCache`, as its `update_and_fetch` does (`offset`:
    the new offsets, one array that every layer's cache may share)."""
    cache.offset = cache.offset + 1 if offset is None else offset
    cache._idx += 1


STORED_CACHES = (KVCache, BatchKVCache, RotatingKVCache, BatchRotatingKVCache)
"""The cache classes whose buffers take the dtype of what `update_and_fetch` is given."""
_OWN_UPDATES: dict[type, Callable[..., Any]] = {}


def store_caches_as(dtype: mx.Dtype | None) -> None:
    """Make `STORED_CACHES` keep float32 keys and values as `dtype`, process-wide (None: mlx-lm's
    own `update_and_fetch` back). Other dtypes are stored as they come."""
    for cls in STORED_CACHES:
        own = _OWN_UPDATES.setdefault(cls, cls.update_and_fetch)
        if dtype is None:
            cls.update_and_fetch = own  # type: ignore[method-assign]
            continue

        def update_and_fetch(
            self: Any, keys: mx.array, values: mx.array, own: Callable[..., Any] = own, to: mx.Dtype = dtype
        ) -> Any:
            if keys.dtype == mx.float32:
                keys = keys.astype(to)
            if values.dtype == mx.float32:
                values = values.astype(to)
            return own(self, keys, values)

        cls.update_and_fetch = update_and_fetch  # type: ignore[method-assign]


def swiglu_oai_constants(activation: Any) -> tuple[float, float]:
    """A `SwigluOAI`'s (alpha, limit): gpt_oss's clamped SwiGLU."""
    return float(activation._alpha), float(activation._limit)


def decoder_owner(model: nn.Module) -> tuple[nn.Module | None, str, nn.Module]:
    """The module holding the model's decoder layers as a list (None if there is none), the
    attribute that list is under, and the outer model."""
    try:
        layers = model.layers
    except AttributeError:
        return None, "", model
    if not isinstance(layers, list) or not layers:
        return None, "", model
    for _, module in model.named_modules():
        if not isinstance(module, nn.Module):
            continue
        for key, held in module.items():
            if (
                isinstance(held, list)
                and len(held) == len(layers)
                and all(a is b for a, b in zip(held, layers, strict=True))
            ):
                return module, key, model
    return None, "", model


def full_cache(model: nn.Module) -> list[Any]:
    """Fresh caches for every layer of `model`, as mlx-lm's generation makes them."""
    from mlx_lm.models.cache import make_prompt_cache

    return list(make_prompt_cache(model))


def cache_kind(cache: Any) -> Hashable:
    """What decides the masks a cache makes, besides its position (a `CacheList`: its parts')."""
    parts = getattr(cache, "caches", None)
    if isinstance(parts, list | tuple):
        return (type(cache), tuple(cache_kind(part) for part in parts))
    return (type(cache), getattr(cache, "max_size", None), getattr(cache, "keep", None))


def is_embedding(module: object) -> bool:
    return isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))


def plain_attributes(module: nn.Module) -> dict[str, object]:
    """A module's plain attributes (bool, int, float, str, None: no weights, no submodules)."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and (value is None or isinstance(value, bool | int | float | str))
    }


def hidden_state_parameter(layer: nn.Module) -> str:
    """The name of a layer's first parameter: the hidden state, which models pass positionally or,
    like gptj (`block(inputs=h, ...)`), by that name."""
    parameters = iter(inspect.signature(layer.__call__).parameters)
    return next(parameters, "x")
