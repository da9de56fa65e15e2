"""Runner speed on this CPU: Shoal's API (fast CPU path) vs plain mlx-lm vs the memory-bandwidth limit.

For each model, in one run: prefill and decode tokens/s through a real `shoal run` node (streamed,
greedy, a ~500-token prompt, 64 output tokens); `mlx_lm.stream_generate` in this process on the
model as stored (what a user gets from mlx-lm: bf16 stays bf16, no shim); the same in a process set
up like a runner (shim, threads, float32 weights: the fast path without the serving loop and HTTP
around it); and the decode ceiling set by memory bandwidth (stored weight bytes read per token /
the bandwidth measured here with all usable cores summing a 2 GiB array).

Models: the built-in SmolLM2-135M (Q4_1 as stored), a random-weight Qwen3-0.6B-shaped model
stored as bfloat16 (`qwen3`), like the real checkpoint, or as float32 (`qwen3-f32`) (28 layers,
hidden 1024, MLP 3072, 16 heads, 8 KV heads; the built-in's 49k tokenizer instead of Qwen's 152k,
so its head and embedding are smaller).

    .venv/bin/python bench/runner_speed.py [--repeats 3] [--threads 1 2] [--models smollm2 qwen3 qwen3-f32]
        [--kernels-off]   # also Shoal with SHOAL_KERNELS=0: float32 weights, the route before the kernels
        [--blas-only]     # only the first table: float32 products through the BLAS shim vs MLX's BLAS

It starts with float32 products (a 256x1024 prompt chunk times a 1024x1024 weight, what a float32
model's prefill does) in GFLOP/s: through the BLAS shim (OpenBLAS, the shim's pool) at the default
and the `--threads` counts, and through MLX's own reference BLAS, in fresh processes.

Shoal's prefill rate is prompt tokens / time to the first streamed token (it includes the first
decode step and the HTTP round trip); its decode rate is (tokens - 1) / (last - first token time).
mlx-lm's figures are its own `prompt_tps` and `generation_tps`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import builtin_model, chat_body, loadavg, stream_chat
from node.cpu import fastpath
from node.cpu.fastpath import usable_cores
from tests.model_factory import make_random_model
from tests.nodes import start_node

PROMPT_TOKENS = 500
OUTPUT_TOKENS = 64
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening "
    "to the sea. One night a bottle washed up on the rocks below, and inside it was a letter. "
)


@dataclass
class Speed:
    prefill_tps: float
    decode_tps: float
    prompt_tokens: int
    output_tokens: int


def memory_bandwidth(threads: int, gib: float = 2.0) -> float:
    """GB/s reading a `gib` GiB float32 array, summed by `threads` threads (numpy frees the GIL)."""
    data = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(3):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


_PRODUCTS = """
import time, mlx.core as mx
a, w = mx.random.normal((256, 1024)), mx.random.normal((1024, 1024))
mx.eval(a @ w.T)
start = time.perf_counter()
for _ in range(8):
    mx.eval(a @ w.T)
print(8 * 2 * 256 * 1024 * 1024 / (time.perf_counter() - start) / 1e9)
"""


def product_gflops(env: dict[str, str]) -> float:
    """GFLOP/s of float32 256x1024 @ 1024x1024 products in a fresh process with `env` added."""
    argv = [sys.executable, "-c", _PRODUCTS]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def print_products(threads: list[str]) -> None:
    """The BLAS shim (as runners get it) beside MLX's reference BLAS, side by side."""
    fast = fastpath.decide()
    rows = [("MLX reference BLAS", product_gflops({}))]
    if fast.enabled:
        rows.append((f"BLAS shim ({fast.env['SHOAL_BLAS_THREADS']} thr, default)", product_gflops(fast.env)))
        for count in threads:
            rows.append(
                (f"BLAS shim ({count} thr)", product_gflops({**fast.env, "SHOAL_BLAS_THREADS": count}))
            )
    else:
        print(f"  ({fast.message})")
    print(f"{'float32 256x1024 @ 1024x1024':<32} {'GFLOP/s':>8}  vs reference")
    for label, gflops in rows:
        print(f"{label:<32} {gflops:>8.1f}  x{gflops / rows[0][1]:.1f}")


def decode_bytes(model_dir: Path) -> int:
    """Weight bytes one decode step reads as stored (what the kernels read): every parameter except
    the embedding table, of which a lookup reads one row, unless there is no lm_head (tied): then
    the head reads it all."""
    import mlx.core as mx

    sizes: dict[str, int] = {}
    for path in model_dir.glob("*.safetensors"):
        weights = mx.load(str(path))
        assert isinstance(weights, dict)
        sizes.update({name: value.nbytes for name, value in weights.items()})
    total = sum(sizes.values())
    if any(name.startswith("lm_head.") for name in sizes):
        total -= sum(n for name, n in sizes.items() if "embed_tokens." in name)
    return total


def messages(text: str) -> list[dict[str, str]]:
    """A chat whose first tokens differ on every call, so no prefix cache can skip the prefill."""
    nonce = next(_NONCES)
    return [
        {"role": "system", "content": f"Session {nonce}. You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


_NONCES = itertools.count(int(time.time()))


def prompt_text(tokenizer: Any, target: int) -> str:
    """A user message whose chat prompt is about `target` tokens."""

    def length(text: str) -> int:
        return len(tokenizer.apply_chat_template(messages(text), add_generation_prompt=True))

    text = STORY
    while length(text) < target:
        text += STORY
    return text


def bench_mlx_lm(model_dir: Path, text: str) -> Speed:
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))[:2]
    prompt = tokenizer.apply_chat_template(messages(text), add_generation_prompt=True)
    for _ in stream_generate(model, tokenizer, prompt[:16], max_tokens=2):  # warm up
        pass
    r = list(stream_generate(model, tokenizer, prompt, max_tokens=OUTPUT_TOKENS))[-1]
    return Speed(r.prompt_tps, r.generation_tps, r.prompt_tokens, r.generation_tokens)


_IN_RUNNER = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mlx_lm import stream_generate
from node.runner.engine import load_model
loaded = load_model(Path(sys.argv[2]), vocab_dir=None)
prompt = loaded.tokenizer.apply_chat_template(json.loads(sys.argv[3]), add_generation_prompt=True)
for _ in stream_generate(loaded.model, loaded.tokenizer, prompt[:16], max_tokens=2):
    pass
r = list(stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=int(sys.argv[4])))[-1]
print(json.dumps([r.prompt_tps, r.generation_tps, r.prompt_tokens, r.generation_tokens]))
"""


def bench_fast_in_process(model_dir: Path, text: str) -> Speed:
    """`mlx_lm.stream_generate` in a process set up like a runner (shim, threads, dtype policy):
    what the fast path gives without the runner's serving loop and the HTTP API around it."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, **fastpath.decide().env}
    argv = [
        sys.executable,
        "-c",
        _IN_RUNNER,
        root,
        str(model_dir),
        json.dumps(messages(text)),
        str(OUTPUT_TOKENS),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    prefill, decode, prompt, output = json.loads(done.stdout.splitlines()[-1])
    return Speed(prefill, decode, prompt, output)


def bench_shoal(client: httpx.Client, base_url: str, model_id: str, text: str) -> Speed:
    stream = stream_chat(client, base_url, chat_body(model_id, messages(text), OUTPUT_TOKENS))
    prompt, output = int(stream.usage["prompt_tokens"]), int(stream.usage["completion_tokens"])
    run = stream.run()
    return Speed(prompt / run.ttft_s, run.decode_tps, prompt, output)


def shoal_runs(
    model_dir: Path, data_dir: Path, text: str, repeats: int, threads: str | None, *, kernels: bool = True
) -> list[Speed]:
    env = {"SHOAL_BLAS_THREADS": threads} if threads else {}
    if not kernels:
        env["SHOAL_KERNELS"] = "0"  # the float32 route every model took before the kernels
    node = start_node(data_dir=data_dir, model=str(model_dir), env=env, ready_timeout=600)
    try:
        assert node.model_id is not None
        for line in node.log:
            if "fast CPU path" in line or "weights:" in line:
                print("   ", line.strip().split(": ", 1)[-1], flush=True)
        with httpx.Client(timeout=1200) as client:
            bench_shoal(client, node.base_url, node.model_id, STORY)  # warm up
            return [bench_shoal(client, node.base_url, node.model_id, text) for _ in range(repeats)]
    finally:
        node.stop()


def median(runs: list[Speed]) -> Speed:
    return Speed(
        statistics.median(r.prefill_tps for r in runs),
        statistics.median(r.decode_tps for r in runs),
        runs[0].prompt_tokens,
        runs[0].output_tokens,
    )


def qwen3_shaped(tmp: Path, builtin: Path, dtype: str = "bfloat16") -> Path:
    return make_random_model(
        tmp / f"qwen3-0.6b-shape-{dtype}",
        tokenizer_from=builtin,
        model_type="qwen3",
        num_layers=28,
        hidden_size=1024,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        max_position_embeddings=4096,
        dtype=dtype,  # type: ignore[arg-type]
    )


Row = tuple[str, str, str, str, str]


@dataclass
class ModelResult:
    label: str
    plain: Speed
    fast: list[tuple[str, Speed]]
    bytes_per_token: int

    def rows(self, bandwidth: float) -> list[Row]:
        limit = bandwidth * 1e9 / self.bytes_per_token
        plain = self.plain
        rows = [
            (self.label, "mlx-lm stream_generate", f"{plain.prefill_tps:.1f}", f"{plain.decode_tps:.2f}", "")
        ]
        for tag, speed in self.fast:
            prefill_x = speed.prefill_tps / plain.prefill_tps
            decode_x = speed.decode_tps / plain.decode_tps
            note = (
                f"x{prefill_x:.1f} prefill, x{decode_x:.2f} decode, {speed.decode_tps / limit:.0%} of limit"
            )
            rows.append((self.label, tag, f"{speed.prefill_tps:.1f}", f"{speed.decode_tps:.2f}", note))
        per_token = f"{self.bytes_per_token / 1e9:.2f} GB/token at {bandwidth:.1f} GB/s"
        rows.append((self.label, "bandwidth limit (stored)", "", f"{limit:.2f}", per_token))
        return rows


def bench_model(label: str, model_dir: Path, tmp: Path, args: argparse.Namespace) -> ModelResult:
    from mlx_lm.utils import load_tokenizer

    text = prompt_text(load_tokenizer(model_dir), PROMPT_TOKENS)
    print(f"{label}: mlx-lm as stored ...", flush=True)
    plain = bench_mlx_lm(model_dir, text)
    print(f"{label}: mlx-lm + fast path, in a runner-like process ...", flush=True)
    fast: list[tuple[str, Speed]] = [("mlx-lm + fast path", bench_fast_in_process(model_dir, text))]
    for threads in [None, *args.threads]:
        tag = f"shoal API ({threads} thr)" if threads else "shoal API (default)"
        print(f"{label}: {tag} ...", flush=True)
        fast.append((tag, median(shoal_runs(model_dir, tmp / "data", text, args.repeats, threads))))
    if args.kernels_off:
        print(f"{label}: shoal API, SHOAL_KERNELS=0 ...", flush=True)
        runs = shoal_runs(model_dir, tmp / "data", text, args.repeats, None, kernels=False)
        fast.append(("shoal API (kernels off)", median(runs)))
    last = fast[-1][1]
    print(f"{label}: prompt {last.prompt_tokens} tokens, {last.output_tokens} generated", flush=True)
    return ModelResult(label, plain, fast, decode_bytes(model_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Shoal requests per model (median)")
    parser.add_argument("--threads", nargs="*", default=[], help="also run Shoal with these thread counts")
    parser.add_argument(
        "--models", nargs="*", default=["smollm2", "qwen3"], choices=["smollm2", "qwen3", "qwen3-f32"]
    )
    parser.add_argument(
        "--kernels-off", action="store_true", help="also run Shoal with SHOAL_KERNELS=0 (float32, as before)"
    )
    parser.add_argument("--blas-only", action="store_true", help="only the float32 product figures")
    args = parser.parse_args()

    print(f"load average at the start: {loadavg()} (other work on this machine skews every figure)")
    print_products(args.threads)
    if args.blas_only:
        return
    print()
    builtin = builtin_model()
    cores = usable_cores()
    before = memory_bandwidth(cores)
    print(f"memory bandwidth: {before:.1f} GB/s with {cores} threads ({memory_bandwidth(1):.1f} with 1)")
    results: list[ModelResult] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in args.models:
            if name == "smollm2":
                results.append(bench_model("smollm2-135m", builtin, tmp, args))
            elif name == "qwen3":
                results.append(bench_model("qwen3-0.6b bf16", qwen3_shaped(tmp, builtin), tmp, args))
            else:
                f32 = qwen3_shaped(tmp, builtin, "float32")
                results.append(bench_model("qwen3-0.6b f32", f32, tmp, args))
    after = memory_bandwidth(cores)
    # The best of two measurements: other processes only ever make a reading lower than the hardware's.
    bandwidth = max(before, after)
    print(f"memory bandwidth at the end: {after:.1f} GB/s; the limit uses {bandwidth:.1f}")
    print(f"load average at the end: {loadavg()}")
    print()
    print(f"{'model':<18} {'path':<24} {'prefill tok/s':>13} {'decode tok/s':>12}  vs mlx-lm / limit")
    for result in results:
        for row in result.rows(bandwidth):
            print(f"{row[0]:<18} {row[1]:<24} {row[2]:>13} {row[3]:>12}  {row[4]}")


if __name__ == "__main__":
    main()
