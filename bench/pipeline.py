"""Pipeline overhead: decode tokens/s and time to first token for 1, 2 and 3 stages on one machine.

Same model, same prompt, greedy. Stages after the first are separate processes on 127.0.0.1; the
first (the driver) runs here. On one machine the stages share its cores and run one after another
for each token, so a pipeline cannot be faster than one process: the ratio to one process measures
what splitting costs. "vs 1 stage" compares with the same driver running the whole model here
(no detokenizing, which `stream_generate` does per token). "2 stages, sealed" is the 2-stage ring
with every frame sealed, as a cluster with a secret runs it: its ratio to "2 stages" (the same ring
in the clear) is what the sealing costs. "ms/hop/token" is measured directly
(`RingStats`): the time a decode step spends going round the ring minus the time the stages
report working, per hop.

    .venv/bin/python bench/pipeline.py [--tokens 32] [--repeats 5] [--fast]

`--fast` runs every process (this one included) on the BLAS fast path of `node.cpu.fastpath`.

Last, failure detection: a 2-stage pipeline's stage process is killed (kill -9) or frozen
(SIGSTOP) 3 tokens into a long generation; the seconds until the driver raises `HopError`, beside
the hop timeout that bounds a freeze (tests assert only that it is raised, and what it says).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
from mlx_lm import load, stream_generate

from bench.common import PROMPT, builtin_model, random_380mb, timed
from node.pipeline.driver import PipelineError, PipelineGenerator
from node.pipeline.hop import HOP_TIMEOUT, HopError
from node.pipeline.link_auth import LINK_ENV, OPEN, LinkSecurity
from node.pipeline.shard import load_shard
from tests.stage_process import StageProcess, even_split, spawn_stage, wait_ready

SEALED = LinkSecurity.for_instance(bytes(32), "bench", sealed=True)
"""Links as with a cluster secret: every frame sealed (AES-GCM), beside the same ring in the clear."""


@dataclass
class Result:
    ttft_s: float
    decode_tps: float
    hop_ms: float
    """Per hop and token: ring time not spent in any stage's own work (nan for one process)."""


@contextmanager
def pipeline(
    model_dir: Path, stages: int, security: LinkSecurity = OPEN
) -> Iterator[tuple[PipelineGenerator, list[StageProcess]]]:
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    ranges = even_split(num_layers, stages)
    env = {**os.environ, LINK_ENV: security.encode()}
    with ExitStack() as stack:
        processes = [spawn_stage(model_dir, start=a, end=b, env=env) for a, b in ranges[1:]]
        for process in processes:
            stack.callback(process.stop)
        for process in processes:
            wait_ready(process)
        driver = PipelineGenerator(
            load_shard(model_dir, start=0, end=ranges[0][1]),
            stages=[p.address for p in processes],
            security=security,
        )
        stack.callback(driver.close)
        driver.connect()
        yield driver, processes


def _pipeline_run(driver: PipelineGenerator, eos: set[int], prompt: list[int], tokens: int) -> Iterator[int]:
    return driver.generate(prompt, max_tokens=tokens, eos_token_ids=eos)


def measure(model_dir: Path, tokens: int, repeats: int) -> dict[str, Result]:
    """Per path: the best TTFT and decode rate of `repeats` runs (background load only ever adds
    time, so the best run is the closest to the path's own cost) and the median hop overhead.
    TTFT uses the whole chat prompt; decode a 4-token prompt, so that slow prefill does not
    stretch the rounds. Paths alternate run by run so drifting load hits all alike."""
    model, tokenizer = load(str(model_dir))[:2]
    prompt = list(
        tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    )
    short = prompt[:4]

    def plain(p: list[int], n: int) -> Iterator[int]:
        return (r.token for r in stream_generate(model, tokenizer, mx.array(p), max_tokens=n))

    paths: dict[str, Callable[[list[int], int], Iterator[int]]] = {"mlx_lm.stream_generate": plain}
    drivers: dict[str, PipelineGenerator] = {}
    ttft: dict[str, list[float]] = {}
    decode: dict[str, list[float]] = {}
    hop: dict[str, list[float]] = {}
    with ExitStack() as stack:
        for stages, security in ((1, OPEN), (2, OPEN), (2, SEALED), (3, OPEN)):
            name = f"{stages} stage{'s' if stages > 1 else ''}{', sealed' if security.sealed else ''}"
            drivers[name] = stack.enter_context(pipeline(model_dir, stages, security))[0]
            paths[name] = functools.partial(_pipeline_run, drivers[name], set(tokenizer.eos_token_ids))
        reference = timed(plain(short, tokens))[1]
        for i in range(repeats + 1):  # the first round warms everything up
            for name, generate in paths.items():
                first = timed(generate(prompt, 1))[0].ttft_s
                run, out = timed(generate(short, tokens))
                if out != reference:
                    print(f"WARNING: {name} differs from mlx_lm.stream_generate", file=sys.stderr)
                if i:
                    ttft.setdefault(name, []).append(first)
                    decode.setdefault(name, []).append(run.decode_tps)
                    stages = int(name[0]) if name[0].isdigit() else 1
                    if stages > 1:
                        hop.setdefault(name, []).append(
                            drivers[name].last_stats.hop_overhead_s * 1e3 / stages
                        )
    return {
        name: Result(
            min(ttft[name]),
            max(decode[name]),
            statistics.median(hop[name]) if name in hop else float("nan"),
        )
        for name in paths
    }


def failure_seconds(model_dir: Path) -> dict[str, float]:
    """Seconds from a 2-stage pipeline's stage process killed or frozen, 3 tokens into a long
    generation, to the driver's `HopError` (nan: the generation ended without noticing)."""
    found: dict[str, float] = {}
    for how, sig in (("stage killed", signal.SIGKILL), ("stage frozen", signal.SIGSTOP)):
        with pipeline(model_dir, 2) as (driver, processes):
            pid = processes[0].process.pid
            found[how], failed_at = float("nan"), 0.0
            try:
                for i, _ in enumerate(driver.generate([1, 2, 3, 4], max_tokens=1000)):
                    if i == 3:
                        os.kill(pid, sig)
                        failed_at = time.perf_counter()
            except (HopError, PipelineError):
                found[how] = time.perf_counter() - failed_at
            finally:
                if sig == signal.SIGSTOP:
                    os.kill(pid, signal.SIGCONT)  # so that it can stop
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fast", action="store_true", help="use the BLAS fast path in every process")
    args = parser.parse_args()
    if args.fast and "SHOAL_OPENBLAS_LIB" not in os.environ:
        from node.cpu.fastpath import decide

        fast = decide()
        print(fast.message, file=sys.stderr)
        if fast.enabled:  # LD_PRELOAD only takes effect at exec: start again with it
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **fast.env})

    builtin = builtin_model()
    with tempfile.TemporaryDirectory() as tmp:
        random_big = random_380mb(Path(tmp), builtin)
        header = ("model", "path", "TTFT ms", "decode tok/s", "vs mlx_lm", "vs 1 stage", "ms/hop/token")
        print("{:<16} {:<24} {:>9} {:>13} {:>10} {:>11} {:>13}".format(*header))
        for name, model_dir in (("smollm2-135m", builtin), ("random-380mb", random_big)):
            results = measure(model_dir, args.tokens, args.repeats)
            base, one = results["mlx_lm.stream_generate"], results["1 stage"]
            for path, result in results.items():
                rate = result.decode_tps
                print(
                    f"{name:<16} {path:<24} {result.ttft_s * 1e3:>9.0f} {rate:>13.2f} "
                    f"{rate / base.decode_tps:>9.3f}x {rate / one.decode_tps:>10.3f}x {result.hop_ms:>13.3f}"
                )
        print(f"\nfailure detection, 2 stages of smollm2-135m (hop timeout {HOP_TIMEOUT:.1f} s)")
        for how, seconds in failure_seconds(builtin).items():
            print(f"{how:<16} -> HopError after {seconds:.2f} s")


if __name__ == "__main__":
    main()
