"""The scripted gpt_oss model (tests/gptoss_model.py) split over two real nodes writes its scripts as
one node does: a stage each (the first layer's attention, which reads the whole context, on the
entry node; the second layer on the other), harmony parsed at the entry node, the second stage's
node fetching the folder from the first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from tests.gptoss_model import ANSWER, ARGUMENTS, REASONING, TOOL, TOOL_REASONING, make_scripted_gptoss
from tests.nodes import agreed_leader, start_node
from tests.test_gptoss_surfaces import CHAT_TOOLS, QUESTION, WEATHER
from tests.waiting import wait_until


def test_two_stages_write_the_scripts(tmp_path: Path) -> None:
    folder = make_scripted_gptoss(tmp_path / "scripted-gpt-oss")
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
        assert [(s["start_layer"], s["end_layer"]) for s in stages] == [(0, 1), (1, 2)]
        entry = next(n for n in nodes if n.node_id == stages[0]["node_id"])
        entry.wait_for_log(f"model {folder.name} ready", timeout=120)

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
    finally:
        for node in nodes:
            node.stop()
