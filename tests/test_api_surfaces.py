"""One generation path, four encodings: the same request through every surface gives the same answer.

Each surface is asked through its official client (openai chat completions and Responses,
anthropic, ollama) on one real node at temperature 0: the text, the prompt's token count and the
number of generated tokens agree, because each surface builds the same `GenerateRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass

import anthropic
import ollama
import openai
import pytest

from tests.nodes import RunningNode

SYSTEM = "Be brief."
QUESTION = "Name three colours."
MAX_TOKENS = 12


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int


@pytest.fixture(scope="module")
def model(random_node: RunningNode) -> str:
    assert random_node.model_id is not None
    return random_node.model_id


def _chat(node: RunningNode, model: str) -> Answer:
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert completion.usage is not None
    text = completion.choices[0].message.content or ""
    return Answer(text, completion.usage.prompt_tokens, completion.usage.completion_tokens)


def _responses(node: RunningNode, model: str) -> Answer:
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="x", timeout=120, max_retries=0)
    response = client.responses.create(
        model=model, instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS
    )
    assert response.usage is not None
    return Answer(response.output_text, response.usage.input_tokens, response.usage.output_tokens)


def _messages(node: RunningNode, model: str) -> Answer:
    client = anthropic.Anthropic(base_url=node.base_url, api_key="x", timeout=120, max_retries=0)
    message = client.messages.create(
        model=model,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # this SDK's `create` has no `temperature` argument
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    return Answer(text, message.usage.input_tokens, message.usage.output_tokens)


def _ollama(node: RunningNode, model: str) -> Answer:
    client = ollama.Client(host=node.base_url, timeout=120)
    response = client.chat(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        options={"temperature": 0, "num_predict": MAX_TOKENS},
    )
    assert response.prompt_eval_count is not None and response.eval_count is not None
    return Answer(response.message.content or "", response.prompt_eval_count, response.eval_count)


def test_every_surface_gives_the_same_answer(random_node: RunningNode, model: str) -> None:
    answers = {
        "chat completions": _chat(random_node, model),
        "responses": _responses(random_node, model),
        "messages": _messages(random_node, model),
        "ollama": _ollama(random_node, model),
    }
    reference = answers["chat completions"]
    assert reference.text and reference.completion_tokens >= 1
    assert answers == dict.fromkeys(answers, reference)
