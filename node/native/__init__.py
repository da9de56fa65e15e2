"""Shoal's native parts, built from `native/` when the package is installed (`setup.py`).

- `_kernels`: an MLX extension whose `weight_matmul` multiplies by weights kept as stored (MLX
  affine 4/8-bit, float16, bfloat16) on all cores of the CPU; see `node.cpu.kernel_layers`.
- `libshoal_blas_shim.so`: the float32 BLAS shim the runner preloads (`node.cpu.fastpath`).

Either can be missing (no C++ compiler at install time, not Linux, `SHOAL_NATIVE=0` when
installing); `load_kernels` then says why in one sentence and callers use plain MLX. The
extension is only imported when it was built against the MLX version that is installed now
(nanobind modules of another MLX build can crash instead of raising).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from types import ModuleType

NATIVE_DIR = Path(__file__).resolve().parent
SHIM_PATH = NATIVE_DIR / "libshoal_blas_shim.so"
MLX_VERSION_FILE = NATIVE_DIR / "_kernels.mlx-version"
"""Written by the build next to the extension: the MLX version its headers came from."""


@dataclass(frozen=True)
class KernelLoad:
    module: ModuleType | None
    reason: str
    """Why there is no module, or what was loaded ("avx2 kernels, 2 threads, OpenBLAS sgemm")."""


def openblas_path() -> Path | None:
    try:
        import scipy_openblas32  # type: ignore[import-untyped]
    except ImportError:
        return None
    path = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    return path if path.is_file() else None


def _self_test(module: ModuleType) -> None:
    """One tiny product against MLX's own dequantize + matmul: a broken build fails here, loudly."""
    import mlx.core as mx

    w = mx.arange(64 * 32, dtype=mx.float32).reshape(32, 64) / 1000.0 - 1.0
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    x = mx.linspace(-1.0, 1.0, 64).reshape(1, 64)
    want = x @ mx.dequantize(wq, scales, biases, group_size=32, bits=4).T
    got = module.weight_matmul(x, wq, scales, biases, group_size=32, bits=4)
    if not bool(mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()):
        raise RuntimeError("the self-test product differs from mx.dequantize + matmul")


@cache
def load_kernels() -> KernelLoad:
    """The kernels extension, self-tested and with OpenBLAS's sgemm for prefill; never raises."""
    try:
        built_for = MLX_VERSION_FILE.read_text(encoding="utf-8").strip()
    except OSError:
        return KernelLoad(
            None, "the native kernels are not built (no C++ compiler or CMake when installing?)"
        )
    installed = metadata.version("mlx")
    if built_for != installed:
        return KernelLoad(None, f"the native kernels were built for MLX {built_for}, not {installed}")
    try:
        import mlx.core  # noqa: F401  (loads libmlx.so, which an in-place build's RUNPATH cannot find)

        module = importlib.import_module("node.native._kernels")
        _self_test(module)
    except Exception as exc:  # a broken build must never stop a model from being served
        return KernelLoad(None, f"the native kernels failed to load ({type(exc).__name__}: {exc})")
    blas = openblas_path()
    problem = "scipy-openblas32 is not installed" if blas is None else module.set_blas_library(str(blas))
    prefill = "OpenBLAS sgemm for prefill" if not problem else f"no sgemm for prefill ({problem})"
    if module.kernel_name().startswith("avx512"):  # its own prefill product for quantized weights
        prefill += " of 16-bit weights, VNNI for quantized ones"
    decode = (
        ", int8 activations"
        if module.int8_activations()
        else ", int8 activations for experts"
        if module.expert_int8_activations()
        else ""
    )
    return KernelLoad(
        module, f"{module.kernel_name()} kernels, {module.threads()} thread(s), {prefill}{decode}"
    )


def tensor_links_seal() -> bool:
    """Whether this node's tensor-parallel links can seal their frames (the kernels were built
    with OpenSSL's libcrypto: `native/kernels/link_seal.h`), as a cluster with a secret needs."""
    module = load_kernels().module
    return module is not None and bool(module.link_can_seal())
