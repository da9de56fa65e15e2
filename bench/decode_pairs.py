"""Decode of Shoal against llama.cpp on the same GGUF, in alternating rounds: paired ratios.

On a shared host the memory bandwidth drifts (26-47 GB/s a minute apart on the AMD EPYC of
2026-12-05), and decode on two cores follows it, so a block of llama-bench runs followed by a
block of Shoal requests (`bench/vs_llamacpp.py`) can differ by the drift alone. Here one Shoal
node stays up while each round runs `llama-bench -p 0 -n 64 -r 1` and then one Shoal decode of
64 greedy tokens (`bench/side_by_side.py`'s timing), so each round's ratio compares neighbours;
the median of the rounds' ratios is the figure to quote.

    .venv/bin/python bench/decode_pairs.py [--models qwen3moe_q4_0 gptoss_mxfp4 ...] [--rounds 5]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import moe_models
from bench.common import loadavg
from bench.llamacpp import GGUF_QUANTS, LlamaCpp, ensure_llamacpp, llama_bench, prepare_ggufs
from bench.side_by_side import OUTPUT_TOKENS, STORY, shoal_decode, start_shoal, wall_request
from node.cpu.calibration import cpu_model
from node.cpu.fastpath import usable_cores

MODELS = ["smollm2", *GGUF_QUANTS, *moe_models.GGUF_ROWS]


def pairs(llama: LlamaCpp, name: str, path: Path, rounds: int, threads: int) -> list[float]:
    """Shoal / llama.cpp decode of each round, one node up throughout."""
    timing = moe_models.timing(name) if name in moe_models.GGUF_ROWS else "chunks"
    ratios = []
    with tempfile.TemporaryDirectory(prefix="shoal-pairs-") as tmp:
        node = start_shoal(path, Path(tmp), threads, timeout=1200)
        try:
            with httpx.Client(timeout=1800) as client:
                wall_request(client, node, STORY, 8)  # warm-up
                for round_ in range(rounds):
                    base = llama_bench(llama, path, threads, 0, OUTPUT_TOKENS, 1).decode_tps
                    shoal, _ = shoal_decode(client, node, timing)
                    ratios.append(shoal / base)
                    line = f"{path.stem} round {round_ + 1}: llama.cpp {base:.1f} tok/s, Shoal {shoal:.1f}"
                    print(line, flush=True)
        finally:
            node.stop(timeout=30)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(moe_models.GGUF_ROWS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=5, help="llama.cpp / Shoal pairs per model")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="threads for both")
    args = parser.parse_args()
    llama = ensure_llamacpp(jobs=args.threads)
    ggufs = prepare_ggufs(args.models, False, llama, args.threads)
    ggufs |= moe_models.prepare_moe_ggufs(args.models, False, llama, args.threads)
    print(f"{cpu_model()}, {args.threads} threads, load average {loadavg()}", flush=True)
    summary = []
    for name, path in ggufs.items():
        ratios = pairs(llama, name, path, args.rounds, args.threads)
        summary.append((path.stem, statistics.median(ratios), min(ratios), max(ratios)))
    print(f"\n{cpu_model()}, {args.threads} threads, load average at the end {loadavg()}")
    for stem, mid, low, high in summary:
        print(f"{stem:<32} Shoal / llama.cpp decode: median {mid:.2f} (rounds {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
