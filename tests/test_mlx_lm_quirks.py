"""The canary of `node.cpu.mlx_lm_quirks`: each mlx / mlx-lm internal Shoal relies on, checked on
the installed versions, failing with the fact that broke instead of a wrong answer deep in a decode
step after an upgrade."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import SwigluOAI
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from node.cpu.mlx_lm_quirks import (
    READ_FROM,
    advance_batch,
    put_mixin,
    rope_frequencies,
    store_caches_as,
    swiglu_oai_constants,
    write_index,
)


def _broke(fact: str) -> str:
    installed = {name: version(name) for name in READ_FROM}
    return f"{fact}: no longer so with {installed} (read from {READ_FROM}); see node/cpu/mlx_lm_quirks.py"


def _series(text: str) -> tuple[str, ...]:
    return tuple(text.split(".")[:2])


def test_the_installed_versions_are_the_series_the_facts_were_read_from() -> None:
    for name, read in READ_FROM.items():
        assert _series(version(name)) == _series(read), _broke(f"{name} is of the {read} series")


class _Doubled:
    def __call__(self, x: mx.array) -> mx.array:
        return 2 * super().__call__(x)  # type: ignore[misc]


def test_a_mixin_goes_in_front_of_a_modules_class_once() -> None:
    first, second = nn.Linear(4, 3), nn.Linear(4, 3)
    x = mx.ones((1, 4))
    before = first(x)
    put_mixin(first, _Doubled)
    put_mixin(first, _Doubled)  # already there: left as it is
    put_mixin(second, _Doubled)
    fact = "assigning a module's __class__ keeps its parameters, name and isinstance checks"
    assert mx.allclose(first(x), 2 * before).item(), _broke(fact)
    assert type(first) is type(second) and type(first).__name__ == "Linear", _broke(fact)
    assert isinstance(first, nn.Linear) and set(first.parameters()) == {"weight", "bias"}, _broke(fact)


def test_llama3_rope_applies_the_frequencies_it_keeps() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = Llama3RoPE(64, max_position_embeddings=131072, base=500000.0, scaling_config=scaling)
    x = mx.random.normal((1, 2, 5, 64))
    freqs = rope_frequencies(rope)
    ours = mx.fast.rope(x, 64, traditional=False, base=None, scale=1.0, offset=3, freqs=freqs)
    fact = "Llama3RoPE keeps its scaled frequencies in _freqs and ropes with them"
    assert freqs.shape == (32,), _broke(fact)
    assert mx.allclose(rope(x, offset=3), ours).item(), _broke(fact)


def test_a_batch_cache_advances_as_its_own_update_does() -> None:
    keys = mx.random.normal((2, 1, 1, 8))
    theirs, ours = BatchKVCache([0, 1]), BatchKVCache([0, 1])
    for cache in (theirs, ours):
        cache.update_and_fetch(keys, keys)
    theirs.update_and_fetch(keys, keys)
    index = write_index(ours)
    assert ours.keys is not None and ours.values is not None and theirs.keys is not None
    ours.keys[..., index : index + 1, :] = keys
    ours.values[..., index : index + 1, :] = keys
    advance_batch(ours)
    fact = "BatchKVCache writes at _idx and advances _idx and offset by one a position"
    assert write_index(theirs) == write_index(ours) == 2, _broke(fact)
    assert mx.array_equal(theirs.offset, ours.offset).item(), _broke(fact)
    assert mx.array_equal(theirs.keys, ours.keys).item(), _broke(fact)
    single = KVCache()
    single.update_and_fetch(keys[:1], keys[:1])
    assert write_index(single) == single.offset == 1, _broke("KVCache writes at its offset")


def test_gpt_oss_activation_keeps_its_constants() -> None:
    fact = "SwigluOAI keeps alpha and limit in _alpha and _limit"
    assert swiglu_oai_constants(SwigluOAI(alpha=1.5, limit=6.0)) == (1.5, 6.0), _broke(fact)


def test_caches_store_keys_in_the_dtype_they_are_handed() -> None:
    fact = "a cache's buffers (grown, wrapped, merged) take the dtype of the keys update_and_fetch gets"
    store_caches_as(mx.float16)
    try:
        plain, rotating = KVCache(), RotatingKVCache(max_size=16)
        cache: Any
        for cache in (plain, rotating):
            for length in (5, 300, 1):  # the first buffer, one grown past mlx-lm's 256-step, one more
                k = mx.random.normal((1, 2, length, 8))
                keys, values = cache.update_and_fetch(k, k)
                assert keys.dtype == values.dtype == cache.keys.dtype == mx.float16, _broke(fact)
        merged = BatchKVCache.merge([plain, KVCache.from_state(plain.state)])
        keys, _ = merged.update_and_fetch(mx.ones((2, 2, 1, 8)), mx.ones((2, 2, 1, 8)))
        held: Any = merged.keys
        assert keys.dtype == held.dtype == mx.float16, _broke(fact)
        assert BatchRotatingKVCache(16, [0]).update_and_fetch(k, k)[0].dtype == mx.float16, _broke(fact)
    finally:
        store_caches_as(None)
    assert KVCache().update_and_fetch(k, k)[0].dtype == mx.float32, "store_caches_as(None) puts mlx-lm's back"
