"""`GET /metrics`: parses with prometheus_client's own parser, and its series move with traffic.

The timing arithmetic (time to first token, decode speed) runs in-process on a scripted backend and
a hand-moved clock; the rest against a real node, through every layer a scrape goes through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from api.backend import Backend
from api.metrics import MeteredBackend, RequestMetrics
from protocol.chat import ChatMessage, GenerateRequest
from protocol.events import ChunkEvent, Finish, PrefillProgress, TextDelta, Usage
from protocol.ids import ModelId, RequestId
from tests.nodes import RunningNode

REQUEST = GenerateRequest(
    request_id=RequestId("chatcmpl-m"), model=ModelId("m"), messages=(ChatMessage(role="user", content="hi"),)
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedBackend:
    """Yields `(event, time)` pairs, setting the clock to each time before the event goes out."""

    def __init__(self, clock: Clock, script: list[tuple[ChunkEvent, float]]) -> None:
        self.clock, self.script = clock, script

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        async def events() -> AsyncIterator[ChunkEvent]:
            for event, at in self.script:
                self.clock.now = at
                yield event

        yield events()


def _metered(script: list[tuple[ChunkEvent, float]]) -> tuple[MeteredBackend, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    backend = cast(Backend, ScriptedBackend(clock, script))
    return MeteredBackend(backend, RequestMetrics(registry), clock), registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model": "m", **labels})


def test_time_to_first_token_and_decode_speed() -> None:
    finish = Finish(reason="length", usage=Usage(prompt_tokens=7, completion_tokens=5))
    script: list[tuple[ChunkEvent, float]] = [
        (PrefillProgress(processed_tokens=0, total_tokens=7), 100.2),  # not output: no first token yet
        *[(TextDelta(text="x"), 100.5 + 0.25 * i) for i in range(5)],
        (finish, 101.5),
    ]
    backend, registry = _metered(script)

    async def run() -> None:
        async with backend.open_stream(REQUEST) as events:
            assert [event async for event in events][-1] == finish

    trio.run(run)
    assert _value(registry, "shoal_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    # 4 tokens after the first, in the 1.0 s between it and the end.
    assert _value(registry, "shoal_decode_tokens_per_second_sum") == pytest.approx(4.0)
    assert _value(registry, "shoal_requests_total", outcome="length") == 1
    assert _value(registry, "shoal_generated_tokens_total") == 5
    assert _value(registry, "shoal_prompt_tokens_total") == 7


def test_a_stream_left_early_counts_as_client_gone() -> None:
    backend, registry = _metered([(TextDelta(text="x"), 100.1), (TextDelta(text="y"), 100.2)])

    async def run() -> None:
        async with backend.open_stream(REQUEST) as events:
            async for _ in events:
                break

    trio.run(run)
    assert _value(registry, "shoal_requests_total", outcome="client_gone") == 1
    assert _value(registry, "shoal_generated_tokens_total") is None


def _scrape(node: RunningNode) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(node.base_url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_a_node_exports_its_state_and_counts_requests(random_node: RunningNode) -> None:
    model = random_node.model_id
    assert model is not None
    before = _scrape(random_node)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    answer = httpx.post(random_node.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    after = _scrape(random_node)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model": model, **labels}.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("shoal_generated_tokens_total") == answer["usage"]["completion_tokens"]
    assert moved("shoal_prompt_tokens_total") == answer["usage"]["prompt_tokens"]
    assert moved("shoal_requests_total", outcome=answer["choices"][0]["finish_reason"]) == 1
    assert moved("shoal_time_to_first_token_seconds_count") == 1
    assert after[("shoal_cluster_members", (("status", "alive"),))] == 1
    assert after[("shoal_is_leader", ())] == 1
    assert after[("shoal_queue_depth", (("model", model),))] == 0
    assert after[("shoal_gossip_bytes_sent_total", (("kind", "gossip"),))] >= 0
