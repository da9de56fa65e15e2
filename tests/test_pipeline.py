"""Pipeline stages: a model split by layers over separate processes gives one process's tokens.

Stages after the first are real OS processes (`python -m node.pipeline.stage`) on 127.0.0.1; the
first stage, the driver, runs in the test process. Every comparison is against
`mlx_lm.stream_generate` on the whole model in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import psutil
import pytest
from mlx_lm import load, stream_generate

from node.pipeline.driver import PipelineGenerator
from node.pipeline.hop import HopError
from node.pipeline.shard import load_shard, request_sampler
from protocol.sampling import GREEDY, Sampling
from tests.model_factory import make_random_model
from tests.stage_process import StageProcess, even_split, spawn_stage, wait_ready
from tests.waiting import wait_until

QUESTION = "What is the capital of France?"
FAIL_FAST_TIMEOUT = 2.0
"""Hop timeout for the failure tests: what ends the wait for a frozen stage (bench/pipeline.py
reports how soon a failure is noticed)."""
SILENCE = f"nothing from previous stage for {FAIL_FAST_TIMEOUT:.1f}s: frozen or cut off"
"""Why a stage says its ring broke when its upstream neighbour fell silent for the hop timeout."""


@pytest.fixture(scope="module")
def six_layers(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("pipeline") / "six", num_layers=6, tokenizer_from=builtin_model_dir
    )


@cache
def _single(model_dir: Path) -> tuple[Any, Any]:
    return load(str(model_dir))[:2]


def _prompt(model_dir: Path) -> list[int]:
    tokenizer = _single(model_dir)[1]
    return list(
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    )


def single_process(
    model_dir: Path,
    prompt: list[int],
    *,
    max_tokens: int,
    prefill_step_size: int = 2048,
    sampling: Sampling = GREEDY,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens and progress reports of `stream_generate` on the whole model, as the engine runs it."""
    model, tokenizer = _single(model_dir)
    progress: list[tuple[int, int]] = []
    tokens = [
        response.token
        for response in stream_generate(
            model,
            tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens,
            sampler=request_sampler(sampling),
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=lambda done, total: progress.append((done, total)),
        )
    ]
    return tokens, progress


def run(
    driver: PipelineGenerator, model_dir: Path, prompt: list[int], **kwargs: Any
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens and progress reports of the pipeline, stopping at EOS as `stream_generate` does."""
    progress: list[tuple[int, int]] = []
    eos = set(_single(model_dir)[1].eos_token_ids)
    tokens = list(
        driver.generate(
            prompt, eos_token_ids=eos, progress_callback=lambda d, t: progress.append((d, t)), **kwargs
        )
    )
    return tokens, progress


@contextmanager
def _stderr_to(log: Path | None) -> Iterator[None]:
    """While open, fd 2 (what a spawned stage inherits for its log) appends to `log`, if given.

    Why not `capfd`: its `readouterr` reads the capture file and then truncates it, so a line that
    a child writes between the two is lost; a test polling for a stage's line could miss it."""
    if log is None:
        yield
        return
    saved = os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


@contextmanager
def ring(
    model_dir: Path, stages: int, *, hop_timeout: float = 3.0, log: Path | None = None
) -> Iterator[tuple[PipelineGenerator, list[StageProcess]]]:
    """A pipeline of `stages` stages: the driver here, the others as processes, layers split evenly;
    the stages log to `log` if given, else to this process's stderr."""
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    ranges = even_split(num_layers, stages)
    with _stderr_to(log):
        processes = [spawn_stage(model_dir, start=a, end=b, hop_timeout=hop_timeout) for a, b in ranges[1:]]
    try:
        for process in processes:
            wait_ready(process)
        driver = PipelineGenerator(
            load_shard(model_dir, start=0, end=ranges[0][1]),
            stages=[p.address for p in processes],
            hop_timeout=hop_timeout,
        )
        try:
            yield driver, processes
        finally:
            driver.close()
    finally:
        for process in processes:
            process.stop()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}-stage")
def random_ring(request: pytest.FixtureRequest, six_layers: Path) -> Iterator[PipelineGenerator]:
    with ring(six_layers, request.param) as (driver, _):
        yield driver


# --- same tokens as one process ---------------------------------------------------------------


def test_greedy_tokens_match_one_process(random_ring: PipelineGenerator, six_layers: Path) -> None:
    prompt = _prompt(six_layers)
    expected = single_process(six_layers, prompt, max_tokens=24, prefill_step_size=8)
    assert run(random_ring, six_layers, prompt, max_tokens=24, prefill_step_size=8) == expected
    # One chunk (the default step) and a one-token prompt take the other paths through prefill.
    five, _ = single_process(six_layers, prompt, max_tokens=5)
    assert run(random_ring, six_layers, prompt, max_tokens=5)[0] == five
    assert list(random_ring.generate(mx.array(prompt), max_tokens=5)) == five  # an mx.array prompt too
    assert run(random_ring, six_layers, prompt[:1], max_tokens=3) == single_process(
        six_layers, prompt[:1], max_tokens=3
    )


def test_seeded_sampling_matches_one_process(random_ring: PipelineGenerator, six_layers: Path) -> None:
    prompt = _prompt(six_layers)
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=40, min_p=0.05, seed=1234)
    expected, _ = single_process(six_layers, prompt, max_tokens=16, sampling=sampling)
    tokens, _ = run(random_ring, six_layers, prompt, max_tokens=16, sampling=sampling)
    assert tokens == expected
    greedy, _ = single_process(six_layers, prompt, max_tokens=16)
    assert tokens != greedy  # the sampler really sampled


def test_cancel_mid_decode_then_serve_the_next_request(
    random_ring: PipelineGenerator, six_layers: Path
) -> None:
    prompt = _prompt(six_layers)
    seen: list[int] = []
    stop_after = 3
    for token in random_ring.generate(prompt, max_tokens=500, is_cancelled=lambda: len(seen) >= stop_after):
        seen.append(token)
    assert stop_after <= len(seen) <= stop_after + 2
    # Cancelled during prefill: no token at all.
    calls: list[int] = []
    cancelled = list(
        random_ring.generate(
            prompt,
            max_tokens=5,
            prefill_step_size=4,
            progress_callback=lambda done, total: calls.append(done),
            is_cancelled=lambda: len(calls) >= 2,
        )
    )
    assert cancelled == []
    # The same pipeline then serves a whole request exactly.
    assert run(random_ring, six_layers, prompt, max_tokens=12) == single_process(
        six_layers, prompt, max_tokens=12
    )


@pytest.fixture(scope="module")
def smollm2_answer(builtin_model_dir: Path) -> tuple[list[int], list[int]]:
    """The chat prompt and one process's first 20 greedy tokens on the real SmolLM2 (float32)."""
    prompt = _prompt(builtin_model_dir)
    expected, _ = single_process(builtin_model_dir, prompt, max_tokens=20)
    assert "Paris" in _single(builtin_model_dir)[1].decode(expected)
    return prompt, expected


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_smollm2_answers_paris_like_one_process(
    builtin_model_dir: Path, smollm2_answer: tuple[list[int], list[int]], stages: int
) -> None:
    prompt, expected = smollm2_answer
    with ring(builtin_model_dir, stages) as (driver, _):
        tokens, _ = run(driver, builtin_model_dir, prompt, max_tokens=20, prefill_step_size=16)
    assert tokens == expected


def test_qwen3_layers_split_like_one_process(builtin_model_dir: Path, tmp_path: Path) -> None:
    """The stage forward pass is family-agnostic: qwen3 (q/k norms) split in three, in process."""
    model_dir = make_random_model(
        tmp_path / "qwen3", model_type="qwen3", num_layers=3, tokenizer_from=builtin_model_dir
    )
    prompt = _prompt(model_dir)
    expected, _ = single_process(model_dir, prompt, max_tokens=10)
    shards = [load_shard(model_dir, start=a, end=b) for a, b in even_split(3, 3)]
    caches = [shard.make_cache() for shard in shards]
    sampler = request_sampler(GREEDY)

    def step(tokens: list[int]) -> int:
        h = mx.array(tokens)[None]
        for shard, kv in zip(shards, caches, strict=True):
            h = shard.forward(h, kv)
            mx.eval(h)
        return cast(int, shards[-1].next_token(h, sampler).item())

    step(prompt[:-1])  # one prefill chunk, leaving the last token, as stream_generate does
    tokens = [step(prompt[-1:])]
    while len(tokens) < len(expected):
        tokens.append(step(tokens[-1:]))
    assert tokens == expected


# --- failures are errors -------------------------------------------------------------------------


def _generate_until_failure(driver: PipelineGenerator, prompt: list[int], fault: Any) -> int:
    """Run a long generation, apply `fault` after 3 tokens and expect `HopError`: how many tokens
    still came after the fault."""
    count = 0
    with pytest.raises(HopError):
        for count, _ in enumerate(driver.generate(prompt, max_tokens=100_000), start=1):
            if count == 3:
                fault()
    assert count >= 3, "the generation failed before the fault"
    return count - 3


def _why_ring_broke(log: Path, stage: StageProcess) -> str:
    """What `stage` logs to `log` (see `ring`) when its ring breaks."""
    said = f"stage[{stage.start},{stage.end}): ring broken: "

    def reason() -> str:
        lines = log.read_text(errors="replace").splitlines()
        return next((line.split(said, 1)[1] for line in lines if said in line), "")

    return wait_until(reason, 30, f"{said!r} logged")


def test_a_killed_middle_stage_is_an_error(six_layers: Path, tmp_path: Path) -> None:
    """The driver raises `HopError` and no token comes after the kill; the stage after the dead one
    ends the ring on a closed link (its own or the driver's), without waiting out the hop timeout."""
    log = tmp_path / "stages.log"
    with ring(six_layers, 3, hop_timeout=FAIL_FAST_TIMEOUT, log=log) as (driver, stages):
        middle = stages[0].process
        after = _generate_until_failure(
            driver, _prompt(six_layers), lambda: middle.send_signal(signal.SIGKILL)
        )
        assert after == 0
        why = _why_ring_broke(log, stages[-1])
        assert "frozen or cut off" not in why, why  # a closed link, not the hop timeout's silence


def test_a_frozen_stage_is_an_error_of_the_hop_timeout(six_layers: Path, tmp_path: Path) -> None:
    """A frozen stage keeps its links open: the stage after it ends the ring when the hop timeout
    has passed in silence, and the driver raises `HopError`; no token comes after the freeze."""
    log = tmp_path / "stages.log"
    with ring(six_layers, 3, hop_timeout=FAIL_FAST_TIMEOUT, log=log) as (driver, stages):
        middle = stages[0].process
        try:
            after = _generate_until_failure(
                driver, _prompt(six_layers), lambda: os.kill(middle.pid, signal.SIGSTOP)
            )
        finally:
            os.kill(middle.pid, signal.SIGCONT)
        assert after == 0
        assert _why_ring_broke(log, stages[-1]) == SILENCE


@pytest.mark.parametrize("tie", ["kernel", "watcher"])
def test_a_stage_ends_with_the_node_that_started_it(six_layers: Path, tie: str) -> None:
    """A stage must not outlive its node's SIGKILL: PR_SET_PDEATHSIG on Linux ("kernel"), and the
    portable parent watcher (what macOS gets), here exercised alone through a shell parent."""
    stage = f"-m node.pipeline.stage --model-path {six_layers} --start 3 --listen 127.0.0.1:0"
    if tie == "kernel":
        code = "import time; from tests.stage_process import spawn_stage; "
        code += f"spawn_stage({str(six_layers)!r}, start=3, die_with_parent=True); time.sleep(600)"
        parent = subprocess.Popen([sys.executable, "-c", code])
    else:
        parent = subprocess.Popen(["sh", "-c", f"{sys.executable} {stage} --parent-pid $$ & wait"])
    children: list[psutil.Process] = []
    try:
        wait_until(lambda: psutil.Process(parent.pid).children(), 30, "the stage started")
        children = psutil.Process(parent.pid).children()
        assert len(children) == 1, children
        parent.kill()
        parent.wait(5)
        gone, _ = psutil.wait_procs(children, timeout=15)
        assert gone, "the stage outlived its parent"
    finally:
        parent.kill()
        for child in children:  # re-parented when the test fails: not among our children any more
            if child.is_running():
                child.kill()
