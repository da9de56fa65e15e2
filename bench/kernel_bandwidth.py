"""Shoal's matmul kernels against the machine's memory bandwidth, side by side in one run.

For each layout (4-bit and 8-bit affine in groups of 32/64, bfloat16) it multiplies one row of
activations (decode) and 4 rows (a small batch) by a stack of Llama-1B-sized weight matrices
that together far exceed the caches. It prints the GB/s of weights read, and the ratio to a plain
numpy sum over 1 GiB on the same threads measured just before and after.
This host's bandwidth moves by 2x within minutes, so only the ratio means something.

    .venv/bin/python bench/kernel_bandwidth.py [--threads 2] [--matrices 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx

from bench.runner_speed import memory_bandwidth
from node.cpu.calibration import cpu_model
from node.native import load_kernels

N, K = 8192, 2048
"""A Llama-3.2-1B MLP matrix: 16.8 M weights (8 MB at 4 bits)."""
LAYOUTS = [("affine4 g32 f16", 4, 32, mx.float16), ("affine4 g64 bf16", 4, 64, mx.bfloat16)]
LAYOUTS += [("affine8 g32 f16", 8, 32, mx.float16), ("bfloat16", 16, 0, mx.bfloat16)]


def matrices(
    bits: int, group: int, dtype: mx.Dtype, count: int, n: int = N, k: int = K
) -> list[tuple[mx.array, ...]]:
    """`count` random n x k weights in one layout (16 bits: `dtype` itself; else affine)."""
    out: list[tuple[mx.array, ...]] = []
    for _ in range(count):
        w = mx.random.normal((n, k)) * 0.02
        if bits == 16:
            out.append((w.astype(dtype),))
        else:
            wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            out.append((wq, scales.astype(dtype), biases.astype(dtype)))
        mx.eval(*out[-1])
    return out


def gbps(kernels: object, mats: list[tuple[mx.array, ...]], rows: int, bits: int, group: int) -> float:
    x = mx.random.normal((rows, K))
    mx.eval(x)
    kw = {} if bits == 16 else {"group_size": group, "bits": bits}

    def run() -> None:
        mx.eval([kernels.weight_matmul(x, *m, **kw) for m in mats])  # type: ignore[attr-defined]

    run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return sum(a.nbytes for m in mats for a in m) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (default: the pool's)")
    parser.add_argument("--matrices", type=int, default=12, help="matrices per layout (12: 100 MB at 4 bits)")
    args = parser.parse_args()
    if args.threads:
        os.environ["SHOAL_KERNEL_THREADS"] = str(args.threads)  # read when the pool starts
    load = load_kernels()
    if load.module is None:
        sys.exit(f"no kernels: {load.reason}")
    print(f"{cpu_model()}; kernels: {load.reason}")
    threads = int(load.module.threads())
    before = memory_bandwidth(threads, 1.0)
    rows = []
    for label, bits, group, dtype in LAYOUTS:
        mats = matrices(bits, group, dtype, args.matrices)
        rows.append((label, gbps(load.module, mats, 1, bits, group), gbps(load.module, mats, 4, bits, group)))
        del mats
    after = memory_bandwidth(threads, 1.0)
    sum_bw = max(before, after)
    print(f"numpy sum on {threads} threads: {before:.1f} GB/s before, {after:.1f} after (using {sum_bw:.1f})")
    print(f"{'layout':<18} {'M=1 GB/s':>9} {'ratio':>6} {'M=4 GB/s':>9} {'ratio':>6}")
    for label, one, four in rows:
        print(f"{label:<18} {one:9.1f} {one / sum_bw:6.2f} {four:9.1f} {four / sum_bw:6.2f}")


if __name__ == "__main__":
    main()
