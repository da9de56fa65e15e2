"""The runner's fast CPU path: MLX's float32 matmuls on an optimized OpenBLAS, threads to fit.

The mlx-cpu wheel sends float32 matmuls to a bundled reference BLAS (~2-3 GFLOP/s here). The shim
`native/sgemm_shim.c`, built with the package into `node/native/`, exports `cblas_sgemm`:
matrix products go to the OpenBLAS of the PyPI wheel `scipy-openblas32` (~100 GFLOP/s per core),
decode's matrix-vector products to a dot-product kernel of its own that reads weights at the full
memory bandwidth, both split over a pool of SHOAL_BLAS_THREADS threads. The node puts the shim in
the *runner's* `LD_PRELOAD` only, never in its own process, so nothing else the node runs is affected.

`runner_environment()` decides, once per runner start, and logs exactly one line:

    fast CPU path on: float32 matmuls on OpenBLAS 0.3.x (shim ...), 2 BLAS threads (2 usable cores)
    fast CPU path off: <reason>; using plain MLX

It never raises: whatever is missing (not Linux, a GPU as MLX's default device, no shim because no
C compiler, no scipy-openblas32 wheel, SHOAL_FAST_PATH=0) the runner just starts with plain MLX.
Greedy output is the same either way, up to float32 rounding order.

Environment knobs, read from the node's environment:
- `SHOAL_FAST_PATH=0` turns the fast path off.
- `SHOAL_BLAS_SHIM=/path/libshoal_blas_shim.so` uses another shim build.
- `SHOAL_BLAS_THREADS` (or else `OPENBLAS_NUM_THREADS`), when set, is the user's thread count;
  the runner gets it as SHOAL_BLAS_THREADS (the shim's pool) and OPENBLAS_NUM_THREADS=1.
- `GLIBC_TUNABLES`: the runner's gets `HUGE_PAGES` added unless it sets glibc.malloc.hugetlb.

Run `python -m node.cpu.fastpath` to see the decision and the variables it would set.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from node.native import SHIM_PATH

log = logging.getLogger("shoal.runner")

DEFAULT_SHIM = SHIM_PATH
"""Where the package build (`setup.py`, so `pip install` and `make install`) puts the shim."""

HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""The runner's glibc (2.35+; older ones ignore the tunable) asks for transparent huge pages on the
large blocks it maps, where THP is `madvise` (the common default), so weights stream through
~500x fewer TLB entries. Measured 2026-12-03 (Xeon, 2 threads): 1B Q4_0 decode +4-9%, Q8_0 +2-11%,
bf16 products +12-15%, runner memory +8 MB."""

_CPU_SYSFS = Path("/sys/devices/system/cpu")
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


@dataclass(frozen=True)
class FastPath:
    """The decision: variables to add to the runner's environment, and why."""

    enabled: bool
    message: str
    """The one log line."""
    env: dict[str, str] = field(default_factory=dict)


def usable_cores(
    affinity: set[int] | None = None, *, sysfs: Path = _CPU_SYSFS, cpu_max: Path = _CGROUP_CPU_MAX
) -> int:
    """Physical cores this process may run on, capped by a cgroup CPU quota; at least 1.

    Hyperthread siblings count once: BLAS kernels saturate a core's FMA units, so a second thread
    on the same core only adds contention. Where sysfs has no topology, every CPU counts.
    """
    cpus = affinity if affinity is not None else os.sched_getaffinity(0)
    cores: set[tuple[str, str] | int] = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
            cores.add((package, core))
        except OSError:
            cores.add(cpu)
    count = max(1, len(cores))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return count


def blas_threads(cores: int) -> int:
    """BLAS threads for a runner: one per usable physical core.

    Measured on a 2-core EPYC with bench/runner_speed.py, Qwen3-0.6B-shaped float32 model: 2
    threads against 1 gave prefill ~105 vs ~78 tok/s and decode ~13.5 vs ~11 tok/s on a quiet
    machine (decode is memory bound: one core reads ~25 GB/s, two ~45-50). With other work keeping
    the machine busy (load 4-5) 2 threads still won for decode (7.5 vs 5.3 tok/s) and lost a little
    for prefill (37 vs 45): the shim's pool hands out work in small chunks, so a thread whose core
    is taken costs little. SHOAL_BLAS_THREADS overrides it.
    """
    return max(1, cores)


def _openblas_library() -> tuple[Path, str] | None:
    """The scipy-openblas32 shared library and its version, or None when the wheel is missing."""
    try:
        import scipy_openblas32  # type: ignore[import-untyped]
    except ImportError:
        return None
    lib_dir = Path(scipy_openblas32.get_lib_dir())
    library = lib_dir / f"lib{scipy_openblas32.get_library()}.so"
    return (library, str(getattr(scipy_openblas32, "__version__", "?"))) if library.is_file() else None


def _default_device_is_gpu() -> bool:
    import mlx.core as mx  # ~10 ms; loads no model and allocates nothing

    return bool(mx.default_device() == mx.gpu)


def decide(environ: Mapping[str, str] | None = None, *, enabled: bool = True) -> FastPath:
    """What the runner's environment gets; pure apart from reading the machine. Never raises."""
    environ = os.environ if environ is None else environ

    def off(reason: str, env: dict[str, str] | None = None) -> FastPath:
        return FastPath(False, f"fast CPU path off: {reason}; using plain MLX", env or {})

    if not enabled or environ.get("SHOAL_FAST_PATH", "1").strip().lower() in ("0", "off", "no", "false"):
        # The runner's kernels for stored weights are part of the fast path: off too.
        return off("disabled by configuration", {"SHOAL_KERNELS": "0"})
    if sys.platform != "linux":
        return off(f"only built for Linux (this is {sys.platform})")
    try:
        if _default_device_is_gpu():
            return off("MLX's default device is the GPU")
    except Exception as exc:  # a broken MLX install is the runner's to report, not ours
        return off(f"cannot ask MLX for its default device ({type(exc).__name__}: {exc})")
    shim = Path(environ.get("SHOAL_BLAS_SHIM") or DEFAULT_SHIM)
    if not shim.is_file():
        return off(f"the BLAS shim {shim} is not built (installing the package builds it with a C compiler)")
    openblas = _openblas_library()
    if openblas is None:
        return off("the scipy-openblas32 wheel is not installed")
    library, version = openblas
    preload = environ.get("LD_PRELOAD", "").strip()
    env = {
        "LD_PRELOAD": f"{preload}:{shim}" if preload else str(shim),
        "SHOAL_OPENBLAS_LIB": str(library),
    }
    tunables = environ.get("GLIBC_TUNABLES", "").strip()
    if "glibc.malloc.hugetlb" not in tunables:  # the user's own choice stands
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES
    # The shim's pool does the threading; OpenBLAS itself runs single-threaded under it.
    env["OPENBLAS_NUM_THREADS"] = "1"
    chosen = environ.get("SHOAL_BLAS_THREADS") or environ.get("OPENBLAS_NUM_THREADS")
    if chosen:
        env["SHOAL_BLAS_THREADS"] = chosen
        threads = f"{chosen} BLAS thread(s) (set by the user)"
    else:
        cores = usable_cores()
        env["SHOAL_BLAS_THREADS"] = str(blas_threads(cores))
        threads = f"{env['SHOAL_BLAS_THREADS']} BLAS thread(s) ({cores} usable cores)"
    return FastPath(True, f"fast CPU path on: float32 matmuls on OpenBLAS {version} ({shim}), {threads}", env)


def runner_environment(environ: Mapping[str, str] | None = None, *, enabled: bool = True) -> dict[str, str]:
    """Variables to add to a runner's environment (empty when off); logs the one decision line."""
    try:
        fast = decide(environ, enabled=enabled)
    except Exception as exc:  # never let the fast path stop a model from being served
        fast = FastPath(False, f"fast CPU path off: {type(exc).__name__}: {exc}; using plain MLX")
    log.info("%s", fast.message)
    return fast.env


if __name__ == "__main__":
    decision = decide()
    print(decision.message)
    for key, value in decision.env.items():
        print(f"{key}={value}")
