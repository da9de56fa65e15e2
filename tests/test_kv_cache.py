"""float16 KV caches (`node.cpu.kv_cache`): the native attention reads them exactly.

A float16 cache changes one thing: each key and value is rounded to float16 when written. So
attention over float16 keys and values must give the bits of the same loops over those values
widened to float32 (on every loop set: the AVX2 one here, the portable one in a child), a decode
step must write what MLX's astype writes, and a model's caches must come out float16 unless
`SHOAL_KV_CACHE=float32` says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from node.cpu.kv_cache import install_kv_cache, kv_cache_dtype
from node.native import load_kernels
from tests.isa_children import run_capped

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "decode_attention"), reason="the native kernels are not built"
)


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    mx.random.seed(5)
    with mx.stream(mx.cpu):
        yield


def _widened(a: mx.array) -> mx.array:
    return a.astype(mx.float16).astype(mx.float32)


def _same(got: mx.array, want: mx.array) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and bool(mx.array_equal(got, want).item())


@pytest.mark.parametrize(("hq", "hkv", "D", "Dv"), [(9, 3, 64, 64), (32, 8, 64, 64), (4, 2, 36, 52)])
@pytest.mark.parametrize("S", [1, 80, 513])
@pytest.mark.parametrize(("L", "mask"), [(1, None), (3, "causal"), (70, "causal")])
def test_sdpa_reads_float16_keys_and_values_exactly(
    hq: int, hkv: int, D: int, Dv: int, S: int, L: int, mask: str | None
) -> None:
    assert KERNELS is not None
    q = mx.random.normal((1, hq, L, D))
    k, v = mx.random.normal((1, hkv, S + 7, D))[..., :S, :], mx.random.normal((1, hkv, S, Dv))
    half = KERNELS.scaled_dot_product_attention(
        q, k.astype(mx.float16), v.astype(mx.float16), scale=0.3, mask=mask
    )
    wide = KERNELS.scaled_dot_product_attention(q, _widened(k), _widened(v), scale=0.3, mask=mask)
    assert _same(half, wide)


def _decode(keys: mx.array, values: mx.array, args: dict[str, Any]) -> list[mx.array]:
    assert KERNELS is not None
    return list(KERNELS.decode_attention(keys=keys, values=values, **args))


def test_a_decode_step_writes_and_reads_a_float16_cache() -> None:
    assert KERNELS is not None
    B, hq, hkv, D, C, index = 2, 8, 2, 64, 40, 17
    q, k, v = (mx.random.normal((B, h, 1, D)) for h in (hq, hkv, hkv))
    keys, values = mx.random.normal((B, hkv, C, D)), mx.random.normal((B, hkv, C, D))
    mask = mx.arange(index + 1)[None, None, None, :] >= mx.array([0, 5])[:, None, None, None]
    args: dict[str, Any] = dict(q=q, k=k, v=v, index=index, dims=D, traditional=False, base=10000.0)
    args.update(rope_scale=1.0, offset=mx.array([index, index - 5]), scale=0.125, mask=mask)
    out, kc, vc = _decode(keys.astype(mx.float16), values.astype(mx.float16), args)
    assert kc.dtype == vc.dtype == mx.float16
    roped = KERNELS.rope(k, D, traditional=False, base=10000.0, scale=1.0, offset=args["offset"])
    assert _same(kc[..., index : index + 1, :], roped.astype(mx.float16))  # rounded as MLX rounds
    assert _same(vc[..., index : index + 1, :], v.astype(mx.float16))
    assert _same(kc[..., :index, :], keys[..., :index, :].astype(mx.float16))  # the rest untouched
    q_roped = KERNELS.rope(q, D, traditional=False, base=10000.0, scale=1.0, offset=args["offset"])
    upto = slice(0, index + 1)
    want = KERNELS.scaled_dot_product_attention(
        q_roped, kc[..., upto, :], vc[..., upto, :], scale=0.125, mask=mask
    ).reshape(B, 1, -1)
    assert _same(out, want)
    exact, _, _ = _decode(keys, values, args)  # float32 caches: only the rounding differs
    assert (mx.abs(out - exact).max() < 5e-3).item()


def test_caches_of_other_dtypes_are_refused_by_name() -> None:
    assert KERNELS is not None
    q, k = mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 1, 1, 64))
    args: dict[str, Any] = dict(q=q, k=k, v=k, index=0, dims=64, traditional=False, base=10000.0)
    args.update(rope_scale=1.0, offset=0, scale=0.125)
    keys = mx.zeros((1, 1, 8, 64))
    for pair in ((keys.astype(mx.bfloat16),) * 2, (keys, keys.astype(mx.float16))):
        with pytest.raises(ValueError, match="both float32 or both float16"):
            _decode(pair[0], pair[1], args)


@pytest.mark.parametrize("isa", ["portable"])
def test_the_portable_loops_read_float16_alike(isa: str) -> None:
    assert KERNELS is not None
    if KERNELS.fused_kernel_name() == "portable":
        pytest.skip("this process ran the portable loops")
    run_capped(__file__, {**os.environ, "SHOAL_KERNEL_ISA": isa}, "exactly or float16_cache")


def test_the_setting_picks_the_dtype_and_names_bad_values() -> None:
    assert kv_cache_dtype({}) == mx.float16
    assert kv_cache_dtype({"SHOAL_KV_CACHE": "float32"}) == mx.float32
    with pytest.raises(ValueError, match="SHOAL_KV_CACHE='f8': use one of float16, float32"):
        kv_cache_dtype({"SHOAL_KV_CACHE": "f8"})


def test_a_models_caches_are_float16_unless_configured(random_model_dir: Path) -> None:
    from mlx_lm import load

    model = load(str(random_model_dir))[0]
    tokens = mx.array([[3, 14, 15, 92, 65]])
    logits = {}
    try:
        for setting, dtype in (("float32", mx.float32), ("float16", mx.float16)):
            install_kv_cache({"SHOAL_KV_CACHE": setting})
            cache = make_prompt_cache(model)
            model(tokens, cache=cache)
            logits[setting] = model(mx.array([[7]]), cache=cache)  # a decode step reads the cache
            assert type(cache[0]) is KVCache
            held: Any = (cache[0].keys, cache[0].values)
            assert held[0].dtype == held[1].dtype == dtype
    finally:
        install_kv_cache({})
    spread = logits["float32"].max() - logits["float32"].min()
    assert (mx.abs(logits["float16"] - logits["float32"]).max() < 1e-2 * spread).item()
