"""A decode step's attention in one operation (`decode_attention`) against its parts.

The reference is the step as mlx-lm takes it: rope of q and k, the cache slice updates, and
attention over the first index + 1 positions. With MLX's own rope and attention it must agree to
float32 rounding; with the fused ops the runner installs (the same loops) it must give the same
bits. A cache another holder still references is copied, never written in place; the layer glue
(`cached_attention`) takes mlx-lm's own path where the step does not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from node.cpu.decode_attention import cached_attention, rope_spec
from node.native import load_kernels

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "decode_attention"), reason="the native kernels are not built"
)
TOL = 1e-5


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    mx.random.seed(3)
    with mx.stream(mx.cpu):
        yield


def _step(
    rope: Callable[..., mx.array],
    sdpa: Callable[..., mx.array],
    q: mx.array,
    k: mx.array,
    v: mx.array,
    keys: mx.array,
    values: mx.array,
    index: int,
    spec: dict[str, Any],
    offset: int | mx.array,
    mask: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The step done by separate operations, as mlx-lm does it."""
    options = {n: spec[n] for n in ("traditional", "base", "scale", "freqs")}
    q, k = (rope(a, spec["dims"], offset=offset, **options) for a in (q, k))
    keys[..., index : index + 1, :] = k
    values[..., index : index + 1, :] = v
    out = sdpa(q, keys[..., : index + 1, :], values[..., : index + 1, :], scale=0.17, mask=mask)
    return out.reshape(q.shape[0], 1, -1), keys, values


def _native(args: dict[str, Any], **changes: Any) -> tuple[mx.array, mx.array, mx.array]:
    """decode_attention on a case's inputs (`_inputs`), some of them replaced, at the test's scale."""
    a = {**args, **changes}
    spec = a["spec"]
    assert KERNELS is not None
    return KERNELS.decode_attention(
        a["q"],
        a["k"],
        a["v"],
        a["keys"],
        a["values"],
        index=a["index"],
        dims=spec["dims"],
        traditional=spec["traditional"],
        base=spec["base"],
        rope_scale=spec["scale"],
        offset=a["offset"],
        scale=0.17,
        freqs=spec["freqs"],
        mask=a["mask"],
    )


CASES: dict[str, dict[str, Any]] = {
    "one sequence": dict(B=1, hq=9, hkv=3, mask=None, offset="int", rope="plain"),
    "gqa traditional partial": dict(B=1, hq=8, hkv=2, mask=None, offset="int", rope="traditional"),
    "llama3 freqs": dict(B=1, hq=4, hkv=4, mask=None, offset="int", rope="freqs"),
    "batch, padded": dict(B=3, hq=6, hkv=2, mask="bool", offset="array", rope="plain"),
    "batch, additive mask": dict(B=2, hq=4, hkv=1, mask="additive", offset="array", rope="freqs"),
}


def _inputs(case: dict[str, Any], index: int = 11, capacity: int = 32, D: int = 64) -> dict[str, Any]:
    B, hq, hkv = case["B"], case["hq"], case["hkv"]
    spec: dict[str, Any] = {"dims": D, "traditional": False, "base": 10000.0, "scale": 1.0, "freqs": None}
    if case["rope"] == "traditional":
        spec.update(dims=D // 2, traditional=True, base=500000.0, scale=0.5)
    elif case["rope"] == "freqs":
        spec.update(base=None, freqs=mx.random.uniform(1.0, 900.0, (D // 2,)))
    offset: int | mx.array = (
        index + 4 if case["offset"] == "int" else mx.array([index, index - 3, index - 7][:B])
    )
    mask = None
    if case["mask"] == "bool":  # left padding: sequence b's first 0, 3, 7 positions are padding
        mask = mx.arange(index + 1)[None, None, None, :] >= mx.array([0, 3, 7][:B])[:, None, None, None]
    elif case["mask"] == "additive":
        mask = mx.random.normal((B, 1, 1, index + 1))
    keys, values = mx.random.normal((B, hkv, capacity, D)), mx.random.normal((B, hkv, capacity, D))
    q, k, v = (
        mx.random.normal((B, hq, 1, D)),
        mx.random.normal((B, hkv, 1, D)),
        mx.random.normal((B, hkv, 1, D)),
    )
    mx.eval(keys, values, q, k, v)
    return dict(q=q, k=k, v=v, keys=keys, values=values, index=index, spec=spec, offset=offset, mask=mask)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_rope_cache_update_and_attention(name: str) -> None:
    from node.cpu.fused import install_fused_ops, original_op, uninstall_fused_ops

    args = _inputs(CASES[name])
    copies = lambda: (mx.array(args["keys"]), mx.array(args["values"]))  # noqa: E731
    keys, values = copies()
    got = _native(args, keys=keys, values=values)
    parts = {n: args[n] for n in ("q", "k", "v", "index", "spec", "offset", "mask")}
    want = _step(
        original_op("rope"),
        original_op("scaled_dot_product_attention"),
        **parts,
        keys=copies()[0],
        values=copies()[1],
    )
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and bool(mx.allclose(g, w, rtol=TOL, atol=TOL).item())
    assert KERNELS is not None
    install_fused_ops(KERNELS)
    try:
        fused = _step(
            mx.fast.rope, mx.fast.scaled_dot_product_attention, **parts, keys=copies()[0], values=copies()[1]
        )
    finally:
        uninstall_fused_ops()
    for g, w in zip(got, fused, strict=True):
        assert bool(mx.array_equal(g, w).item())  # the same loops: the same bits


def test_a_cache_still_held_elsewhere_is_copied_not_written() -> None:
    args = _inputs(CASES["batch, padded"])
    keys = args["keys"]
    before = mx.array(keys)
    out, new_keys, new_values = _native(args)
    mx.eval(out, new_keys, new_values)
    assert bool(mx.array_equal(keys, before).item())  # the held array is unchanged
    assert not bool(mx.array_equal(new_keys[..., args["index"], :], before[..., args["index"], :]).item())
    assert bool(mx.array_equal(new_keys[..., : args["index"], :], before[..., : args["index"], :]).item())


def test_bad_inputs_are_refused_by_name() -> None:
    args = _inputs(CASES["one sequence"], index=5, capacity=8)
    with pytest.raises(ValueError, match="index"):
        _native(args, index=8, offset=5)
    with pytest.raises(ValueError, match="one position"):
        _native(args, q=mx.concatenate([args["q"], args["q"]], axis=2), offset=5)
    with pytest.raises(ValueError, match="broadcast"):
        _native(args, offset=5, mask=mx.ones((1, 1, 1, 3), dtype=mx.bool_))


class _Attention:
    """What `cached_attention` reads of mlx-lm's attention module."""

    def __init__(self, rope: Any) -> None:
        self.rope, self.scale = rope, 0.17


def _filled(cache: Any, B: int, length: int) -> Any:
    k = mx.random.normal((B, 2, length, 64))
    cache.update_and_fetch(k, k)
    return cache


def test_cached_attention_updates_the_cache_as_mlx_lm_does() -> None:
    assert KERNELS is not None
    q, k, v = (
        mx.random.normal((1, 4, 1, 64)),
        mx.random.normal((1, 2, 1, 64)),
        mx.random.normal((1, 2, 1, 64)),
    )
    ours, theirs = _filled(KVCache(), 1, 5), _filled(KVCache(), 1, 5)
    theirs.keys, theirs.values = mx.array(ours.keys), mx.array(ours.values)
    out = cached_attention(KERNELS, _Attention(nn.RoPE(64)), q, k, v, ours, None)
    assert out is not None and ours.offset == 6
    rope = nn.RoPE(64)
    tk, tv = theirs.update_and_fetch(rope(k, offset=5), v)
    want = mx.fast.scaled_dot_product_attention(rope(q, offset=5), tk, tv, scale=0.17).reshape(1, 1, -1)
    assert bool(mx.allclose(out, want, rtol=TOL, atol=TOL).item())
    assert bool(mx.allclose(ours.keys[..., :6, :], tk, rtol=TOL, atol=TOL).item())
    batch = _filled(BatchKVCache(left_padding=[0, 2]), 2, 5)
    q2, k2 = mx.random.normal((2, 4, 1, 64)), mx.random.normal((2, 2, 1, 64))
    assert cached_attention(KERNELS, _Attention(rope), q2, k2, k2, batch, None) is not None
    assert batch._idx == 6 and batch.offset.tolist() == [6, 4]


def test_cached_attention_leaves_what_it_does_not_cover_to_mlx_lm() -> None:
    assert KERNELS is not None
    q, k = mx.random.normal((1, 4, 1, 64)), mx.random.normal((1, 2, 1, 64))
    full = _filled(KVCache(), 1, 256)  # no room left: mlx-lm grows the buffer
    assert cached_attention(KERNELS, _Attention(nn.RoPE(64)), q, k, k, full, None) is None
    assert full.offset == 256
    assert cached_attention(KERNELS, _Attention(nn.RoPE(64)), q, k, k, KVCache(), None) is None
    rotating = _filled(RotatingKVCache(max_size=64), 1, 5)
    assert cached_attention(KERNELS, _Attention(nn.RoPE(64)), q, k, k, rotating, None) is None
    assert cached_attention(KERNELS, _Attention(nn.ALiBi()), q, k, k, _filled(KVCache(), 1, 5), None) is None
    assert rope_spec(Llama3RoPE(64, 8192, False, 500000.0, {"factor": 8.0})) is not None
