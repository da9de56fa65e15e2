"""Placement: which nodes run which layers of a model. Pure: shapes and byte counts in, stages out.

`place(shape, nodes)` splits a model's layers into contiguous pipeline stages, one per node:

1. A node's usable bytes are its available bytes less `headroom` (a fraction kept free for
   activations and the runtime). Nodes are ranked by available bytes, largest first, ties by node id,
   so the order of the input never matters.
2. By default as few nodes as fit are used: the largest node alone if the whole model fits it, else
   the two largest, and so on. `nodes_wanted=N` asks for exactly the N largest nodes.
3. The first stage holds the embedding, the last the head (final norm + lm_head, and the embedding
   matrix again when the embeddings are tied and the stages differ). These fixed costs sit at the
   two ends, so the two largest chosen nodes take the first and the last stage; the middle stages
   follow in decreasing memory.
4. Layers go in proportion to the nodes' usable bytes (rounded half up on the running total; every
   stage at least one layer). Every layer also reserves its KV cache for `shape.context_length`
   tokens. If that split overflows a node, the feasible split nearest to it (the least total shift
   of the stage boundaries, in layers) is taken instead.

When nothing fits, `PlacementError` says what the model needs and what each node has. A `Placement`
is a plan only (`place` changes nothing): an API can show it before the leader writes it as an
`InstanceRecord` (`Placement.instance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.cluster_records import MAX_STAGES, InstanceRecord, StageAssignment
from protocol.ids import InstanceId, ModelId, NodeId

MAX_NODES_IN_MESSAGE = 16
"""An error lists this many nodes (the largest) and counts the rest: messages stay readable."""


class PlacementError(ValueError):
    """The model cannot be placed on these nodes (too little memory, or an impossible request)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What placement needs to know of a model: the bytes each part of it takes at run time."""

    model: ModelId
    layer_bytes: tuple[int, ...]
    """Weights of each transformer layer, in layer order; its length is the number of layers."""
    embedding_bytes: int
    """The token embedding, held by the first stage (and by the last one too when tied)."""
    head_bytes: int
    """The final norm and lm_head (none when tied), held by the last stage."""
    tied_embeddings: bool
    """lm_head is the embedding matrix: the last stage needs a copy of it."""
    kv_bytes_per_token: int
    """KV cache of one layer for one token (2 x kv heads x head dim x dtype bytes)."""
    context_length: int
    """Tokens of KV cache reserved per layer."""

    def __post_init__(self) -> None:
        if not isinstance(self.layer_bytes, tuple) or not self.layer_bytes:
            raise ValueError("layer_bytes must be a non-empty tuple")
        for name, value in (
            *(("layer bytes", b) for b in self.layer_bytes),
            ("embedding_bytes", self.embedding_bytes),
            ("head_bytes", self.head_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("context_length", self.context_length),
        ):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")

    @classmethod
    def uniform(
        cls,
        model: ModelId,
        *,
        num_layers: int,
        bytes_per_layer: int,
        embedding_bytes: int,
        head_bytes: int,
        tied_embeddings: bool = False,
        kv_bytes_per_token: int = 0,
        context_length: int = 0,
    ) -> ModelShape:
        """A shape whose `num_layers` layers all weigh `bytes_per_layer`."""
        if num_layers < 1:
            raise ValueError("a model has at least one layer")
        return cls(
            model,
            (bytes_per_layer,) * num_layers,
            embedding_bytes,
            head_bytes,
            tied_embeddings,
            kv_bytes_per_token,
            context_length,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def kv_bytes_per_layer(self) -> int:
        """The KV cache one layer reserves for `context_length` tokens."""
        return self.kv_bytes_per_token * self.context_length

    @property
    def weight_bytes(self) -> int:
        """Every weight once: what a single node holds."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_layer * self.num_layers

    @property
    def total_bytes(self) -> int:
        """What the whole model needs on one node: weights and KV cache."""
        return self.weight_bytes + self.kv_bytes

    def stage_bytes(self, start: int, end: int) -> int:
        """Bytes a stage running layers [start, end) needs: its layers, their KV cache, and the
        embedding when it is the first stage, the head (and the tied embedding) when it is the last."""
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"no stage [{start}, {end}) in {self.num_layers} layers")
        return self._stage_bytes(_prefix_sums(self), start, end)

    def _stage_bytes(self, prefix: Sequence[int], start: int, end: int) -> int:
        total = prefix[end] - prefix[start]
        if start == 0:
            total += self.embedding_bytes
        if end == self.num_layers:
            total += self.head_bytes
            if self.tied_embeddings and start != 0:
                total += self.embedding_bytes
        return total


@dataclass(frozen=True, slots=True)
class Placement:
    """A plan: the stages in pipeline order, what each needs and what its node can give."""

    model: ModelId
    stages: tuple[StageAssignment, ...]
    bytes_per_stage: tuple[int, ...]
    """Bytes each stage needs (weights + KV cache), as `ModelShape.stage_bytes` counts them."""
    capacity_per_stage: tuple[int, ...]
    """Usable bytes of each stage's node (available less headroom); never below `bytes_per_stage`."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_stage)

    def instance(self, instance_id: InstanceId) -> InstanceRecord:
        """The record the leader writes to apply this plan."""
        return InstanceRecord(instance_id, self.model, self.stages)


def place(
    shape: ModelShape,
    nodes: Sequence[tuple[NodeId, int]],
    *,
    headroom: float = 0.0,
    nodes_wanted: int | None = None,
) -> Placement:
    """Split `shape` across `nodes` (`(node id, available bytes)`, any order); see the module doc.

    `headroom` is the fraction of each node's available bytes kept free. Raises `PlacementError`
    when nothing fits or `nodes_wanted` cannot be met, and `ValueError` for malformed input
    (a repeated node id, negative bytes, a headroom outside [0, 1)). Deterministic.
    """
    ranked = _rank(nodes, headroom)
    if not ranked:
        raise PlacementError(f"model {shape.model} cannot be placed: no live nodes")
    if nodes_wanted is not None:
        _check_wanted(shape, nodes_wanted, len(ranked))
        counts: Sequence[int] = (nodes_wanted,)
    else:
        counts = range(1, min(len(ranked), shape.num_layers, MAX_STAGES) + 1)
    prefix = _prefix_sums(shape)
    for count in counts:
        if (found := _place_on(shape, prefix, ranked[:count])) is not None:
            return found
    raise PlacementError(_no_fit_message(shape, ranked, headroom, nodes_wanted))


@dataclass(frozen=True, slots=True)
class _Node:
    id: NodeId
    available: int
    capacity: int


def _rank(nodes: Sequence[tuple[NodeId, int]], headroom: float) -> list[_Node]:
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), not {headroom!r}")
    seen: set[str] = set()
    ranked: list[_Node] = []
    for node, available in nodes:
        if node in seen:
            raise ValueError(f"node {node} is listed twice")
        if type(available) is not int or available < 0:
            raise ValueError(f"node {node}: available bytes must be a non-negative integer")
        seen.add(node)
        ranked.append(_Node(node, available, int(available * (1.0 - headroom))))
    ranked.sort(key=lambda n: (-n.available, n.id))
    return ranked


def _check_wanted(shape: ModelShape, wanted: int, live: int) -> None:
    if wanted < 1:
        raise PlacementError(f"asked for {wanted} nodes: at least 1 is needed")
    if wanted > live:
        raise PlacementError(f"asked for {wanted} nodes but only {live} are live")
    if wanted > shape.num_layers:
        raise PlacementError(
            f"asked for {wanted} nodes but model {shape.model} has only {shape.num_layers} layers"
        )
    if wanted > MAX_STAGES:
        raise PlacementError(f"asked for {wanted} nodes: an instance has at most {MAX_STAGES} stages")


def _prefix_sums(shape: ModelShape) -> list[int]:
    """prefix[j]: bytes of layers [0, j), KV cache included."""
    prefix = [0]
    for layer in shape.layer_bytes:
        prefix.append(prefix[-1] + layer + shape.kv_bytes_per_layer)
    return prefix


def _pipeline_order(chosen: list[_Node]) -> list[_Node]:
    """Largest first, second largest last (the ends carry the embedding and the head)."""
    if len(chosen) <= 2:
        return chosen
    return [chosen[0], *chosen[2:], chosen[1]]


def _place_on(shape: ModelShape, prefix: list[int], chosen: list[_Node]) -> Placement | None:
    """The placement on exactly these nodes, or None when none fits."""
    order = _pipeline_order(chosen)
    caps = [n.capacity for n in order]
    tied_copy = shape.embedding_bytes if shape.tied_embeddings and len(order) > 1 else 0
    if shape.total_bytes + tied_copy > sum(caps):
        return None  # cheap early answer: the stages together need this much
    target = _proportional(shape.num_layers, caps)
    bounds = target if _fits(shape, prefix, target, caps) else _nearest_fit(shape, prefix, target, caps)
    if bounds is None:
        return None
    stages = tuple(
        StageAssignment(node.id, start, end)
        for node, start, end in zip(order, bounds, bounds[1:], strict=False)
    )
    need = tuple(shape._stage_bytes(prefix, s.start_layer, s.end_layer) for s in stages)
    return Placement(shape.model, stages, need, tuple(caps))


def _proportional(num_layers: int, caps: list[int]) -> list[int]:
    """Stage boundaries [0, b1, ..., L] in proportion to `caps`, each stage at least one layer."""
    count, total = len(caps), sum(caps)
    bounds, running = [0], 0
    for i, cap in enumerate(caps[:-1], start=1):
        running += cap
        ideal = (2 * num_layers * running + total) // (2 * total) if total else i
        bounds.append(min(max(ideal, bounds[-1] + 1), num_layers - (count - i)))
    bounds.append(num_layers)
    return bounds


def _fits(shape: ModelShape, prefix: list[int], bounds: list[int], caps: list[int]) -> bool:
    return all(
        shape._stage_bytes(prefix, start, end) <= cap
        for start, end, cap in zip(bounds, bounds[1:], caps, strict=False)
    )


def _nearest_fit(
    shape: ModelShape, prefix: list[int], target: list[int], caps: list[int]
) -> list[int] | None:
    """The fitting boundaries with the least sum of |b_i - target_i|; None when none fit.

    Dynamic programming over (stage, end layer). A stage's bytes only grow as its start moves back,
    so the scan over starts stops at the first that does not fit.
    """
    layers, count = shape.num_layers, len(caps)
    cost: list[int | None] = [0] + [None] * layers  # cost[j]: best shift with stages so far ending at j
    back: list[list[int]] = []
    for i in range(1, count + 1):
        new: list[int | None] = [None] * (layers + 1)
        parent = [-1] * (layers + 1)
        ends = [layers] if i == count else range(i, layers - (count - i) + 1)
        for end in ends:
            shift = 0 if i == count else abs(end - target[i])
            for start in range(end - 1, i - 2, -1):
                if shape._stage_bytes(prefix, start, end) > caps[i - 1]:
                    break
                before, best = cost[start], new[end]
                if before is not None and (best is None or before + shift < best):
                    new[end], parent[end] = before + shift, start
        cost = new
        back.append(parent)
    if cost[layers] is None:
        return None
    bounds = [layers]
    for parent in reversed(back):
        bounds.append(parent[bounds[-1]])
    return bounds[::-1]


def format_bytes(n: int) -> str:
    """Bytes for people: "2.10 GB", "35.4 MB", "512 B" (decimal units)."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB"
    if n >= 10**6:
        return f"{n / 1e6:.1f} MB"
    if n >= 10**3:
        return f"{n / 1e3:.1f} kB"
    return f"{n} B"


def _no_fit_message(shape: ModelShape, ranked: list[_Node], headroom: float, nodes_wanted: int | None) -> str:
    kv = f"KV cache {format_bytes(shape.kv_bytes)} for {shape.context_length} tokens"
    need = (
        f"model {shape.model} needs {format_bytes(shape.total_bytes)} "
        f"(weights {format_bytes(shape.weight_bytes)} + {kv})"
    )
    listed = ", ".join(f"node {n.id[-8:]} {format_bytes(n.capacity)}" for n in ranked[:MAX_NODES_IN_MESSAGE])
    if len(ranked) > MAX_NODES_IN_MESSAGE:
        listed += f" and {len(ranked) - MAX_NODES_IN_MESSAGE} more"
    kept = f" (after keeping {headroom:.0%} free)" if headroom else ""
    message = f"{need}; available{kept}: {listed}"
    if nodes_wanted is not None:
        message += f"; asked for exactly {nodes_wanted} nodes (the largest)"
    pool = ranked if nodes_wanted is None else ranked[:nodes_wanted]
    if sum(n.capacity for n in pool) >= shape.total_bytes:
        largest = max(shape.layer_bytes) + shape.kv_bytes_per_layer
        message += (
            f"; together they have enough, but no contiguous split of the {shape.num_layers} layers "
            f"fits (largest layer {format_bytes(largest)}, embedding {format_bytes(shape.embedding_bytes)}, "
            f"head {format_bytes(shape.head_bytes)}{' + tied embedding' if shape.tied_embeddings else ''})"
        )
    return message
