"""The scripted gpt_oss model (tests/gptoss_model.py) in the runner's own engine, without a node.

Its output tokens are the scripts' for a short prompt and for one of ~3000 tokens (the first
attention counts markers, it does not average them), greedy and sampled at temperature 1 (the
margins hold), and the runner's harmony parser turns them into reasoning, answer and tool call. The
runner refuses, before any forward pass, a prompt with ids past the model's vocabulary; counting
its tokens still works.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from node.models.harmony_vocab import prepare_harmony_vocab
from node.runner.engine import Admitted, LoadedModel, RequestOutput, admit, generate, load_model
from protocol.chat import ChatMessage, GenerateRequest, SamplingParams, ToolSpec
from protocol.events import ChunkEvent, Finish, GenerationError, ReasoningDelta, TextDelta, ToolCall
from protocol.ids import ModelId, RequestId
from tests.gptoss_model import (
    ANSWER,
    ANSWER_SCRIPT,
    ARGUMENTS,
    REASONING,
    TOOL,
    TOOL_REASONING,
    TOOL_SCRIPT,
    script_ids,
)

WEATHER_TOOL = ToolSpec(
    name=TOOL,
    description="Current weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
LONG = "Tell me about the sea. " * 500
"""~3000 tokens: a marker's share of such a context is far below its share of a short one."""


@pytest.fixture(scope="module")
def loaded(scripted_gptoss_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    vocab = prepare_harmony_vocab(tmp_path_factory.mktemp("data"))
    return load_model(scripted_gptoss_dir, vocab_dir=vocab)


def _request(text: str, params: SamplingParams, **fields: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=RequestId("r"),
        model=ModelId("scripted-gpt-oss"),
        messages=(ChatMessage(role="user", content=text),),
        params=params,
        **fields,
    )


def _generate(loaded: LoadedModel, request: GenerateRequest) -> list[ChunkEvent]:
    admitted = admit(loaded, request)
    assert isinstance(admitted, Admitted), admitted
    events: list[ChunkEvent] = []
    output = RequestOutput(loaded, admitted, events.append)
    generate(loaded, admitted, output, is_cancelled=lambda: False, prefill_step_size=512)
    return events


def _parsed(events: list[ChunkEvent]) -> tuple[str, str, list[tuple[str, str]], str, int]:
    """Reasoning, text, tool calls, finish reason and generated tokens."""
    finish = events[-1]
    assert isinstance(finish, Finish), finish
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, TextDelta)),
        [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)],
        finish.reason,
        finish.usage.completion_tokens,
    )


@pytest.mark.parametrize("prompt", ["Say hello.", LONG], ids=["short", "long"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)],
    ids=["greedy", "sampled"],
)
def test_the_model_writes_its_scripts(loaded: LoadedModel, prompt: str, params: SamplingParams) -> None:
    answer = _parsed(_generate(loaded, _request(prompt, params)))
    assert answer == (REASONING, ANSWER, [], "stop", len(script_ids(ANSWER_SCRIPT)))
    weather = f"{prompt} What is the weather in Paris?"
    call = _parsed(_generate(loaded, _request(weather, params, tools=(WEATHER_TOOL,))))
    assert call == (TOOL_REASONING, "", [(TOOL, ARGUMENTS)], "tool_calls", len(script_ids(TOOL_SCRIPT)))


def test_a_prompt_past_the_vocabulary_is_refused_before_it_runs(loaded: LoadedModel) -> None:
    """The harmony prompt holds ids from 200005 (`<|channel|>`'s neighbours) up: a 200000-row model
    cannot read them."""
    small = dataclasses.replace(loaded, vocab_size=200_000)
    request = _request("Say hello.", SamplingParams(temperature=0))
    refused = admit(small, request)
    assert isinstance(refused, GenerationError)
    assert (refused.error_kind, refused.code, refused.param) == (
        "invalid_request",
        "token_out_of_vocabulary",
        "messages",
    )
    assert "vocabulary has 200000 tokens: the harmony o200k vocab does not match" in refused.message
    counted = admit(small, request.model_copy(update={"count_only": True}))
    assert isinstance(counted, Finish) and counted.usage.prompt_tokens > 0
    assert isinstance(admit(loaded, request), Admitted)
