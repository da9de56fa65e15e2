"""Shoal's CPU kernels (node/native) against MLX's own dequantize + float32 matmul."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import cast

import mlx.core as mx
import pytest

import node.native as native
from node.native import load_kernels
from tests.isa_children import CAPS, capped_env, run_capped
from tests.kernel_error import RELATIVE, excess, int8_rows

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
ROWS = (1, 3, 8, 64)
"""Decode (1), a small batch (3), the largest small batch (8), prefill (64: dequantized tiles + sgemm)."""


def _kernels() -> ModuleType:
    assert KERNELS is not None
    return KERNELS


def _error(got: mx.array, x: mx.array, dense: mx.array, group: int = 32, bits: int = 16) -> float:
    """Largest error relative to the product's own scale, |x| @ |w|.T, past int8 rounding where
    the rows kernel rounds x to int8 (tests/kernel_error.py)."""
    return excess(got, x.astype(mx.float32), dense.T, group, int8_rows(bits))


def _affine(n: int, k: int, bits: int, group: int, scale_dtype: mx.Dtype) -> tuple[mx.array, ...]:
    wq, scales, biases = mx.quantize(mx.random.normal((n, k)) * 0.05, group_size=group, bits=bits)
    return wq, scales.astype(scale_dtype), biases.astype(scale_dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_affine_products_match_dequantize_then_matmul(bits: int, group: int, scale_dtype: mx.Dtype) -> None:
    mx.random.seed(bits * group)
    # Not multiples of any tile or of 256: 3 * 32 and 7 * 32 end in a pair and a lone chunk of 32
    # after whole 64-byte steps (4-bit), 7 * 128 is an odd number of steps; 18 groups are two
    # blocks of 8 in the row's prologue and its last 8 again (SmolLM2's K = 576 at group 32).
    for n, k in ((1, 3 * group), (17, 3 * group), (203, 3 * group), (40, 7 * group), (33, 18 * group)):
        wq, scales, biases = _affine(n, k, bits, group, scale_dtype)
        dense = mx.dequantize(
            wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group, bits=bits
        )
        for m in ROWS:
            x = mx.random.normal((m, k))
            got = _kernels().weight_matmul(x, wq, scales, biases, group_size=group, bits=bits)
            assert got.shape == (m, n) and got.dtype == mx.float32
            assert _error(got, x, dense, group, bits) < RELATIVE, (n, k, m)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dense_products_match_float32(dtype: mx.Dtype) -> None:
    mx.random.seed(7)
    for n, k in ((5, 8), (130, 200), (64, 1032), (9, 1048)):
        w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
        for m in ROWS:
            x = mx.random.normal((m, k))
            got = _kernels().weight_matmul(x, w)
            assert _error(got, x, w.astype(mx.float32)) < 1e-6, (n, k, m)


def test_batch_dims_strided_and_half_inputs() -> None:
    wq, scales, biases = _affine(96, 128, 4, 64, mx.bfloat16)
    dense = mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=4)
    x = mx.random.normal((2, 5, 128))
    got = _kernels().weight_matmul(x, wq, scales, biases, group_size=64, bits=4)
    assert got.shape == (2, 5, 96)
    assert _error(got, x, dense, 64, 4) < RELATIVE
    strided = mx.random.normal((128, 6)).T  # not row-contiguous
    got = _kernels().weight_matmul(strided, wq, scales, biases, group_size=64)
    assert _error(got, strided, dense, 64, 4) < RELATIVE
    half = x.astype(mx.float16)
    got = _kernels().weight_matmul(half, wq, scales, biases, group_size=64, bits=4)
    assert got.dtype == mx.float32 and _error(got, half, dense, 64, 4) < RELATIVE


def test_a_sequence_gives_the_same_bits_alone_or_in_a_batch() -> None:
    wq, scales, biases = _affine(300, 256, 4, 32, mx.float16)
    x = mx.random.normal((8, 256))
    batch = _kernels().weight_matmul(x, wq, scales, biases, group_size=32, bits=4)
    for m in range(8):
        alone = _kernels().weight_matmul(x[m : m + 1], wq, scales, biases, group_size=32, bits=4)
        assert mx.array_equal(alone[0], batch[m]).item(), m


def test_bad_arguments_are_clear_errors() -> None:
    wq, scales, biases = _affine(16, 64, 4, 32, mx.float16)
    k = _kernels()
    with pytest.raises(ValueError, match="x has 32 features, w 64"):
        k.weight_matmul(mx.zeros((1, 32)), wq, scales, biases, group_size=32, bits=4)
    with pytest.raises(ValueError, match="group size must be 32, 64 or 128"):
        k.weight_matmul(mx.zeros((1, 64)), wq, scales, biases, group_size=16, bits=4)
    with pytest.raises(ValueError, match="affine weights need scales"):
        k.weight_matmul(mx.zeros((1, 64)), wq, group_size=32, bits=4)
    with pytest.raises(ValueError, match="weights must be uint32"):
        k.weight_matmul(mx.zeros((1, 64)), mx.zeros((16, 64), dtype=mx.int32))


@pytest.mark.parametrize("isa", CAPS)
def test_each_narrower_instruction_set_passes_these_tests_too(isa: str) -> None:
    """This process runs the widest kernels the CPU has; a child runs this file's product tests
    with SHOAL_KERNEL_ISA capping them, so every kernel set the machine can run is checked."""
    env = capped_env(_kernels().kernel_name(), isa)
    reason = subprocess.run(
        [sys.executable, "-c", "from node.native import load_kernels; print(load_kernels().reason)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if isa == "int8":  # the widest set, rounding activations to int8
        assert reason.stdout.rstrip().endswith(", int8 activations"), reason
    else:
        assert reason.stdout.startswith(f"{isa} kernels"), reason
    run_capped(__file__, env, "products or bits or strided")


_PRODUCTS = """
import sys
import mlx.core as mx
from node.native import load_kernels
k = load_kernels().module
mx.random.seed(7)
out = {}
for n, kk, group in ((70, 256, 32), (40, 384, 32), (64, 2048, 64), (33, 96, 32)):  # steps, odd steps, tails
    wq, s, b = mx.quantize(mx.random.normal((n, kk)) * 0.05, group_size=group, bits=4)
    for m in (1, 2, 5):
        out[f"{n}-{kk}-{m}"] = k.weight_matmul(mx.random.normal((m, kk)), wq, s, b, group_size=group, bits=4)
mx.savez(sys.argv[1], **out)
"""


def test_vbmi_kernels_give_the_bits_of_the_plain_avx512_ones(tmp_path: Path) -> None:
    """avx512vbmi takes 4-bit weights apart another way; the values, and so every bit, are the same."""
    if _kernels().kernel_name() != "avx512vbmi":
        pytest.skip(f"the CPU's widest kernels are {_kernels().kernel_name()}")
    results = {}
    for isa in ("avx512vbmi", "avx512"):
        path = tmp_path / f"{isa}.npz"
        env = {**os.environ, "SHOAL_KERNEL_ISA": isa}
        argv = [sys.executable, "-c", _PRODUCTS, str(path)]
        done = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr
        results[isa] = cast(dict[str, mx.array], mx.load(str(path)))
    assert results["avx512vbmi"].keys() == results["avx512"].keys()
    for key, got in results["avx512vbmi"].items():
        assert mx.array_equal(got, results["avx512"][key]).item(), key


_CHECK = """
import json, sys
import mlx.core as mx
from node.native import load_kernels
from tests.kernel_error import excess, int8_rows
load = load_kernels()
k = load.module
wq, s, b = mx.quantize(mx.random.normal((70, 256)) * 0.05, group_size=32, bits=4)
dense = mx.dequantize(wq, s, b, group_size=32, bits=4)
errors = {}
for m in (1, 8, 40):
    x = mx.random.normal((m, 256))
    got = k.weight_matmul(x, wq, s, b, group_size=32, bits=4)
    errors[m] = excess(got, x, dense.T, 32, int8_rows(4))
print(json.dumps({"reason": load.reason, "errors": errors}))
"""


def _check_in_child(**env: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "env, name",
    [
        ({"SHOAL_KERNEL_ISA": "portable"}, "portable kernels, 2 thread(s)"),
        ({"SHOAL_KERNEL_THREADS": "1"}, "kernels, 1 thread(s)"),
        ({"SHOAL_KERNEL_THREADS": "3"}, "kernels, 3 thread(s)"),
    ],
)
def test_portable_kernels_and_thread_counts(env: dict[str, str], name: str) -> None:
    if "portable" in name:
        env = {**env, "SHOAL_KERNEL_THREADS": "2"}
    result = _check_in_child(**env)
    assert name in str(result["reason"])
    assert all(float(e) < RELATIVE for e in dict(result["errors"]).values()), result  # type: ignore[call-overload]


def test_prefill_without_a_blas_library_uses_the_rows_kernels(tmp_path: Path) -> None:
    fake = tmp_path / "scipy_openblas32"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    result = _check_in_child(PYTHONPATH=f"{tmp_path}:{Path(__file__).resolve().parents[1]}")
    assert "no sgemm for prefill (scipy-openblas32 is not installed)" in str(result["reason"])
    assert all(float(e) < RELATIVE for e in dict(result["errors"]).values()), result  # type: ignore[call-overload]


def test_missing_or_mismatched_build_falls_back_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    load_kernels.cache_clear()
    try:
        monkeypatch.setattr(native, "MLX_VERSION_FILE", tmp_path / "absent")
        missing = load_kernels()
        assert missing.module is None and "not built" in missing.reason
        load_kernels.cache_clear()
        (tmp_path / "other").write_text("0.0.1\n")
        monkeypatch.setattr(native, "MLX_VERSION_FILE", tmp_path / "other")
        other = load_kernels()
        assert other.module is None and "built for MLX 0.0.1, not " in other.reason
    finally:
        load_kernels.cache_clear()


_IDLE = """
import resource, time, mlx.core as mx
from node.native import load_kernels
k = load_kernels().module
wq, s, b = mx.quantize(mx.random.normal((4096, 1024)) * 0.05, group_size=32, bits=4)
x = mx.random.normal((1, 1024))
for _ in range(20):
    mx.eval(k.weight_matmul(x, wq, s, b, group_size=32, bits=4))  # a large product: the pool's job
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
time.sleep(0.2)  # past the workers' spin time: they sleep
before = cpu()
time.sleep(1.0)
print(cpu() - before)
"""


def test_pool_workers_sleep_when_there_is_no_work() -> None:
    """Workers spin a little between a decode step's jobs, then sleep: an idle runner burns no core."""
    if _kernels().threads() < 2:
        pytest.skip("one kernel thread: no workers")
    done = subprocess.run([sys.executable, "-c", _IDLE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 0.05  # CPU seconds over one idle second
