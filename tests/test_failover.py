"""Failover below the nodes: the decisions, a resumed request's events, and `Failover` over real
runner processes (one killed mid-stream), each compared with an uninterrupted run.

The multi-node cases (a node killed or frozen, a stage lost) are tests/test_failover_nodes.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, get_args

import pytest
import trio
from mlx_lm.utils import load_tokenizer
from pydantic import ValidationError

from node.pipeline.driver import PipelineGenerator
from node.pipeline.shard import load_shard
from node.runner.engine import Admitted, LoadedModel, RequestOutput, loaded_model
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from node.serving.failover import (
    BREAK_CODES,
    WAIT_CODES,
    Delivered,
    Failover,
    FailoverConfig,
    choose_entry,
    fails_over,
)
from protocol.chat import ChatMessage, GenerateRequest, Resume, SamplingParams
from protocol.events import (
    NODE_UNAVAILABLE,
    PIPELINE_FAILED,
    RUNNER_UNAVAILABLE,
    ChunkEvent,
    ErrorCode,
    Finish,
    GenerationError,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCall,
)
from protocol.ids import ModelId, NodeId, RequestId
from protocol.sampling import SamplingDefaults, resolve_sampling
from tests.waiting import wait_until_async

pytestmark = pytest.mark.timeout(240)

MODEL = ModelId("tiny")
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40)
GREEDY = SEEDED.model_copy(update={"temperature": 0.0})


def _error(code: ErrorCode | None, kind: Any = "server_error") -> GenerationError:
    return GenerationError(error_kind=kind, message="x", code=code)


# --- the decisions -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "first", "later"),
    [
        (_error(NODE_UNAVAILABLE), True, True),
        (_error(RUNNER_UNAVAILABLE), True, True),
        (_error(PIPELINE_FAILED), True, True),
        (_error("model_loading"), False, True),  # the first attempt has its own wait (load_wait_s)
        (_error("model_not_found", "invalid_request"), False, True),  # mid re-placement
        (_error("too_many_requests", "overloaded"), False, True),
        (_error("context_length_exceeded", "invalid_request"), False, False),
        (_error(None, "invalid_request"), False, False),
        (_error(None), False, False),  # a fault in the request itself (generation failed)
        (_error("request_too_large", "invalid_request"), False, False),
    ],
)
def test_which_errors_fail_over(error: GenerationError, first: bool, later: bool) -> None:
    assert fails_over(error, failing_over=False) is first
    assert fails_over(error, failing_over=True) is later


def test_error_codes_are_one_closed_set() -> None:
    """Each code the failover decides on is one of `ErrorCode`, and a peer's event with a code
    outside it is refused where it is decoded (a misspelled producer fails its tests, not a retry)."""
    assert set(get_args(ErrorCode)) >= BREAK_CODES | WAIT_CODES
    with pytest.raises(ValidationError, match="code"):
        GenerationError.model_validate({"error_kind": "server_error", "message": "x", "code": "runner_gone"})


def test_choose_entry_tries_each_entry_once_then_pauses() -> None:
    a, b = NodeId("a"), NodeId("b")
    assert choose_entry([a, b], set()) == (a, False)
    assert choose_entry([a, b], {a}) == (b, False)
    assert choose_entry([a, b], {a, b}) == (a, True)
    assert choose_entry([b], {a}) == (b, False)  # the instance moved: its new entry at once
    assert choose_entry([], set()) == (None, False)  # no entry known: this node says why
    assert choose_entry([], {None}) == (None, True)


def test_delivered_counts_the_events_of_the_last_token() -> None:
    delivered = Delivered()
    assert delivered.resume() is None
    delivered.add(TextDelta(text="a", tokens=(1, 2)))
    delivered.add(TextDelta(text="b", tokens=(3,)))
    delivered.add(ToolCall(id="c", name="f", arguments="{}"))
    assert delivered.resume() == Resume(tokens=(1, 2, 3), events=2)


# --- a resumed request's events (the engine, with SmolLM2's real tokenizer) --------------------
ANSWER = (  # ">." is one token, which completes the tool call and starts text: two events
    '<think>Let me see.</think>The answer, with <tool_call>{"name": "f", "arguments": {"x": 1}}'
    "</tool_call>. And then some more text STOP here"
)


@pytest.fixture(scope="module")
def loaded(builtin_model_dir: Path) -> LoadedModel:
    tokenizer = load_tokenizer(builtin_model_dir)
    return loaded_model(None, tokenizer, {"model_type": "llama"}, vocab_dir=None, folder=builtin_model_dir)


def _request(params: SamplingParams, resume: Resume | None = None, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(
        request_id=RequestId(rid),
        model=MODEL,
        messages=(ChatMessage(role="user", content="Write a long poem about the tide."),),
        params=params,
        resume=resume,
    )


def _run(loaded: LoadedModel, tokens: list[int], resume: Resume | None) -> list[ChunkEvent]:
    """Events of a generation of `tokens` (as a runner feeds them), resumed from `resume`."""
    params = SamplingParams(temperature=0, stop=("STOP",), max_tokens=len(tokens) + 5)
    sampling = resolve_sampling(params, SamplingDefaults())
    admitted = Admitted(
        _request(params, resume), prompt=[1, 2, 3], max_tokens=len(tokens) + 5, sampling=sampling
    )
    events: list[ChunkEvent] = []
    output = RequestOutput(loaded, admitted, events.append)
    if (ended := output.replay(admitted)) is not None:
        output.finish(ended)
        return events
    for n, token in enumerate(tokens[len(admitted.replayed) :]):
        if output.token(token, last=n + len(admitted.replayed) + 1 == len(tokens)):
            break
    output.finish("stop")
    return events


def _visible(events: list[ChunkEvent]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for event in events:
        if isinstance(event, TextDelta | ReasoningDelta):
            out.append((event.kind, event.text))
        elif isinstance(event, ToolCall):
            out.append((event.kind, event.arguments))
    return out


def test_a_resumed_request_emits_exactly_what_the_client_lacks(loaded: LoadedModel) -> None:
    """Cut after every output event (mid-token too): what the client had plus what the resumed
    request emits is the uninterrupted run's events, and the same Finish."""
    tokens = loaded.tokenizer.encode(ANSWER, add_special_tokens=False)
    full = _run(loaded, tokens, None)
    outputs = [e for e in full if isinstance(e, TextDelta | ReasoningDelta | ToolCall)]
    assert {type(e) for e in outputs} == {TextDelta, ReasoningDelta, ToolCall}
    assert any(not e.tokens for e in outputs), "no token gave two events: the cut inside a group is untested"
    finish = full[-1]
    assert isinstance(finish, Finish) and finish.reason == "tool_calls"
    assert finish.usage.completion_tokens < len(tokens)  # "STOP" ended it
    for cut in range(1, len(outputs) + 1):
        delivered = Delivered()
        had: list[OutputEvent] = outputs[:cut]
        for event in had:
            delivered.add(event)
        resumed = _run(loaded, tokens, delivered.resume())
        assert _visible([*had, *resumed]) == _visible(full), cut
        assert resumed[-1] == full[-1], cut


def test_a_resume_that_already_ended_finishes_at_once(loaded: LoadedModel) -> None:
    tokens = loaded.tokenizer.encode("Short answer STOP", add_special_tokens=False)
    full = _run(loaded, tokens, None)
    resumed = _run(loaded, tokens, Resume(tokens=tuple(tokens), events=1))
    assert resumed == [full[-1]]


# --- Failover over real runner processes -------------------------------------------------------
@pytest.fixture
def runners(random_model_dir: Path) -> Iterator[dict[NodeId, RunnerSupervisor]]:
    """Two runners of the random model, as if on nodes "a" and "b" (no prefix cache: a cached
    prefix is prefilled in other chunks, which could move the last bits of the log-probs)."""
    spec = RunnerSpec(MODEL, model_path=random_model_dir, prefill_step_size=16, prefix_cache_tokens=0)
    yield {NodeId("a"): RunnerSupervisor(spec), NodeId("b"): RunnerSupervisor(spec)}


def _failover(
    runners: dict[NodeId, RunnerSupervisor], entries: list[NodeId], timeout_s: float = 30
) -> Failover:
    def open_on(
        entry: NodeId | None, request: GenerateRequest
    ) -> AbstractAsyncContextManager[AsyncIterator[ChunkEvent]]:
        assert entry is not None
        return runners[entry].open_stream(request)

    async def cancel_running(request_id: RequestId) -> bool:
        for runner in runners.values():
            if runner.has_request(request_id):
                return await runner.cancel(request_id)
        return False

    return Failover(open_on, lambda model: entries, cancel_running, FailoverConfig(timeout_s=timeout_s))


def _text(events: list[ChunkEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def _pid(runner: RunnerSupervisor) -> int:
    pid = runner.health().pid
    assert isinstance(pid, int)
    return pid


async def _stream_and_kill(
    failover: Failover, request: GenerateRequest, runner: RunnerSupervisor, after: int = 5
) -> list[ChunkEvent]:
    """All events of `request` through `failover`, killing `runner`'s process after `after` texts."""
    seen: list[ChunkEvent] = []
    async with failover.open_stream(request) as events:
        async for event in events:
            seen.append(event)
            if isinstance(event, TextDelta) and sum(isinstance(e, TextDelta) for e in seen) == after:
                os.kill(_pid(runner), signal.SIGKILL)
    return seen


def test_killed_runners_hand_over_and_failover_cancels_and_gives_up(
    runners: dict[NodeId, RunnerSupervisor],
) -> None:
    """1. Two entries, the first one's runner killed mid-stream: the other takes over; greedy and
    seeded, the events equal an uninterrupted run's (the same Finish too), no error.
    2. Entry a only: its restarted runner takes over the same way.
    3. A cancel while a waits to restart ends the stream with Finish(cancelled).
    4. A bound shorter than a restart: the runner's error, naming the bound."""
    a, b = NodeId("a"), NodeId("b")

    async def ready(entry: NodeId) -> None:
        await wait_until_async(lambda: runners[entry].state == "ready", 120, f"runner {entry} ready")

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            for runner in runners.values():
                await nursery.start(runner.run)
            with trio.fail_after(200):
                # Each kill lands on the runner killed least (a restart's backoff doubles).
                alone: dict[str, list[ChunkEvent]] = {}
                for name, params, first, second in (("greedy", GREEDY, a, b), ("seeded", SEEDED, b, a)):
                    async with runners[second].open_stream(_request(params, rid=f"{name}-1")) as events:
                        alone[name] = [event async for event in events]
                    await ready(first)
                    both = _failover(runners, [first, second])
                    broken = await _stream_and_kill(both, _request(params, rid=name), runners[first])
                    assert not any(isinstance(e, GenerationError) for e in broken), broken[-1]
                    assert _text(broken) == _text(alone[name]), name
                    assert broken[-1] == alone[name][-1], name  # the same Finish: reason and usage
                    assert both.failovers == 1

                await ready(a)
                restarted = await _stream_and_kill(_failover(runners, [a]), _request(SEEDED), runners[a])
                assert _text(restarted) == _text(alone["seeded"]) and restarted[-1] == alone["seeded"][-1]

                only_b = _failover(runners, [b])
                await ready(b)
                seen: list[ChunkEvent] = []
                async with only_b.open_stream(_request(GREEDY, rid="cancelled")) as events:
                    async for event in events:
                        seen.append(event)
                        if isinstance(event, TextDelta) and sum(isinstance(e, TextDelta) for e in seen) == 3:
                            os.kill(_pid(runners[b]), signal.SIGKILL)
                            await wait_until_async(lambda: runners[b].state != "ready", 10, "runner b down")
                            assert await only_b.cancel(RequestId("cancelled"))
                last = seen[-1]
                assert isinstance(last, Finish) and last.reason == "cancelled", last
                assert last.usage.completion_tokens >= 3
                assert not await only_b.cancel(RequestId("cancelled"))  # gone

                await ready(a)
                hasty = _failover(runners, [a], timeout_s=0.3)  # a restart takes 0.5 s at least
                given_up = await _stream_and_kill(hasty, _request(GREEDY, rid="hasty"), runners[a])
                error = given_up[-1]
                assert isinstance(error, GenerationError) and error.code == RUNNER_UNAVAILABLE
                assert "no instance took the request over within 0.3 s" in error.message
            nursery.cancel_scope.cancel()

    trio.run(scenario)


def test_forced_tokens_leave_a_seeded_generation_where_it_was(random_model_dir: Path) -> None:
    """The pipeline driver (here a 1-stage one) decoding a seeded request's earlier tokens again
    gives the rest of the uninterrupted run's tokens (the 2- and 3-stage ring: the node tests)."""
    driver = PipelineGenerator(load_shard(random_model_dir, start=0))
    prompt = list(range(100, 140))
    seeded = resolve_sampling(SEEDED, SamplingDefaults())
    whole = list(driver.generate(prompt, max_tokens=30, sampling=seeded))
    resumed = list(driver.generate(prompt, max_tokens=30, sampling=seeded, forced=whole[:12]))
    assert resumed == whole
