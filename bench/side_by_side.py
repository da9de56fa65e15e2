"""One model measured by Shoal (a real node, through the chat API) and by plain mlx-lm (a subprocess).

Shoal: `shoal run --model PATH` (own temp data dir, prefix cache off), a warm-up request, then
decode tok/s of a short greedy prompt (64 tokens) and prefill tok/s of a ~500-token one; its
memory is the peak RSS of node + runner sampled with psutil (and each one's VmHWM). Two timings:
- `chunks`: prefill = prompt tokens / time to the first content chunk, decode = the tokens after
  the first over the time from the first content chunk to the last (what a client sees);
- `requests`: from whole-request wall times, for models whose output reaches the client in few
  chunks (a gpt_oss model with random weights: openai-harmony's parser holds tokens back until
  the format breaks or the message ends): prefill = prompt tokens / wall time of a 1-token
  request, decode = (completion tokens of the 64-token request - 1) / (its wall time - that of
  a 1-token request on the same-length prompt).
mlx-lm: `stream_generate` on the folder in a subprocess, its own prompt_tps / generation_tps.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

from bench.common import chat_body, stream_chat
from bench.runner_speed import STORY, messages
from tests.nodes import RunningNode, spawn_node

OUTPUT_TOKENS = 64
Timing = Literal["chunks", "requests"]
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
        command = " ".join(proc.cmdline())
        if "node.tensor.follower" in command:
            return "tensor rank"
        return "runner" if "node.runner" in command else f"{proc.name()} {proc.pid}"

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
    depth_decode_tps: float = float("nan")
    """Decode after a long prompt (`--depth`), NaN when not measured."""
    depth_tokens: int = 0


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


def wall_request(client: httpx.Client, node: RunningNode, text: str, tokens: int) -> tuple[float, int, int]:
    """(seconds, prompt tokens, completion tokens) of one whole streamed request."""
    stream = stream_chat(client, node.base_url, chat_body(node.model_id, messages(text), tokens))
    seconds = time.perf_counter() - stream.start
    return seconds, int(stream.usage["prompt_tokens"]), int(stream.usage["completion_tokens"])


def shoal_decode(client: httpx.Client, node: RunningNode, timing: Timing) -> tuple[float, int]:
    """(decode tok/s, completion tokens) of STORY, timed by content chunks or by whole requests
    (module docstring)."""
    if timing == "chunks":
        _, decode, _, output = shoal_request(client, node, STORY, OUTPUT_TOKENS)
        return decode, output
    first, _, _ = wall_request(client, node, STORY, 1)
    whole, _, output = wall_request(client, node, STORY, OUTPUT_TOKENS)
    return ((output - 1) / (whole - first) if output > 1 and whole > first else float("nan")), output


def shoal_rates(
    client: httpx.Client, node: RunningNode, long_text: str, timing: Timing
) -> tuple[float, float, int, int]:
    """(prefill tok/s, decode tok/s, prompt tokens, completion tokens): a decode of STORY, then a
    prefill of `long_text`, timed as `shoal_decode` and the same way."""
    decode, output = shoal_decode(client, node, timing)
    if timing == "chunks":
        prefill, _, prompt, _ = shoal_request(client, node, long_text, 2)
        return prefill, decode, prompt, output
    seconds, prompt, _ = wall_request(client, node, long_text, 1)
    return prompt / seconds, decode, prompt, output


def bench_shoal(
    model: Path,
    long_text: str,
    threads: int,
    repeats: int,
    env: dict[str, str] | None = None,
    timing: Timing = "chunks",
    depth_text: str | None = None,
) -> Measured:
    """Prefill, decode and peak memory of `model` on a real node; with `depth_text`, also decode
    after that prompt (its KV cache that deep), timed by chunks."""
    result = Measured()
    with tempfile.TemporaryDirectory(prefix="shoal-vs-llamacpp-") as tmp:
        started = time.perf_counter()
        try:
            node = start_shoal(model, Path(tmp), threads, timeout=1200, env=env)
        except (RuntimeError, AssertionError) as exc:  # the reason, and the node's last log line
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["?"]
            result.error = " ... ".join(dict.fromkeys([lines[0], lines[-1]]))[:400]
            return result
        print(f"    node ready in {time.perf_counter() - started:.0f} s", flush=True)
        sampler = PeakRss(node.process.pid)
        try:
            prefill: list[float] = []
            decode: list[float] = []
            with httpx.Client(timeout=1800) as client:
                wall_request(client, node, STORY, 8)  # warm-up
                for _ in range(repeats):
                    p, d, result.prompt_tokens, result.output_tokens = shoal_rates(
                        client, node, long_text, timing
                    )
                    prefill.append(p)
                    decode.append(d)
                result.prefill_tps, result.decode_tps = statistics.median(prefill), statistics.median(decode)
                hwm = sampler.hwm()
                sampler.stop()  # the peak memory is that of the ~500-token prompt, as llama-bench's
                if depth_text is not None:
                    _, result.depth_decode_tps, result.depth_tokens, _ = shoal_request(
                        client, node, depth_text, OUTPUT_TOKENS
                    )
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
