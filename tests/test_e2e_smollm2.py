"""End to end with the real SmolLM2-135M-Instruct: `shoal run` with no --model, asked via the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from node.models import default_data_dir
from tests.nodes import DEFAULT, RunningNode, start_node

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]


@pytest.fixture(scope="module")
def smollm2_node(builtin_model_dir: Path) -> Iterator[RunningNode]:
    node = start_node(data_dir=default_data_dir(), model=DEFAULT)
    yield node
    assert node.stop() == 0


@pytest.fixture(scope="module")
def client(smollm2_node: RunningNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_node.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def _expected_usage(builtin_model_dir: Path, answer: str) -> tuple[int, int]:
    """Prompt tokens from the chat template; completion = the answer's tokens plus the end-of-turn token."""
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": ASK}], add_generation_prompt=True, tokenize=False
    )
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return n_prompt, len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1


def test_default_model_is_smollm2(smollm2_node: RunningNode, client: openai.OpenAI) -> None:
    assert smollm2_node.model_id == "smollm2-135m"
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]


def test_capital_of_france(client: openai.OpenAI, builtin_model_dir: Path) -> None:
    completion = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0)
    answer = completion.choices[0].message.content or ""
    assert "Paris" in answer
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == _expected_usage(
        builtin_model_dir, answer
    )


def test_capital_of_france_streaming(client: openai.OpenAI, builtin_model_dir: Path) -> None:
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=QUESTION,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in answer
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == _expected_usage(builtin_model_dir, answer)
    assert len({c.id for c in chunks}) == 1
