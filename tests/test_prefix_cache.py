"""The prefix cache: the next turn of a chat prefills only its new tokens and answers the same.

Node tests compare a node with the cache (the default) against one without (`--prefix-cache-tokens
0`) on the random-weight model; unit tests pin `PrefixCache`'s rules (budget, LRU, exact hits).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from transformers import AutoTokenizer

from node.runner.prefix_cache import PrefixCache
from tests.nodes import RunningNode, start_node

STEP = 64
"""--prefill-step-size of the nodes: progress comes in chunks of this many tokens."""


@pytest.fixture(scope="module")
def nodes(
    random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningNode, RunningNode]]:
    """(with the prefix cache, without it), both serving the random model."""
    step = ("--prefill-step-size", str(STEP))
    cached = start_node(*step, data_dir=tmp_path_factory.mktemp("cached"), model=str(random_model_dir))
    try:
        plain = start_node(
            *step,
            "--prefix-cache-tokens",
            "0",
            data_dir=tmp_path_factory.mktemp("plain"),
            model=str(random_model_dir),
        )
    except BaseException:
        cached.stop()
        raise
    yield cached, plain
    cached.stop()
    plain.stop()


@dataclass
class Turn:
    text: str
    usage: dict[str, Any]
    progress: list[int]
    """processed_tokens of every prefill progress event, in order."""

    @property
    def cached(self) -> int:
        return int(self.usage["prompt_tokens_details"]["cached_tokens"])


def _chat(node: RunningNode, messages: list[dict[str, str]], max_tokens: int = 24) -> Turn:
    body = {
        "model": node.model_id,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    progress: list[int] = []
    usage: dict[str, Any] | None = None
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": prefill_progress "):
                progress.append(json.loads(line.removeprefix(": prefill_progress "))["processed_tokens"])
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
                usage = chunk.get("usage") or usage
    assert usage is not None
    return Turn("".join(text), usage, progress)


def _expected_progress(total: int, cached: int) -> list[int]:
    """Progress when only tokens cached.. are prefilled: 0, the cache hit, chunks of STEP, the end.

    mlx-lm prefills all but the last prompt token in chunks; the last one starts the decode.
    """
    rest = total - cached - 1
    chunks = [cached + min(STEP * i, rest) for i in range(1, math.ceil(rest / STEP) + 1)]
    return [0] + ([cached] if cached else []) + chunks + [total]


def test_next_turns_prefill_only_new_tokens_and_answer_the_same(
    nodes: tuple[RunningNode, RunningNode],
) -> None:
    cached_node, plain_node = nodes
    conversation = [
        {"role": "system", "content": "You answer questions about ships. " + os.urandom(4).hex()},
        {"role": "user", "content": "What is a schooner? " + " ".join(f"detail{i}" for i in range(80))},
    ]
    follow_ups = ["And a brig?", "Which one is faster, and why? Explain with many words.", "Thanks!"]
    previous_prompt = 0
    for turn, follow_up in enumerate(follow_ups):
        with_cache, without = _chat(cached_node, conversation), _chat(plain_node, conversation)
        assert with_cache.text == without.text, f"turn {turn}: the prefix cache changed the answer"
        total = with_cache.usage["prompt_tokens"]
        assert without.usage["prompt_tokens"] == total and without.cached == 0
        assert without.progress == _expected_progress(total, 0)
        # Everything up to the previous turn's prompt (a prefix of this one) comes from the cache,
        # plus however much of the answer re-tokenizes the way it was generated.
        assert previous_prompt <= with_cache.cached < total
        assert (with_cache.cached > 0) == (turn > 0)
        assert with_cache.progress == _expected_progress(total, with_cache.cached)
        previous_prompt = total
        conversation += [
            {"role": "assistant", "content": with_cache.text},
            {"role": "user", "content": follow_up},
        ]


def test_cached_tokens_is_the_shared_prefix(
    nodes: tuple[RunningNode, RunningNode], random_model_dir: Path
) -> None:
    cached_node, _ = nodes
    system = {"role": "system", "content": "You are terse. " + os.urandom(4).hex()}
    first = [system, {"role": "user", "content": "Alpha: name three rivers in Europe."}]
    second = [system, {"role": "user", "content": "Beta: name three mountains in Asia."}]
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)

    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    a, b = ids(first), ids(second)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 0 < shared < len(a)
    _chat(cached_node, first)
    assert _chat(cached_node, second).cached == shared
    # The same request again: all of the prompt is cached but its last token, which starts the decode.
    again = _chat(cached_node, second)
    assert again.cached == again.usage["prompt_tokens"] - 1


def test_non_streamed_usage_reports_cached_tokens(nodes: tuple[RunningNode, RunningNode]) -> None:
    cached_node, _ = nodes
    body = {
        "model": cached_node.model_id,
        "messages": [{"role": "user", "content": "Count to three. " + os.urandom(4).hex()}],
        "temperature": 0,
        "max_tokens": 4,
    }
    url = f"{cached_node.base_url}/v1/chat/completions"
    first = httpx.post(url, json=body, timeout=60).json()
    second = httpx.post(url, json=body, timeout=60).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < second["usage"]["prompt_tokens"] - 1


# --- PrefixCache's rules, on small real KV caches -----------------------------------------------
def _kv(n_tokens: int, layers: int = 2) -> list[Any]:
    """An exactly sized KV cache of n_tokens positions, like the runner stores (values don't matter)."""
    caches = []
    for _ in range(layers):
        cache = KVCache()
        cache.keys, cache.values = mx.zeros((1, 1, n_tokens, 4)), mx.zeros((1, 1, n_tokens, 4))
        cache.offset = n_tokens
        caches.append(cache)
    return caches


def test_exact_hit_leaves_the_last_token_to_run() -> None:
    cache = PrefixCache(max_tokens=1000)
    tokens = list(range(10, 30))
    cache.insert(tokens, _kv(20))
    hit, cached = cache.fetch(tokens)
    assert cached == 19 and hit is not None and all(c.offset == 19 for c in hit)
    hit, cached = cache.fetch([*tokens, 7, 8])  # a longer prompt: the whole entry
    assert cached == 20 and hit is not None and all(c.offset == 20 for c in hit)
    hit, cached = cache.fetch([*tokens[:5], 99, 98])  # diverges after 5: the entry trimmed to 5
    assert cached == 5 and hit is not None and all(c.offset == 5 for c in hit)
    assert cache.fetch([99, 98, 97]) == (None, 0)
    assert cache.hits == 3 and cache.misses == 1


def test_a_hit_is_a_private_copy() -> None:
    cache = PrefixCache(max_tokens=1000)
    cache.insert(list(range(8)), _kv(8))
    hit, _ = cache.fetch([*range(8), 50])
    assert hit is not None
    for c in hit:
        c.update_and_fetch(mx.ones((1, 1, 3, 4)), mx.ones((1, 1, 3, 4)))
    again, cached = cache.fetch([*range(8), 50])
    assert cached == 8 and again is not None and all(c.offset == 8 for c in again)


def test_budget_evicts_the_least_recently_stored() -> None:
    cache = PrefixCache(max_tokens=100)
    a, b, c = list(range(0, 60)), list(range(1000, 1030)), list(range(2000, 2040))
    cache.insert(a, _kv(60))
    cache.insert(b, _kv(30))
    assert len(cache) == 2
    cache.insert(c, _kv(40))  # 130 tokens > 100: the oldest (a) goes
    assert len(cache) == 2
    assert cache.fetch([*a, 1]) == (None, 0)
    assert cache.fetch([*b, 1])[1] == 30 and cache.fetch([*c, 1])[1] == 40


def test_an_extension_replaces_its_prefix_and_too_long_is_not_kept() -> None:
    cache = PrefixCache(max_tokens=50)
    cache.insert(list(range(20)), _kv(20))
    cache.insert(list(range(30)), _kv(30))
    assert len(cache) == 1 and cache.fetch([*range(30), 1])[1] == 30
    cache.insert(list(range(100, 160)), _kv(60))  # over the whole budget: not stored
    assert len(cache) == 1


def test_zero_budget_disables() -> None:
    cache = PrefixCache(max_tokens=0)
    cache.insert(list(range(20)), _kv(20))
    assert not cache.enabled and len(cache) == 0 and cache.fetch(list(range(21))) == (None, 0)
