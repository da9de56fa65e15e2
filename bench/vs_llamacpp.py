"""Shoal against llama.cpp on the same GGUF file (and against mlx-lm on an MLX 4-bit folder), side by side.

Per GGUF, in one run: `llama-bench -p 500 -n 64` (prefill pp500, decode tg64; peak RSS from
`/usr/bin/time -v`), and a real `shoal run --model FILE` node (own temp data dir, prefix cache off)
through the streamed chat API: decode tok/s of a short greedy prompt (64 tokens), prefill tok/s of
a ~500-token one (usage.prompt_tokens / time to first token, after a warm-up); its memory is the
peak RSS of node + runner sampled with psutil (and each one's VmHWM). The decode limit is the
stored weight bytes a step reads (all but an untied embedding table) over the memory bandwidth
measured in the same run (numpy sum on T threads).

Models (cached in `$SHOAL_BENCH_CACHE`, default `~/.cache/shoal-bench`): the built-in SmolLM2-135M
(Q4_1), a random Llama-3.2-1B-shaped model (16 x 2048, MLP 8192, 32/8 heads, SmolLM2's 49k
tokenizer, untied; `--small`: ~250M) written as F16 and quantized by llama-quantize to Q4_0, Q8_0
and Q4_K_M, and the same shape as an MLX 4-bit folder (group 64, float32 scales: mlx-lm's fastest
CPU case) against plain `mlx_lm.stream_generate` in a subprocess. MLX's CPU 4-bit kernels run at
~2 GFLOP/s here, so mlx-lm reads only the first --mlx-lm-prompt-tokens of the same prompt and
generates --mlx-lm-tokens.

    .venv/bin/python bench/vs_llamacpp.py [--small] [--threads 2] [--models smollm2 q4_0 ...]
        [--skip-llamacpp] [--repeats 1] [--json out.json] [--unfused]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import builtin_model, chat_body, loadavg, stream_chat
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
from bench.runner_speed import STORY, memory_bandwidth, messages, prompt_text
from node.cpu.fastpath import usable_cores
from tests.nodes import RunningNode, spawn_node

PROMPT_TOKENS = 500
OUTPUT_TOKENS = 64
MODELS = ["smollm2", *GGUF_QUANTS, "mlx4"]
_NODE_END = re.compile(r"model (\S+) ready|cannot resolve model.*|cannot be served.*|^shoal: .*")


# ---- memory ----------------------------------------------------------------------------------------


class PeakRss:
    """Samples the RSS of a process and all its descendants every 100 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_sum = 0
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _label(self, proc: psutil.Process) -> str:
        if proc.pid == self.root.pid:
            return "node"
        return "runner" if "node.runner" in " ".join(proc.cmdline()) else f"{proc.name()} {proc.pid}"

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    rss = int(proc.memory_info().rss)
                    label = self._label(proc)
                except psutil.Error:
                    continue
                total += rss
                self.peaks[label] = max(self.peaks.get(label, 0), rss)
            self.peak_sum = max(self.peak_sum, total)

    def hwm(self) -> dict[str, int]:
        """VmHWM (the kernel's peak RSS) of the node and each descendant alive now."""
        out: dict[str, int] = {}
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                kib = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
                out[self._label(proc)] = kib * 1024
            except (OSError, AttributeError, psutil.Error):
                continue
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


# ---- Shoal -----------------------------------------------------------------------------------------


@dataclass
class Measured:
    prefill_tps: float = float("nan")
    decode_tps: float = float("nan")
    peak_rss: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    detail: dict[str, int] = field(default_factory=dict)
    error: str = ""


def start_shoal(
    model: Path, data_dir: Path, threads: int, timeout: float, env: dict[str, str] | None = None
) -> RunningNode:
    """`shoal run --model model` on loopback with a free port and no prefix cache; returns once
    the model is ready; raises RuntimeError with the node's reason when it cannot serve it."""
    cmd = [sys.executable, "-m", "node.cli", "run", "--api-port", "0", "--data-dir", str(data_dir)]
    cmd += ["--api-host", "127.0.0.1", "--p2p-host", "127.0.0.1", "--no-mdns", "--prefix-cache-tokens", "0"]
    cmd += ["--model", str(model)]
    node = spawn_node(cmd, env={"SHOAL_BLAS_THREADS": str(threads), **(env or {})})
    try:
        node.base_url = node.wait_for_log(r"API listening on (http://\S+)", 120).group(1)
        end = node.wait_for_log(_NODE_END, timeout)
        if not end.group(1):
            raise RuntimeError(end.group(0).strip())
        node.model_id = end.group(1)
    except BaseException:
        node.stop()
        raise
    return node


def shoal_request(
    client: httpx.Client, node: RunningNode, text: str, tokens: int
) -> tuple[float, float, int, int]:
    """(prefill tok/s, decode tok/s, prompt tokens, completion tokens) of one streamed request."""
    stream = stream_chat(client, node.base_url, chat_body(node.model_id, messages(text), tokens))
    prompt, output = int(stream.usage["prompt_tokens"]), int(stream.usage["completion_tokens"])
    run = stream.run()
    return prompt / run.ttft_s, run.decode_tps, prompt, output


def bench_shoal(
    model: Path, long_text: str, threads: int, repeats: int, env: dict[str, str] | None = None
) -> Measured:
    result = Measured()
    with tempfile.TemporaryDirectory(prefix="shoal-vs-llamacpp-") as tmp:
        started = time.perf_counter()
        try:
            node = start_shoal(model, Path(tmp), threads, timeout=1200, env=env)
        except (RuntimeError, AssertionError) as exc:
            result.error = str(exc).splitlines()[0][:300]
            return result
        print(f"    node ready in {time.perf_counter() - started:.0f} s", flush=True)
        sampler = PeakRss(node.process.pid)
        try:
            prefill: list[float] = []
            decode: list[float] = []
            with httpx.Client(timeout=1800) as client:
                shoal_request(client, node, STORY, 8)  # warm-up
                for _ in range(repeats):
                    _, tps, _, result.output_tokens = shoal_request(client, node, STORY, OUTPUT_TOKENS)
                    decode.append(tps)
                    tps, _, result.prompt_tokens, _ = shoal_request(client, node, long_text, 2)
                    prefill.append(tps)
            result.prefill_tps, result.decode_tps = statistics.median(prefill), statistics.median(decode)
            hwm = sampler.hwm()
        finally:
            sampler.stop()
            node.stop(timeout=30)
        result.peak_rss = sampler.peak_sum
        result.detail = {f"peak {k}": v for k, v in sampler.peaks.items()}
        result.detail |= {f"VmHWM {k}": v for k, v in hwm.items()}
    return result


# ---- mlx-lm ----------------------------------------------------------------------------------------

_MLX_LM = """
import json, re, sys
from mlx_lm import load, stream_generate
model, tokenizer = load(sys.argv[1])[:2]
long_prompt = tokenizer.apply_chat_template(json.loads(sys.argv[2]), add_generation_prompt=True)
short_prompt = tokenizer.apply_chat_template(json.loads(sys.argv[3]), add_generation_prompt=True)
prefill_tokens, tokens = int(sys.argv[4]), int(sys.argv[5])
for _ in stream_generate(model, tokenizer, short_prompt[:8], max_tokens=1):  # warm up
    pass
p = list(stream_generate(model, tokenizer, long_prompt[:prefill_tokens], max_tokens=1))[-1]
d = list(stream_generate(model, tokenizer, short_prompt, max_tokens=tokens))[-1]
hwm = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
print(json.dumps([p.prompt_tps, d.generation_tps, p.prompt_tokens, d.generation_tokens, hwm]))
"""


def bench_mlx_lm(model: Path, long_text: str, prefill_tokens: int, tokens: int) -> Measured:
    argv = [sys.executable, "-c", _MLX_LM, str(model), json.dumps(messages(long_text))]
    argv += [json.dumps(messages(STORY)), str(prefill_tokens), str(tokens)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return Measured(error=f"mlx-lm failed: {str(exc.stderr or exc)[-300:]}")
    prefill, decode, prompt, output, hwm = json.loads(done.stdout.splitlines()[-1])
    return Measured(prefill, decode, hwm, prompt, output)


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


def mlx_bytes_per_token(folder: Path) -> int:
    """Stored bytes a decode step reads: every tensor but the (untied) embedding table's."""
    from node.models.shape import read_safetensors_header

    sizes: dict[str, int] = {}
    for path in folder.glob("*.safetensors"):
        for name, info in read_safetensors_header(path).items():
            if isinstance(info, dict) and "data_offsets" in info:
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    total = sum(sizes.values())
    if any(n.startswith("lm_head.") for n in sizes):
        total -= sum(v for n, v in sizes.items() if "embed_tokens." in n)
    return total


# ---- the table -------------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    baseline: str
    base: Measured
    shoal: Measured
    bytes_per_token: int
    note: str = ""


def _num(value: float, digits: int = 1) -> str:
    return "-" if value != value or value == 0 else f"{value:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not (a == a and b == b and a and b) else f"{a / b:.2f}"


def print_table(results: list[Result], bandwidth: float, threads: int) -> None:
    header = f"{'model':<22} {'metric':<30} {'baseline':<10} {'base':>9} {'Shoal':>9} {'Shoal/base':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        b, s = r.base, r.shoal
        limit = bandwidth * 1e9 / r.bytes_per_token
        base_mb, shoal_mb = b.peak_rss / 1e6, s.peak_rss / 1e6
        rows = [
            ("prefill tok/s", b.prefill_tps, s.prefill_tps, _ratio(s.prefill_tps, b.prefill_tps)),
            ("decode tok/s", b.decode_tps, s.decode_tps, _ratio(s.decode_tps, b.decode_tps)),
            ("peak RSS MB (lower is better)", base_mb, shoal_mb, _ratio(shoal_mb, base_mb)),
        ]
        for metric, base, shoal, ratio in rows:
            print(f"{r.model:<22} {metric:<30} {r.baseline:<10} {_num(base):>9} {_num(shoal):>9} {ratio:>10}")
        gb = r.bytes_per_token / 1e9
        print(f"{r.model:<22} {'decode limit tok/s':<30} {'':<10} {limit:>9.1f}   ({gb:.3f} GB/token)")
        pct = ["-" if m.error else f"{m.decode_tps / limit:.0%}" for m in (s, b)]
        print(f"{'':<22} Shoal decode = {pct[0]} of the bandwidth limit ({r.baseline}: {pct[1]})")
        notes = [
            f"{r.baseline}: {b.error}" if b.error else "",
            f"Shoal: {s.error}" if s.error else "",
            r.note,
        ]
        for line in filter(None, notes):
            print(f"{'':<22} {line}")
    print(f"\n{threads} threads, memory bandwidth {bandwidth:.1f} GB/s (numpy sum, best of start/end)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=usable_cores(), help="threads for both (default: cores)"
    )
    parser.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    parser.add_argument("--small", action="store_true", help="a ~250M random shape instead of the 1B one")
    parser.add_argument("--skip-llamacpp", action="store_true", help="Shoal only (no llama-bench runs)")
    parser.add_argument("--repeats", type=int, default=1, help="Shoal requests and llama-bench -r (median)")
    parser.add_argument("--mlx-lm-prompt-tokens", type=int, default=64, help="mlx-lm's prefill prompt")
    parser.add_argument("--mlx-lm-tokens", type=int, default=16, help="tokens mlx-lm generates")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--unfused", action="store_true", help="also Shoal with SHOAL_FUSED_LAYERS=0 (a base)"
    )
    args = parser.parse_args()

    threads = args.threads
    llama = find_llamacpp() if args.skip_llamacpp else ensure_llamacpp(jobs=threads)
    print(f"load average at the start: {loadavg()}", flush=True)
    before = memory_bandwidth(threads, gib=1.0)
    print(f"memory bandwidth: {before:.1f} GB/s with {threads} threads", flush=True)
    from mlx_lm.utils import load_tokenizer

    long_text = prompt_text(load_tokenizer(builtin_model()), PROMPT_TOKENS)
    ggufs = prepare_ggufs(args.models, args.small, llama, threads)
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
        print("  shoal ...", flush=True)
        shoal = bench_shoal(path, long_text, threads, args.repeats)
        note = f"Shoal prompt {shoal.prompt_tokens} tokens, llama.cpp pp{PROMPT_TOKENS} / tg{OUTPUT_TOKENS}"
        results.append(Result(label, "llama.cpp", base, shoal, read, note))
        print(f"  done: llama.cpp {asdict(base)}\n        shoal {asdict(shoal)}", flush=True)
        if args.unfused:
            print("  shoal, layers not fused ...", flush=True)
            unfused = bench_shoal(path, long_text, threads, args.repeats, env={"SHOAL_FUSED_LAYERS": "0"})
            results.append(
                Result(label, "unfused", unfused, shoal, read, "base: Shoal with SHOAL_FUSED_LAYERS=0")
            )
    if "mlx4" in args.models:
        folder = prepare_mlx4(args.small)
        label = folder.name.replace("-mlx4", " mlx4-g64")
        print(f"{label}: {folder}\n  mlx-lm ...", flush=True)
        base = bench_mlx_lm(folder, long_text, args.mlx_lm_prompt_tokens, args.mlx_lm_tokens)
        print("  shoal ...", flush=True)
        shoal = bench_shoal(folder, long_text, threads, args.repeats)
        note = (
            f"mlx-lm: prefill of the prompt's first {base.prompt_tokens} tokens, {base.output_tokens} "
            f"generated (its CPU 4-bit kernels are slow); Shoal {shoal.prompt_tokens} / {OUTPUT_TOKENS}"
        )
        results.append(Result(label, "mlx-lm", base, shoal, mlx_bytes_per_token(folder), note))
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
