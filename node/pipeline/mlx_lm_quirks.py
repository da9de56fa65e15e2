"""The mlx-lm internals a generic pipeline stage relies on (read in mlx-lm 0.32.2's source).

`node.pipeline.generic` calls only these helpers; when mlx-lm changes one of these facts, the fix
is here.

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
from collections.abc import Hashable
from typing import Any

import mlx.nn as nn


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
