"""The kernel sets calibration picks on this CPU for each GGUF's layouts, with each set's median.

What a runner does at its first start on a CPU (`node/cpu/calibration.py`), measured afresh here
(`redo`, in a cache of its own, so the runners' cache is left alone) and printed as a table: per
layout and row class, the median ms of one pass over the model's sampled weights on each set.

    .venv/bin/python bench/calibration.py [--models q4_0 q8_0 q4_k_m ...] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["SHOAL_KERNEL_CALIBRATE"] = "off"  # loading picks nothing; `calibrate` below measures

from bench import moe_models
from bench.common import loadavg
from bench.llamacpp import GGUF_QUANTS, bench_cache, ensure_llamacpp, prepare_ggufs
from node.cpu.calibration import cache_file, calibrate, cpu_model
from node.cpu.fastpath import usable_cores

MODELS = ["smollm2", *GGUF_QUANTS, *moe_models.GGUF_ROWS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(GGUF_QUANTS), choices=MODELS)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="kernel threads")
    args = parser.parse_args()
    os.environ["SHOAL_KERNEL_THREADS"] = str(args.threads)
    from mlx_lm.utils import load

    from node.cpu.dtype import apply_dtype_policy
    from node.models.gguf import ensure_gguf_model
    from node.native import load_kernels

    kernels = load_kernels().module
    if kernels is None:
        sys.exit("the native kernels are not built: nothing to calibrate")
    llama = ensure_llamacpp(jobs=args.threads)
    ggufs = prepare_ggufs(args.models, False, llama, args.threads)
    ggufs |= moe_models.prepare_moe_ggufs(args.models, False, llama, args.threads)
    print(f"{cpu_model()}, {args.threads} threads, load average {loadavg()}", flush=True)
    print(f"candidates: {', '.join(kernels.rows_candidates())} (the first is the default)")
    with tempfile.TemporaryDirectory(prefix="shoal-calibration-") as tmp:
        env = {"SHOAL_KERNEL_CALIBRATE": "redo", "SHOAL_CACHE_DIR": tmp}
        for path in ggufs.values():
            folder = ensure_gguf_model(path, bench_cache() / "imports" / path.stem)
            model = load(str(folder), lazy=True)[0]
            apply_dtype_policy(model)
            calibrate(model, kernels, env)
            print(f"\n{path.stem}")
            for key, entry in sorted(json.loads(cache_file(kernels, env).read_text())["choices"].items()):
                times = "  ".join(f"{name} {ms:.3f}" for name, ms in entry["ms"].items())
                print(f"  {key:<11} -> {entry['kernel']:<11} ms: {times}")
            cache_file(kernels, env).unlink()  # each file's table is its own
    print(f"\nload average at the end {loadavg()}")


if __name__ == "__main__":
    main()
