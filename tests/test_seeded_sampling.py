"""A seeded request gets the same tokens from a 1-stage and a 2-stage instance.

A seeded sampler owns its PRNG key, so nothing else drawn in its process (another request's
tokens, any `mx.random` call) moves its sequence. Then the two paths below agree: both are real
runner processes, as a node starts them: one holds the whole random model and
batches (`node.runner.scheduler`), the other holds layer 0 in pipeline mode and drives a real
stage process that holds layer 1 and samples. Only the sampler is shared between the two paths
(`node.pipeline.shard.request_sampler`); everything else is each path's own code.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest
import trio

from node.cpu.fastpath import runner_environment
from node.pipeline.shard import Sampler, request_sampler
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams
from protocol.events import ChunkEvent, Finish, TextDelta
from protocol.ids import ModelId, RequestId
from protocol.sampling import Sampling
from tests.stage_process import StageProcess, spawn_stage, wait_ready

pytestmark = pytest.mark.timeout(300)

MODEL = ModelId("tiny")
PROMPT = "Write a short poem about the tide."


def test_a_seeded_sampler_ignores_every_other_draw() -> None:
    """What MLX's global generator (`mx.random.seed`) does not give: two requests sampled in turn,
    with unrelated draws between them, get the tokens each gets alone."""
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 512), key=mx.random.key(0))))
    params = Sampling(temperature=0.9, top_p=0.95, top_k=0, min_p=0.0, seed=1234)

    def token(sampler: Sampler) -> int:
        return cast(int, sampler(logprobs).item())

    def alone(p: Sampling) -> list[int]:
        sampler = request_sampler(p)
        return [token(sampler) for _ in range(12)]

    first, second = request_sampler(params), request_sampler(params.model_copy(update={"seed": 7}))
    mixed: tuple[list[int], list[int]] = ([], [])
    for _ in range(12):
        mixed[0].append(token(first))
        mx.random.uniform()  # anything else in the process that draws
        mixed[1].append(token(second))
    assert mixed == (alone(params), alone(params.model_copy(update={"seed": 7})))
    assert mixed[0] != mixed[1]


@pytest.mark.parametrize("seed", [None, 5, -5])
def test_top_k_draws_only_among_the_k_most_likely(seed: int | None) -> None:
    """Anthropic's and Ollama's `top_k`; a k at or above the vocabulary keeps every token."""
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(1))))
    top3 = set(cast(list[int], mx.argsort(-logprobs[0])[:3].tolist()))
    sampler = request_sampler(Sampling(temperature=5.0, top_p=1.0, top_k=3, min_p=0.0, seed=seed))
    drawn = {cast(int, sampler(logprobs).item()) for _ in range(60)}
    assert drawn <= top3 and len(drawn) > 1
    everything = request_sampler(Sampling(temperature=5.0, top_p=1.0, top_k=64, min_p=0.0, seed=seed))
    assert len({cast(int, everything(logprobs).item()) for _ in range(60)}) > 3


@contextmanager
def second_stage_of(model_dir: Path) -> Iterator[StageProcess]:
    """Layer 1 (of 2) of a 2-layer model, with the BLAS settings a node gives its stages."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(runner_environment(env))
    stage = spawn_stage(model_dir, start=1, env=env)
    try:
        yield wait_ready(stage)
    finally:
        stage.stop()


@pytest.fixture
def second_stage(random_model_dir: Path) -> Iterator[StageProcess]:
    with second_stage_of(random_model_dir) as stage:
        yield stage


def spec(model_dir: Path, pipeline: tuple[int, str, tuple[str, ...]] | None = None) -> RunnerSpec:
    """The same prefill chunks on both paths, and no prefix cache: a cached prefix is prefilled in
    other chunks, which may move the last bits of the log-probs (the pipeline has none)."""
    return RunnerSpec(
        MODEL, model_path=model_dir, prefill_step_size=16, prefix_cache_tokens=0, pipeline=pipeline
    )


def request(request_id: str, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        request_id=RequestId(request_id),
        model=MODEL,
        messages=(ChatMessage(role="user", content=PROMPT),),
        params=params,
    )


async def answer(stream: AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]) -> tuple[str, Finish]:
    """The text and the terminal event (prefill progress is reported differently on the two paths)."""
    async with stream as events:
        seen = [event async for event in events]
    finish = seen[-1]
    assert isinstance(finish, Finish), finish
    return "".join(e.text for e in seen if isinstance(e, TextDelta)), finish


def test_a_seeded_request_gets_the_same_tokens_on_one_and_two_stages(
    random_model_dir: Path, second_stage: StageProcess
) -> None:
    host, port = second_stage.address
    one = RunnerSupervisor(spec(random_model_dir))
    two = RunnerSupervisor(spec(random_model_dir, pipeline=(1, "127.0.0.1", (f"{host}:{port}",))))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    reseeded = seeded.model_copy(update={"seed": 99})
    greedy = seeded.model_copy(update={"temperature": 0.0})

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(one.run)
            await nursery.start(two.run)
            with trio.fail_after(240):
                answers: dict[str, tuple[str, Finish]] = {}
                for name, params in (("seeded", seeded), ("reseeded", reseeded), ("greedy", greedy)):
                    alone = await answer(one.open_stream(request(f"{name}-1", params)))
                    split = await answer(two.open_stream(request(f"{name}-2", params)))
                    assert split == alone, name
                    answers[name] = alone
                # The same seed again: the same tokens (no state carried over between requests).
                assert await answer(two.open_stream(request("again", seeded))) == answers["seeded"]
            assert answers["seeded"][1].usage.completion_tokens == 24
            # The sampler really sampled, and the seed chose what.
            assert len({text for text, _ in answers.values()}) == 3
            nursery.cancel_scope.cancel()

    trio.run(scenario)
