"""Families with no stage forward of Shoal's own, split over two real nodes, answer like one node:
a qwen3_moe model (experts) gives the tokens one node serving it whole gives; the scripted gpt_oss
model (tests/gptoss_model.py: sinks, sliding and full layers, harmony parsed at the entry node)
writes its scripts. The second stage's node fetches the folder from the first."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.family_models import make_family_model
from tests.gptoss_model import ANSWER, ARGUMENTS, REASONING, TOOL, TOOL_REASONING, make_scripted_gptoss
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.test_gptoss_surfaces import CHAT_TOOLS, QUESTION, WEATHER
from tests.test_instances import _tokens
from tests.waiting import wait_until


@contextmanager
def two_stages(folder: Path, tmp_path: Path, layers: list[tuple[int, int]]) -> Iterator[RunningNode]:
    """Two nodes serving `folder` as one 2-stage instance split at `layers`; yields the first node
    once the entry stage is ready, and stops both."""
    first = start_node(data_dir=tmp_path / "n0", model=None)
    nodes = [first]
    try:
        nodes.append(start_node("--peer", first.p2p_addr, data_dir=tmp_path / "n1", model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "agreed")
        created = httpx.post(
            f"{first.base_url}/v1/instances", json={"model": str(folder), "nodes": 2}, timeout=30
        )
        assert created.status_code == 201, created.text
        instance: dict[str, Any] = created.json()
        stages = instance["stages"]
        assert [(s["start_layer"], s["end_layer"]) for s in stages] == layers
        entry = next(n for n in nodes if n.node_id == stages[0]["node_id"])
        entry.wait_for_log(f"model {folder.name} ready", timeout=120)
        yield first
    finally:
        for node in nodes:
            node.stop()


def test_qwen3_moe_over_two_nodes_answers_like_one(builtin_model_dir: Path, tmp_path: Path) -> None:
    folder = make_family_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", tokenizer_from=builtin_model_dir)
    alone = start_node(data_dir=tmp_path / "alone", model=str(folder))
    try:
        reference = _tokens(alone, folder.name)
    finally:
        alone.stop()
    with two_stages(folder, tmp_path, [(0, 3), (3, 6)]) as first:
        assert _tokens(first, folder.name) == reference


def test_scripted_gpt_oss_over_two_nodes_writes_its_scripts(tmp_path: Path) -> None:
    folder = make_scripted_gptoss(tmp_path / "scripted-gpt-oss")
    with two_stages(folder, tmp_path, [(0, 1), (1, 2)]) as first:
        client = openai.OpenAI(base_url=f"{first.base_url}/v1", api_key="x", timeout=120, max_retries=0)
        answer = client.chat.completions.create(
            model=folder.name, messages=[{"role": "user", "content": QUESTION}], temperature=0
        ).choices[0]
        assert (answer.message.model_extra or {}).get("reasoning_content") == REASONING
        assert (answer.message.content, answer.finish_reason) == (ANSWER, "stop")
        call = client.chat.completions.create(
            model=folder.name,
            messages=[{"role": "user", "content": WEATHER}],
            tools=CHAT_TOOLS,
            temperature=0,
        ).choices[0]
        assert call.finish_reason == "tool_calls"
        assert (call.message.model_extra or {}).get("reasoning_content") == TOOL_REASONING
        calls = [
            (c.function.name, c.function.arguments)
            for c in call.message.tool_calls or []
            if c.type == "function"
        ]
        assert calls == [(TOOL, ARGUMENTS)]
