"""Continuous batching: concurrent streams to one model are decoded together, each exactly as alone.

Runs on the random-weight model, prefix cache off (so that only batching is under test).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.nodes import RunningNode, start_node
from tests.waiting import wait_until

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "What are the three laws of thermodynamics? Explain each of them with an example from daily life.",
    "Write a haiku.",
    "List the planets of the solar system and one fact about each of them, in order from the sun.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    node = start_node(
        "--max-concurrent",
        "4",
        "--prefix-cache-tokens",
        "0",
        data_dir=tmp_path_factory.mktemp("data"),
        model=str(random_model_dir),
    )
    yield node
    node.stop()


@dataclass
class Stream:
    status: int = 0
    pieces: list[str] = field(default_factory=list)
    """The content of every chunk: one token's text each (the random model has no stop strings)."""
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    error: dict[str, object] | None = None


def _body(node: RunningNode, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": node.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }


def _stream(
    node: RunningNode, prompt: str, *, start: threading.Barrier | None = None, stop_after: int | None = None
) -> Stream:
    """One streamed completion; with `stop_after`, hang up after that many content chunks."""
    out = Stream()
    if start is not None:
        start.wait(timeout=30)
    with httpx.stream(
        "POST", f"{node.base_url}/v1/chat/completions", json=_body(node, prompt), timeout=60
    ) as r:
        out.status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    out.pieces.append(content)
                    out.times.append(time.monotonic())
                out.finish = choice["finish_reason"] or out.finish
            if stop_after is not None and len(out.pieces) >= stop_after:
                break
    return out


def _concurrently(node: RunningNode, stop_after: dict[int, int] | None = None) -> list[Stream]:
    stop_after = stop_after or {}
    start = threading.Barrier(len(PROMPTS))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(_stream, node, prompt, start=start, stop_after=stop_after.get(i))
            for i, prompt in enumerate(PROMPTS)
        ]
        return [f.result(timeout=120) for f in futures]


def test_concurrent_streams_get_the_tokens_they_get_alone(node: RunningNode) -> None:
    alone = [_stream(node, prompt) for prompt in PROMPTS]
    assert all(s.status == 200 and s.finish == "length" and len(s.pieces) == MAX_TOKENS for s in alone)
    together = _concurrently(node)
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert t.status == 200 and t.error is None
        assert t.pieces == a.pieces, f"stream {i} differs when batched"
        assert t.finish == a.finish
    # They were decoded together: every stream had its first token before any had its last.
    assert max(s.times[0] for s in together) < min(s.times[-1] for s in together)


def _cancelled(node: RunningNode) -> int:
    return int(node.health()["runners"][0]["cancelled"])


def _idle(node: RunningNode) -> bool:
    return bool(node.health()["runners"][0]["active_requests"] == 0)


def test_cancelling_one_stream_leaves_the_others_intact(node: RunningNode) -> None:
    alone = [_stream(node, prompt) for prompt in PROMPTS]
    cancelled = _cancelled(node)
    together = _concurrently(node, stop_after={1: 5})
    assert together[1].pieces == alone[1].pieces[:5]
    for i in (0, 2, 3):
        assert together[i].pieces == alone[i].pieces, f"stream {i} changed when stream 1 was cancelled"
        assert together[i].finish == "length"
    wait_until(lambda: _idle(node), 10, "idle after the cancel")
    assert _cancelled(node) == cancelled + 1  # the hang-up cancelled it, rather than it finishing


def test_a_seeded_sample_does_not_depend_on_its_batch(node: RunningNode) -> None:
    url = f"{node.base_url}/v1/chat/completions"
    body = {**_body(node, PROMPTS[0], max_tokens=16), "stream": False, "temperature": 1.0, "seed": 7}

    def text(extra: dict[str, object]) -> str:
        return str(
            httpx.post(url, json={**body, **extra}, timeout=60).json()["choices"][0]["message"]["content"]
        )

    alone = text({})
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(text, [{}, {}, {"seed": 8}, {"temperature": 0}]))
    assert batched[0] == batched[1] == alone
    assert batched[2] != alone


@pytest.fixture(scope="module")
def small_node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """One request runs, one may wait: the third in flight gets a 429."""
    node = start_node(
        "--max-concurrent",
        "1",
        "--max-queued",
        "1",
        data_dir=tmp_path_factory.mktemp("small"),
        model=str(random_model_dir),
    )
    yield node
    node.stop()


def test_past_the_queue_limit_the_api_answers_429(small_node: RunningNode) -> None:
    url = f"{small_node.base_url}/v1/chat/completions"
    cancelled = _cancelled(small_node)
    with ExitStack() as streams:
        for prompt in PROMPTS[:2]:  # long generations: one running, one queued behind it
            r = streams.enter_context(
                httpx.stream("POST", url, json=_body(small_node, prompt, max_tokens=1500), timeout=60)
            )
            assert r.status_code == 200
        runner = small_node.health()["runners"][0]
        assert (runner["active_requests"], runner["queued_requests"]) == (2, 1)
        for stream in (False, True):
            refused = httpx.post(url, json={**_body(small_node, PROMPTS[2]), "stream": stream}, timeout=10)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
            assert error["param"] is None and "busy" in error["message"]
    wait_until(lambda: _idle(small_node), 10, "idle after hanging up")
    assert _cancelled(small_node) == cancelled + 2  # the running one and the queued one
    after = httpx.post(url, json={**_body(small_node, PROMPTS[2], max_tokens=4), "stream": False}, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
