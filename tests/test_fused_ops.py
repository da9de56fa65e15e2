"""The fused CPU rms_norm / rope / attention against MLX's own (on the CPU: its fallback graphs).

Each op is compared over the shape classes a runner meets (decode and small batches, GQA,
strided KV-cache slices, transposed heads); then `install_fused_ops` is checked to route calls
(counted) and to leave a real mlx-lm model's greedy tokens unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import create_causal_mask

from node.cpu.fused import install_fused_ops, original_op, uninstall_fused_ops
from node.native import load_kernels
from tests.model_factory import make_random_model

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "rms_norm"), reason="the native kernels are not built"
)
OPS = ("rms_norm", "rope", "scaled_dot_product_attention")
TOL = 1e-5


def close(got: mx.array, want: mx.array) -> bool:
    return (
        got.shape == want.shape
        and got.dtype == want.dtype
        and bool(mx.allclose(got, want, rtol=TOL, atol=TOL).item())
    )


def native(name: str) -> Callable[..., Any]:
    assert KERNELS is not None
    return getattr(KERNELS, name)


@pytest.fixture(autouse=True)
def _cpu_and_clean() -> Iterator[None]:
    mx.random.seed(0)
    with mx.stream(mx.cpu):
        yield
    uninstall_fused_ops()


@pytest.mark.parametrize("D", [576, 2048])
@pytest.mark.parametrize("weight_dtype", [None, mx.float32, mx.bfloat16])
@pytest.mark.parametrize("layout", ["dense", "transposed", "strided"])
def test_rms_norm(D: int, weight_dtype: mx.Dtype | None, layout: str) -> None:
    base = mx.random.normal((3, 5, 2 * D)) * 3.0
    x = {
        "dense": base[..., :D],
        "transposed": base[..., :D].transpose(1, 0, 2),
        "strided": base[..., ::2],  # a last axis with stride 2
    }[layout]
    weight = None if weight_dtype is None else mx.random.normal((D,)).astype(weight_dtype)
    want = original_op("rms_norm")(x, weight, 1e-5)
    assert close(native("rms_norm")(x, weight, 1e-5), want)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
@pytest.mark.parametrize("offset", [0, 37])
@pytest.mark.parametrize("L", [1, 7])
@pytest.mark.parametrize("freqs", [False, True])
def test_rope(traditional: bool, dims: int, offset: int, L: int, freqs: bool) -> None:
    x = mx.random.normal((2, L, 9, 64)).transpose(0, 2, 1, 3)  # mlx-lm's [B, H, L, D] view
    f = mx.random.uniform(1.0, 1000.0, (dims // 2,)) if freqs else None
    args: dict[str, Any] = {"traditional": traditional, "base": None if freqs else 10000.0, "scale": 0.7}
    want = original_op("rope")(x, dims, offset=offset, freqs=f, **args)
    assert close(native("rope")(x, dims, offset=offset, freqs=f, **args), want)


def test_rope_array_offsets_and_3d() -> None:
    x = mx.random.normal((2, 4, 5, 64))
    for offset in (mx.array(11), mx.array([3, 40])):
        args: dict[str, Any] = {"traditional": False, "base": 10000.0, "scale": 1.0, "offset": offset}
        assert close(native("rope")(x, 64, **args), original_op("rope")(x, 64, **args))
    x3 = mx.random.normal((3, 6, 32))
    args = {"traditional": True, "base": 500000.0, "scale": 1.0, "offset": 5}
    assert close(native("rope")(x3, 32, **args), original_op("rope")(x3, 32, **args))


def kv_slices(hkv: int, S: int, D: int, capacity: int = 768) -> tuple[mx.array, mx.array]:
    """Keys and values as mlx-lm's KVCache returns them: slices of [B, Hkv, capacity, D]."""
    k = mx.random.normal((1, hkv, capacity, D))
    v = mx.random.normal((1, hkv, capacity, D))
    mx.eval(k, v)
    return k[..., :S, :], v[..., :S, :]


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (32, 8)])
@pytest.mark.parametrize("S", [1, 80, 513])
@pytest.mark.parametrize(("L", "mask"), [(1, None), (3, "causal"), (1, "causal"), (3, None), (70, "causal")])
def test_sdpa(hq: int, hkv: int, S: int, L: int, mask: str | None) -> None:
    D = 64
    q = mx.random.normal((1, L, hq, D)).transpose(0, 2, 1, 3)
    k, v = kv_slices(hkv, S, D)
    scale = D**-0.5 * 1.3
    want = original_op("scaled_dot_product_attention")(q, k, v, scale=scale, mask=mask)
    assert close(native("scaled_dot_product_attention")(q, k, v, scale=scale, mask=mask), want)


@pytest.mark.parametrize("kind", ["bool", "additive", "sinks", "batch"])
def test_sdpa_masks_sinks_batches(kind: str) -> None:
    B, hq, hkv, L, S, D = (2 if kind == "batch" else 1), 8, 2, 4, 37, 32
    q = mx.random.normal((B, hq, L, D))
    k, v = mx.random.normal((B, hkv, S, D)), mx.random.normal((B, hkv, S, D + 16))  # Dv != D
    mask: Any = "causal" if kind == "batch" else None
    sinks = mx.random.normal((hq,)) if kind == "sinks" else None
    if kind == "bool":
        mask = mx.random.uniform(shape=(1, 1, L, S)) > 0.3
    elif kind == "additive":
        mask = mx.random.normal((hq, L, S))
    args: dict[str, Any] = {"scale": 0.2, "mask": mask, "sinks": sinks}
    want = original_op("scaled_dot_product_attention")(q, k, v, **args)
    assert close(native("scaled_dot_product_attention")(q, k, v, **args), want)


@pytest.mark.parametrize("shape", ["left_padding", "right_padding", "window", "empty_row", "additive"])
def test_sdpa_array_masks_as_batched_caches_make_them(shape: str) -> None:
    """mlx-lm's batched caches pass causal masks as arrays; the kernel stops at each chunk's last
    unmasked key, which must give what attending over every key gives."""
    B, hq, hkv, L, offset, D = 2, 8, 2, 70, 10, 32
    q = mx.random.normal((B, hq, L, D))
    k, v = mx.random.normal((B, hkv, offset + L, D)), mx.random.normal((B, hkv, offset + L, D))
    pads = mx.array([0, 23])
    mask = create_causal_mask(
        L,
        offset,
        window_size=16 if shape == "window" else None,
        left_padding=pads if shape in ("left_padding", "empty_row") else None,
        right_padding=pads if shape == "right_padding" else None,
    )
    if shape == "empty_row":  # a row that lets no key through averages every value, as in MLX
        mask = mask & (mx.arange(L) != 5)[:, None]
    if shape == "additive":
        mask = mx.where(mask, mx.random.normal(mask.shape), -mx.inf)
    args: dict[str, Any] = {"scale": 0.2, "mask": mask}
    want = original_op("scaled_dot_product_attention")(q, k, v, **args)
    assert close(native("scaled_dot_product_attention")(q, k, v, **args), want)


def counting(kernels: ModuleType) -> tuple[ModuleType, Counter[str]]:
    """A stand-in for the kernels module that counts the calls of each fused op."""
    calls: Counter[str] = Counter()
    module = ModuleType("counting_kernels")

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in (*OPS, "silu", "logsumexp"):
        setattr(module, name, counted(name, getattr(kernels, name)))
    module.fused_kernel_name = kernels.fused_kernel_name  # type: ignore[attr-defined]
    return module, calls


def test_install_routes_and_falls_back() -> None:
    assert KERNELS is not None
    module, calls = counting(KERNELS)
    originals = [getattr(mx.fast, name) for name in OPS]
    original_silu = nn.silu
    described = install_fused_ops(module)
    assert "fused" in described and install_fused_ops(module) == described  # idempotent
    x = mx.random.normal((1, 1, 64))
    assert close(mx.fast.rms_norm(x, mx.ones((64,)), 1e-6), original_op("rms_norm")(x, mx.ones((64,)), 1e-6))
    q = mx.random.normal((1, 4, 2, 16))
    mx.fast.rope(q, 16, traditional=False, base=10000.0, scale=1.0, offset=3)
    mx.fast.scaled_dot_product_attention(q, q, q, scale=0.25, mask="causal")
    assert calls == Counter(OPS)
    big = mx.random.normal((3, 4096)) * 6
    assert close(nn.silu(big), original_op("silu")(big))
    assert calls == Counter((*OPS, "silu"))
    # Not covered: 16-bit activations.
    mx.fast.rms_norm(x.astype(mx.float16), None, 1e-6)
    half_q = q.astype(mx.float16)
    mx.fast.scaled_dot_product_attention(half_q, half_q, half_q, scale=0.25, mask="causal")
    nn.silu(big.astype(mx.float16))
    assert calls == Counter((*OPS, "silu"))
    original_logsumexp = original_op("logsumexp")
    assert close(mx.logsumexp(big, axis=-1, keepdims=True), original_logsumexp(big, axis=-1, keepdims=True))
    assert close(mx.logsumexp(big, axis=[1]), original_logsumexp(big, axis=1))
    assert calls["logsumexp"] == 2
    # One row over all axes, as generate_step and a pipeline's last stage ask: the same, routed.
    row = big[:1]
    for keepdims in (True, False):
        got, want = mx.logsumexp(row, keepdims=keepdims), original_logsumexp(row, keepdims=keepdims)
        assert got.shape == want.shape and close(got, want)
    assert calls["logsumexp"] == 4
    # Not covered: other axes, all axes of several rows, 16-bit input.
    for args in ((big, 0), (big, None), (big.astype(mx.float16), -1)):
        assert close(mx.logsumexp(args[0], axis=args[1]), original_logsumexp(args[0], axis=args[1]))
    assert calls["logsumexp"] == 4
    uninstall_fused_ops()
    assert [getattr(mx.fast, name) for name in OPS] == originals and nn.silu is original_silu
    assert mx.logsumexp is original_logsumexp


def test_logsumexp_matches_mlx_with_infinities_and_nan() -> None:
    assert KERNELS is not None
    inf, nan = float("inf"), float("nan")
    for shape in ((49152,), (3, 1, 1000), (7, 13), (1, 5)):  # a vocabulary, batches, tails of < 8
        x = mx.random.normal(shape) * 8
        for keepdims in (False, True):
            assert close(KERNELS.logsumexp(x, keepdims=keepdims), mx.logsumexp(x, axis=-1, keepdims=keepdims))
    rows = [[-inf] * 9, [1.0, inf, 2.0] * 3, [1.0, nan, 3.0] * 3, [-inf, 0.0, 1.0] * 3]
    rows += [[88.0] * 9, [1e30, -1e30] * 5]  # exp would overflow without the max taken out
    for row in rows:
        got = KERNELS.logsumexp(mx.array([row]), keepdims=False).item()
        want = mx.logsumexp(mx.array([row]), axis=-1).item()
        assert got == want or (got != got and want != want), (row, got, want)  # NaN == NaN here
    with pytest.raises(ValueError, match="non-empty last axis"):
        KERNELS.logsumexp(mx.zeros((2, 0)), keepdims=False)


def greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], mx.array]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, seen = [], [logits]
    for _ in range(steps):
        token = cast(int, mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        seen.append(logits)
    return tokens, mx.concatenate(seen)


def test_model_tokens_unchanged(builtin_model_dir: Path, tmp_path: Path) -> None:
    from node.runner.engine import load_model

    assert KERNELS is not None
    path = make_random_model(
        tmp_path / "tiny",
        tokenizer_from=builtin_model_dir,
        hidden_size=96,
        intermediate_size=192,
        num_heads=6,
        num_kv_heads=2,
    )
    model = load_model(path, vocab_dir=None).model  # the runner's load installs the fused ops itself
    uninstall_fused_ops()  # the reference: MLX's own
    prompt = [17, 4032, 88, 901, 5, 12000]  # six tokens: the causal prompt runs natively too
    want_tokens, want_logits = greedy(model, prompt, 12)
    module, calls = counting(KERNELS)
    install_fused_ops(module)
    got_tokens, got_logits = greedy(model, prompt, 12)
    assert got_tokens == want_tokens
    assert bool(mx.allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4).item())
    layers = 2  # every layer's two norms, two ropes and attention, 13 forwards, + the final norm
    del calls["silu"]  # swiglu is compiled: silu runs once per trace, whenever that was
    assert calls == Counter(
        {
            "rms_norm": 13 * (2 * layers + 1),
            "rope": 13 * 2 * layers,
            "scaled_dot_product_attention": 13 * layers,
        }
    )
