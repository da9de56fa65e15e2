"""Shoal against llama.cpp on the same GGUF file (and against mlx-lm on MLX folders), side by side.

Per GGUF, in one run: `llama-bench -p 500 -n 64` (prefill pp500, decode tg64; peak RSS from
`/usr/bin/time -v`), and a real `shoal run --model FILE` node through the streamed chat API
(`bench/side_by_side.py`: decode of 64 greedy tokens, prefill of a ~500-token prompt after a
warm-up, peak RSS of node + runner). The decode limit is the stored weight bytes a step reads
(all but an untied embedding table; of expert layers only the top-k experts' share: the active
bytes) over the memory bandwidth measured in the same run (numpy sum on T threads, best of the
start and the end).

Dense rows (`--models dense`; cached in `$SHOAL_BENCH_CACHE`, default `~/.cache/shoal-bench`):
the built-in SmolLM2-135M (Q4_1), a random Llama-3.2-1B-shaped model (16 x 2048, MLP 8192, 32/8
heads, SmolLM2's 49k tokenizer, untied; `--small`: ~250M) written as F16 and quantized by
llama-quantize to Q4_0, Q8_0 and Q4_K_M, and the same shape as an MLX 4-bit folder (group 64,
float32 scales: mlx-lm's fastest CPU case) against plain `mlx_lm.stream_generate` in a
subprocess. Mixture-of-experts rows (`--models moe`, `bench/moe_models.py`): random qwen3moe
(Q4_0, Q4_K_M) and gpt-oss (MXFP4_MOE) GGUFs, and qwen3_moe 4-bit and gpt_oss MXFP4-Q8 MLX
folders against mlx-lm; gpt-oss rows are timed by whole requests (side_by_side.py says why), and
each MoE row prints the issue's targets as met or missed. `--depth N` adds decode after N tokens of
context on the GGUF rows: `llama-bench -p 0 -n 64 -d N` against Shoal decoding 64 tokens after a
prompt of about N tokens (its KV cache that deep). MLX's CPU kernels are slow (4-bit:
~2 GFLOP/s here), so mlx-lm reads only the first --mlx-lm-prompt-tokens of the same prompt and
generates --mlx-lm-tokens.

    .venv/bin/python bench/vs_llamacpp.py [--small] [--threads 2] [--models dense|moe|smollm2 ...]
        [--skip-llamacpp] [--repeats 1] [--json out.json] [--unfused] [--depth 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import moe_models
from bench.common import builtin_model, loadavg
from bench.llamacpp import (
    GGUF_QUANTS,
    LLAMA_1B,
    LLAMA_SMALL,
    bench_cache,
    ensure_llamacpp,
    find_llamacpp,
    gguf_bytes_per_token,
    llama_bench,
    prepare_ggufs,
)
from bench.runner_speed import memory_bandwidth, prompt_text
from bench.side_by_side import OUTPUT_TOKENS, Measured, bench_mlx_lm, bench_shoal
from node.cpu.calibration import cpu_model
from node.cpu.fastpath import usable_cores

PROMPT_TOKENS = 500
DENSE = ["smollm2", *GGUF_QUANTS, "mlx4"]
MODELS = [*DENSE, *moe_models.ROWS]
GROUPS = {"dense": DENSE, "moe": moe_models.ROWS}
"""Names `--models` also takes, for a group of rows."""


# ---- models ----------------------------------------------------------------------------------------


def prepare_mlx4(small: bool) -> Path:
    """An MLX 4-bit (group 64) folder of the random llama shape: a float16 random model, converted
    by mlx-lm with float32 scales (its fastest CPU kernels; bf16/f16 ones are 10-40x slower)."""
    import shutil

    from mlx_lm import convert

    from tests.model_factory import make_random_model

    shape, tag = (LLAMA_SMALL, "llama-250m") if small else (LLAMA_1B, "llama-1b")
    out = bench_cache() / f"{tag}-mlx4"
    if (out / "config.json").is_file():
        return out
    f16 = bench_cache() / f"{tag}-mlx-f16"
    shutil.rmtree(f16, ignore_errors=True)
    print(f"  writing {out} (random float16 model, then mlx-lm convert q4 g64)", flush=True)
    make_random_model(
        f16,
        tokenizer_from=builtin_model(),
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        dtype="float16",
    )
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    convert(str(f16), str(partial), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    partial.rename(out)
    shutil.rmtree(f16)
    return out


# ---- the table -------------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    baseline: str
    base: Measured
    shoal: Measured
    bytes_per_token: int
    note: str = ""
    moe: bool = False
    """A mixture-of-experts row: the table says which of the issue's targets it meets."""


def _num(value: float, digits: int = 1) -> str:
    return "-" if value != value or value == 0 else f"{value:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not (a == a and b == b and a and b) else f"{a / b:.2f}"


def print_table(results: list[Result], bandwidth: float, threads: int) -> None:
    header = f"{'model':<32} {'metric':<30} {'baseline':<10} {'base':>9} {'Shoal':>9} {'Shoal/base':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        b, s = r.base, r.shoal
        limit = bandwidth * 1e9 / r.bytes_per_token
        base_mb, shoal_mb = b.peak_rss / 1e6, s.peak_rss / 1e6
        rows = [
            ("prefill tok/s", b.prefill_tps, s.prefill_tps, _ratio(s.prefill_tps, b.prefill_tps)),
            ("decode tok/s", b.decode_tps, s.decode_tps, _ratio(s.decode_tps, b.decode_tps)),
            (
                f"decode tok/s at depth {s.depth_tokens}",
                b.depth_decode_tps,
                s.depth_decode_tps,
                _ratio(s.depth_decode_tps, b.depth_decode_tps),
            ),
            ("peak RSS MB (lower is better)", base_mb, shoal_mb, _ratio(shoal_mb, base_mb)),
        ]
        for metric, base, shoal, ratio in rows:
            if base != base and shoal != shoal:
                continue  # not measured (no --depth)
            print(f"{r.model:<32} {metric:<30} {r.baseline:<10} {_num(base):>9} {_num(shoal):>9} {ratio:>10}")
        gb = r.bytes_per_token / 1e9
        print(f"{r.model:<32} {'decode limit tok/s':<30} {'':<10} {limit:>9.1f}   ({gb:.3f} GB/token)")
        pct = ["-" if m.error else f"{m.decode_tps / limit:.0%}" for m in (s, b)]
        print(f"{'':<32} Shoal decode = {pct[0]} of the bandwidth limit ({r.baseline}: {pct[1]})")
        notes = [
            f"{r.baseline}: {b.error}" if b.error else "",
            f"Shoal: {s.error}" if s.error else "",
            r.note,
            moe_models.targets(r.baseline, b, s, limit) if r.moe else "",
        ]
        for line in filter(None, notes):
            print(f"{'':<32} {line}")
    print(f"\n{cpu_model()}, {threads} threads")
    print(f"memory bandwidth {bandwidth:.1f} GB/s (numpy sum, best of start/end)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=usable_cores(), help="threads for both (default: cores)"
    )
    parser.add_argument(
        "--models", nargs="*", default=MODELS, choices=[*MODELS, *GROUPS], help="rows, or a group of them"
    )
    parser.add_argument("--small", action="store_true", help="smaller random shapes (dense ~250M)")
    parser.add_argument("--skip-llamacpp", action="store_true", help="Shoal only (no llama-bench runs)")
    parser.add_argument("--repeats", type=int, default=1, help="Shoal requests and llama-bench -r (median)")
    parser.add_argument("--mlx-lm-prompt-tokens", type=int, default=64, help="mlx-lm's prefill prompt")
    parser.add_argument("--mlx-lm-tokens", type=int, default=16, help="tokens mlx-lm generates")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--unfused", action="store_true", help="also Shoal with SHOAL_FUSED_LAYERS=0 (a base)"
    )
    parser.add_argument(
        "--depth", type=int, default=0, help="also decode after this many tokens of context (GGUF rows)"
    )
    args = parser.parse_args()
    names = [n for name in args.models for n in GROUPS.get(name, [name])]

    threads = args.threads
    llama = find_llamacpp() if args.skip_llamacpp else ensure_llamacpp(jobs=threads)
    print(f"{cpu_model()}; load average at the start: {loadavg()}", flush=True)
    before = memory_bandwidth(threads, gib=1.0)
    print(f"memory bandwidth: {before:.1f} GB/s with {threads} threads", flush=True)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(builtin_model())
    long_text = prompt_text(tokenizer, PROMPT_TOKENS)
    depth_text = prompt_text(tokenizer, args.depth) if args.depth else None
    ggufs = prepare_ggufs(names, args.small, llama, threads)
    ggufs |= moe_models.prepare_moe_ggufs(names, args.small, llama, threads)
    results: list[Result] = []
    for name, path in ggufs.items():
        read, total, types = gguf_bytes_per_token(path)
        label = "smollm2-135m-q4_1" if name == "smollm2" else path.stem
        print(f"{label}: {path} ({total / 1e6:.0f} MB; tensors {types})", flush=True)
        base = Measured(error="skipped (--skip-llamacpp)")
        if llama is not None and not args.skip_llamacpp:
            print("  llama-bench ...", flush=True)
            bench = llama_bench(llama, path, threads, PROMPT_TOKENS, OUTPUT_TOKENS, max(2, args.repeats))
            base = Measured(bench.prefill_tps, bench.decode_tps, bench.peak_rss, PROMPT_TOKENS, OUTPUT_TOKENS)
            if args.depth:
                print(f"  llama-bench at depth {args.depth} ...", flush=True)
                deep = llama_bench(llama, path, threads, 0, OUTPUT_TOKENS, max(2, args.repeats), args.depth)
                base.depth_decode_tps, base.depth_tokens = deep.decode_tps, args.depth
        print("  shoal ...", flush=True)
        timing = moe_models.timing(name)
        shoal = bench_shoal(path, long_text, threads, args.repeats, timing=timing, depth_text=depth_text)
        note = f"Shoal prompt {shoal.prompt_tokens} tokens, llama.cpp pp{PROMPT_TOKENS} / tg{OUTPUT_TOKENS}"
        note += ", Shoal timed by whole requests" if timing == "requests" else ""
        results.append(Result(label, "llama.cpp", base, shoal, read, note, name in moe_models.ROWS))
        print(f"  done: llama.cpp {asdict(base)}\n        shoal {asdict(shoal)}", flush=True)
        if args.unfused:
            print("  shoal, layers not fused ...", flush=True)
            unfused = bench_shoal(path, long_text, threads, args.repeats, env={"SHOAL_FUSED_LAYERS": "0"})
            results.append(
                Result(label, "unfused", unfused, shoal, read, "base: Shoal with SHOAL_FUSED_LAYERS=0")
            )
    for name in (n for n in names if n == "mlx4" or n in moe_models.MLX_ROWS):
        folder = prepare_mlx4(args.small) if name == "mlx4" else moe_models.prepare_moe_mlx(name, args.small)
        label = folder.name.replace("-mlx4", " mlx4-g64")
        print(f"{label}: {folder}\n  mlx-lm ...", flush=True)
        base = bench_mlx_lm(folder, long_text, args.mlx_lm_prompt_tokens, args.mlx_lm_tokens)
        print("  shoal ...", flush=True)
        timing = moe_models.timing(name)
        shoal = bench_shoal(folder, long_text, threads, args.repeats, timing=timing)
        note = (
            f"mlx-lm: prefill of the prompt's first {base.prompt_tokens} tokens, {base.output_tokens} "
            f"generated (its CPU kernels are slow); Shoal {shoal.prompt_tokens} / {OUTPUT_TOKENS}"
        )
        note += ", Shoal timed by whole requests" if timing == "requests" else ""
        read = moe_models.mlx_bytes_per_token(folder)
        results.append(Result(label, "mlx-lm", base, shoal, read, note, name != "mlx4"))
        print(f"  done: mlx-lm {asdict(base)}\n        shoal {asdict(shoal)}", flush=True)
    bandwidth = max(before, memory_bandwidth(threads, gib=1.0))
    print(f"load average at the end: {loadavg()}\n")
    print_table(results, bandwidth, threads)
    for r in results:
        if r.shoal.detail:
            parts = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in r.shoal.detail.items())
            print(f"Shoal memory, {r.model}: {parts}")
    if args.json:
        payload = {"threads": threads, "bandwidth_gbs": bandwidth, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
