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
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import psutil
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

from node.pipeline.driver import PipelineGenerator
from node.pipeline.hop import Frame, FrameError, HopError, Kind, decode_frame, encode_frame
from node.pipeline.shard import SamplingParams, Shard, ShardError, ShardSpec, even_split, load_shard
from node.pipeline.stage import StageProcess, spawn_stage, wait_ready
from tests.model_factory import make_random_model
from tests.nodes import wait_until

QUESTION = "What is the capital of France?"
FAIL_FAST_TIMEOUT = 2.0
"""Hop timeout for the failure tests: a frozen stage must be noticed within about this."""


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
    sampling: SamplingParams | None = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens and progress reports of `stream_generate` on the whole model, as the engine runs it."""
    model, tokenizer = _single(model_dir)
    sampling = sampling or SamplingParams()
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    progress: list[tuple[int, int]] = []
    tokens = [
        response.token
        for response in stream_generate(
            model,
            tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens,
            sampler=make_sampler(temp=sampling.temperature, top_p=sampling.top_p),
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
def ring(
    model_dir: Path, stages: int, *, hop_timeout: float = 3.0
) -> Iterator[tuple[PipelineGenerator, list[StageProcess]]]:
    """A pipeline of `stages` stages: the driver here, the others as processes, layers split evenly."""
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    ranges = even_split(num_layers, stages)
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


# --- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (6, 1, [(0, 6)]),
        (6, 2, [(0, 3), (3, 6)]),
        (6, 4, [(0, 2), (2, 4), (4, 5), (5, 6)]),
        (30, 3, [(0, 10), (10, 20), (20, 30)]),
    ],
)
def test_even_split(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    assert even_split(layers, stages) == expected


def test_bad_ranges_are_refused() -> None:
    for start, end in [(3, 3), (-1, 2), (2, 7)]:
        with pytest.raises(ShardError):
            ShardSpec(start, end, 6)
    with pytest.raises(ShardError):
        even_split(2, 3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int32])
def test_frames_round_trip(dtype: mx.Dtype) -> None:
    tensor = (mx.random.normal((1, 3, 8)) * 100).astype(dtype)
    frame = Frame(
        Kind.PREFILL, request=2**40 + 3, position=17, tensor=tensor[:, ::2, :], meta={"a": [1, "b"]}
    )
    wire = b"".join(bytes(part) for part in encode_frame(frame))
    back = decode_frame(wire[4:])
    assert int.from_bytes(wire[:4], "big") == len(wire) - 4
    assert (back.kind, back.request, back.position, dict(back.meta)) == (
        Kind.PREFILL,
        2**40 + 3,
        17,
        {"a": [1, "b"]},
    )
    assert back.tensor is not None and back.tensor.dtype == dtype
    assert mx.array_equal(back.tensor, tensor[:, ::2, :]).item()
    bare = b"".join(bytes(part) for part in encode_frame(Frame(Kind.RESET, request=5)))
    assert decode_frame(bare[4:]) == Frame(Kind.RESET, request=5)


def test_garbage_is_a_frame_error() -> None:
    good = b"".join(bytes(p) for p in encode_frame(Frame(Kind.TOKEN, 1, 0, mx.array([7], dtype=mx.int32))))[
        4:
    ]
    for bad in [b"XX" + good[2:], good[:-1], good + b"\0", good[:5]]:
        with pytest.raises(FrameError):
            decode_frame(bad)


# --- memory follows the share ---------------------------------------------------------------


def _group_bytes(model_dir: Path) -> dict[str, int]:
    """Stored bytes per part: "embed", "layers.<i>", "norm", "head"."""
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    groups: dict[str, int] = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            key = "layers." + name.split(".")[2]
        else:
            key = {
                "model.embed_tokens.weight": "embed",
                "model.norm.weight": "norm",
                "lm_head.weight": "head",
            }[name]
        groups[key] = groups.get(key, 0) + value.nbytes
    return groups


def _names(shard: Shard) -> set[str]:
    return {name for name, _ in cast(list[tuple[str, mx.array]], tree_flatten(shard.parameters()))}


@pytest.fixture(scope="module")
def eight_wide(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers of ~4 MB each, so that layer bytes are easy to tell from the embedding and head."""
    return make_random_model(
        tmp_path_factory.mktemp("pipeline") / "eight",
        num_layers=8,
        hidden_size=256,
        intermediate_size=1024,
        tokenizer_from=builtin_model_dir,
    )


def test_a_stage_holds_only_its_share(eight_wide: Path) -> None:
    groups = _group_bytes(eight_wide)
    layers = [groups[f"layers.{i}"] for i in range(8)]
    cases = {
        (0, 4): groups["embed"] + sum(layers[:4]),
        (2, 6): sum(layers[2:6]),
        (4, 8): sum(layers[4:]) + groups["norm"] + groups["head"],
    }
    for (start, end), expected in cases.items():
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        shard = load_shard(eight_wide, start=start, end=end)
        assert shard.parameter_bytes() == expected
        # MLX never allocated more than the share: the other layers' weights were never read.
        assert mx.get_peak_memory() - before <= expected * 1.02 + 1_000_000
        names = _names(shard)
        assert any(name.startswith("embed_tokens") for name in names) == (start == 0)
        assert any(name.startswith("lm_head") for name in names) == (end == 8)
        del shard
    # Half the layers of the first stage is half of all layer bytes.
    first = load_shard(eight_wide, start=0, end=4)
    assert first.parameter_bytes() - groups["embed"] == sum(layers) // 2


def test_tied_embedding_stays_with_the_last_stage(builtin_model_dir: Path) -> None:
    last = load_shard(builtin_model_dir, start=28)
    # SmolLM2 ties its head to the embedding: the last stage keeps the table to use as its head.
    assert {name.split(".")[0] for name in _names(last)} == {"layers", "embed_tokens", "norm"}
    middle = load_shard(builtin_model_dir, start=10, end=12)
    assert {name.split(".")[0] for name in _names(middle)} == {"layers"}


def test_process_memory_follows_the_share(eight_wide: Path) -> None:
    """Resident memory of a process loading the middle half vs then loading the whole model."""
    script = textwrap.dedent(
        f"""
        import json, psutil
        import mlx_lm.models.base, mlx_lm.models.cache, mlx_lm.models.llama, mlx_lm.utils
        from node.pipeline.shard import load_shard
        rss = psutil.Process().memory_info
        base = rss().rss
        middle = load_shard({str(eight_wide)!r}, start=2, end=6)
        after_middle = rss().rss
        whole = load_shard({str(eight_wide)!r}, start=0, end=8)
        print(json.dumps([after_middle - base, rss().rss - after_middle, middle.parameter_bytes(),
                          whole.parameter_bytes()]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    middle_rss, whole_rss, middle_bytes, whole_bytes = json.loads(out.stdout.strip().splitlines()[-1])
    assert middle_bytes < whole_bytes / 4
    assert middle_rss < middle_bytes + 16_000_000
    assert whole_rss > whole_bytes * 0.9
    assert middle_rss < whole_rss / 3


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
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
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
    sampler = SamplingParams().start()

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


# --- failures are errors, quickly -------------------------------------------------------------


def _generate_until_failure(driver: PipelineGenerator, prompt: list[int], fault: Any) -> float:
    """Run a long generation, apply `fault` after a few tokens; seconds from fault to HopError."""
    faulted_at = 0.0
    with pytest.raises(HopError):
        for count, _ in enumerate(driver.generate(prompt, max_tokens=100_000), start=1):
            if count == 3:
                fault()
                faulted_at = time.monotonic()
            assert count < 100_000
    assert faulted_at, "the fault was never applied"
    return time.monotonic() - faulted_at


def test_a_killed_middle_stage_is_an_error_within_seconds(six_layers: Path) -> None:
    with ring(six_layers, 3, hop_timeout=FAIL_FAST_TIMEOUT) as (driver, stages):
        middle = stages[0].process
        elapsed = _generate_until_failure(
            driver, _prompt(six_layers), lambda: middle.send_signal(signal.SIGKILL)
        )
        assert elapsed < 5.0


def test_a_frozen_stage_is_an_error_within_the_hop_timeout(six_layers: Path) -> None:
    with ring(six_layers, 3, hop_timeout=FAIL_FAST_TIMEOUT) as (driver, stages):
        middle = stages[0].process
        try:
            elapsed = _generate_until_failure(
                driver, _prompt(six_layers), lambda: os.kill(middle.pid, signal.SIGSTOP)
            )
        finally:
            os.kill(middle.pid, signal.SIGCONT)
        assert elapsed < FAIL_FAST_TIMEOUT + 2.0


@pytest.mark.parametrize("tie", ["kernel", "watcher"])
def test_a_stage_ends_with_the_node_that_started_it(six_layers: Path, tie: str) -> None:
    """A stage must not outlive its node's SIGKILL: PR_SET_PDEATHSIG on Linux ("kernel"), and the
    portable parent watcher (what macOS gets), here exercised alone through a shell parent."""
    stage = f"-m node.pipeline.stage --model-path {six_layers} --start 3 --listen 127.0.0.1:0"
    if tie == "kernel":
        code = "import time; from node.pipeline.stage import spawn_stage; "
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
