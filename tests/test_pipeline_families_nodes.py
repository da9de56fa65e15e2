"""A qwen3_moe model (experts: a family with no stage forward of Shoal's own) split over two real
nodes answers like one node serving it whole.

Not gpt_oss here: a node renders gpt_oss prompts with harmony's o200k ids, which a random model
on SmolLM2's vocabulary does not have (tests/test_pipeline_families.py covers its stages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.family_models import make_family_model
from tests.nodes import agreed_leader, start_node
from tests.test_instances import _tokens
from tests.waiting import wait_until


def test_qwen3_moe_over_two_nodes_answers_like_one(builtin_model_dir: Path, tmp_path: Path) -> None:
    folder = make_family_model(tmp_path / "tiny-qwen3-moe", "qwen3_moe", tokenizer_from=builtin_model_dir)
    alone = start_node(data_dir=tmp_path / "alone", model=str(folder))
    try:
        reference = _tokens(alone, folder.name)
    finally:
        alone.stop()
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
        assert [(s["start_layer"], s["end_layer"]) for s in stages] == [(0, 3), (3, 6)]
        entry = next(n for n in nodes if n.node_id == stages[0]["node_id"])
        entry.wait_for_log(f"model {folder.name} ready", timeout=120)
        assert _tokens(first, folder.name) == reference
    finally:
        for node in nodes:
            node.stop()
