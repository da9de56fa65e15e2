"""How an instance spreads a model over its nodes, and the stage layouts each way allows. Pure."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

Sharding = Literal["pipeline", "tensor"]
SHARDINGS: tuple[Sharding, ...] = ("pipeline", "tensor")
"""By layers (stages, each a contiguous range), or every layer on every node (tensor-parallel ranks)."""
ShardingChoice = Literal["pipeline", "tensor", "auto"]
SHARDING_CHOICES: tuple[ShardingChoice, ...] = ("pipeline", "tensor", "auto")
"""What a request may ask for: a sharding, or "auto" (the leader picks one: `protocol.auto_sharding`)."""


def layout_error(sharding: str, spans: Sequence[tuple[str, int, int]]) -> str | None:
    """Why (node, start layer, end layer) of each stage, in order, is no layout for `sharding`;
    None when it is one."""
    if sharding not in SHARDINGS:
        return f"sharding must be one of {SHARDINGS}"
    if sharding == "tensor":
        if len(spans) < 2 or len({node for node, _, _ in spans}) != len(spans):
            return "a tensor-parallel instance has 2 or more ranks, each on its own node"
        if any((start, end) != (0, spans[0][2]) for _, start, end in spans):
            return "every rank of a tensor-parallel instance holds every layer"
    elif any(after[1] != before[2] for before, after in itertools.pairwise(spans)):
        return "stages must be contiguous and in layer order"
    return None
