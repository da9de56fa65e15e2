"""Two builds of the native kernels timed against each other in one process, interleaved.

Separate runs of one build differ by +-20% on these hosts (the memory bandwidth moves within
minutes), so a kernel change is judged here instead: `native/` as it is (A) and a changed copy of
it (B) are built as two renamed extension modules, loaded side by side, and alternated over the
same weights `--rounds` times; the figure is the median of the per-round time ratios B/A, with its
interquartile range (about +-5% here; a change inside it is noise).

Shapes: `llama1b` (an 8192 x 2048 MLP matrix, 12 of them: far beyond the caches) and `smollm2`
(SmolLM2-135M's 1536 x 576, 576 x 1536 and 576 x 576: products so small that the fixed cost of an
operation is a third of their time), each at M = 1 (decode) and 4 (a small batch), or the `--rows`
given (more than 8: the prefill route, dequantized tiles through OpenBLAS's sgemm, as runners do).

    cp -r native /tmp/variant && $EDITOR /tmp/variant/kernels/avx2.cpp
    .venv/bin/python bench/kernel_ab.py /tmp/variant [--base native] [--shapes smollm2 llama1b]
        [--layouts "affine4 g32 f16" ...] [--rounds 15] [--rows 1 4 | --rows 512]

Needs cmake and nanobind in the environment (the dev extras install both).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # before the modules below: they link against its library

from bench.kernel_bandwidth import LAYOUTS, matrices
from node.native import openblas_path

ROOT = Path(__file__).resolve().parent.parent
CMAKE = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
"""The environment's cmake first (the dev extras' is new enough; a system one may not be)."""
SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "llama1b": [(8192, 2048, 12)],
    "smollm2": [(1536, 576, 150), (576, 1536, 150), (576, 576, 300)],
}
"""Preset -> (N, K, matrices): enough matrices that one pass reads ~100 MB, beyond the caches."""


def build(source: Path, tag: str, work: Path) -> ModuleType:
    """`source` (a native/ folder) built as the module `_kernels_<tag>` and loaded."""
    tree = work / f"src_{tag}"
    shutil.copytree(source, tree)
    name = f"_kernels_{tag}"
    bindings = tree / "kernels" / "bindings.cpp"
    bindings.write_text(bindings.read_text().replace("NB_MODULE(_kernels, m)", f"NB_MODULE({name}, m)"))
    cmake = tree / "CMakeLists.txt"
    text = re.sub(r"^  _kernels$", f"  {name}", cmake.read_text(), flags=re.M)
    text = re.sub(r"(target_\w+|set_target_properties)\(_kernels ", rf"\1({name} ", text)
    cmake.write_text(text)
    out = work / "modules"
    build_dir = str(work / f"build_{tag}")
    configure = [str(CMAKE), "-S", str(tree), "-B", build_dir, f"-DPython_EXECUTABLE={sys.executable}"]
    configure += [f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}", "-DCMAKE_BUILD_TYPE=Release"]
    for step in (configure, [str(CMAKE), "--build", build_dir, "-j2", "--target", name]):
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"building {source} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    path = next(out.glob(f"{name}.*.so"))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(
    a: ModuleType,
    b: ModuleType,
    mats: list[tuple[mx.array, ...]],
    x: mx.array,
    kw: dict[str, int],
    rounds: int,
) -> str:
    """Median time of A per product, and the median and quartiles of B/A over interleaved rounds."""
    mx.eval(x)

    def run(kernels: ModuleType) -> float:
        start = time.perf_counter()
        mx.eval([kernels.weight_matmul(x, *m, **kw) for m in mats])
        return time.perf_counter() - start

    run(a), run(b)  # warm: pools started, pages touched
    ratios, times = [], []
    for _ in range(rounds):
        first = run(a)
        ratios.append(run(b) / first)
        times.append(first)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    per = statistics.median(times) / len(mats) * 1e6
    return f"A {per:8.1f} us/product   B/A {statistics.median(ratios):.3f} (IQR {q1:.3f}-{q3:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", type=Path, help="a changed copy of native/ (B)")
    parser.add_argument(
        "--base", type=Path, default=ROOT / "native", help="A (default: this checkout's native/)"
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "llama1b"])
    parser.add_argument("--layouts", nargs="+", default=[label for label, *_ in LAYOUTS])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="M: rows of x per product")
    args = parser.parse_args()
    if CMAKE is None or importlib.util.find_spec("nanobind") is None:
        sys.exit(
            "needs cmake and nanobind here: pip install cmake 'nanobind>=3,<4' (the dev extras have both)"
        )
    layouts = [layout for layout in LAYOUTS if layout[0] in args.layouts]
    if not layouts:
        sys.exit(f"no such layout; choose from {[label for label, *_ in LAYOUTS]}")
    with tempfile.TemporaryDirectory(prefix="shoal-kernel-ab-") as tmp:
        a, b = build(args.base, "a", Path(tmp)), build(args.variant, "b", Path(tmp))
        if max(args.rows) > 8:  # prefill: both need the sgemm a runner gives its module
            blas = openblas_path()
            if blas is None:
                sys.exit("--rows above 8 needs scipy-openblas32 (the runner's sgemm)")
            for module in (a, b):
                if problem := module.set_blas_library(str(blas)):
                    sys.exit(problem)
        print(f"A = {args.base}, B = {args.variant}; {args.rounds} rounds, alternating, in one process")
        for label, bits, group, dtype in layouts:
            kw = {} if bits == 16 else {"group_size": group, "bits": bits}
            for preset in args.shapes:
                for n, k, count in SHAPES[preset]:
                    mats = matrices(bits, group, dtype, count, n, k)
                    for rows in args.rows:
                        figures = compare(a, b, mats, mx.random.normal((rows, k)), kw, args.rounds)
                        print(f"{label:<17} {n:5d} x {k:<5d} M={rows}: {figures}", flush=True)
                    del mats


if __name__ == "__main__":
    main()
