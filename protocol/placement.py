"""Placement: which nodes run which layers of a model. Pure: shapes and byte counts in, stages out.

`place(shape, nodes)` splits a model's layers into contiguous pipeline stages, one per node:

1. A node's usable bytes are its available bytes less `headroom` (a fraction kept free for
   activations and the runtime). Nodes are ranked by available bytes, largest first, ties by node id,
   so the order of the input never matters.
2. By default as few nodes as fit are used: the largest node alone if the whole model fits it, else
   the two largest, and so on. `nodes_wanted=N` asks for exactly N nodes (the largest, but
   see rule 5).
3. The first stage holds the embedding, the last the head (final norm + lm_head, and the embedding
   matrix again when the embeddings are tied and the stages differ). These fixed costs sit at the
   two ends, so the two largest chosen nodes take the first and the last stage; the middle stages
   follow in decreasing memory.
4. Layers go in proportion to the nodes' usable bytes (rounded half up on the running total; every
   stage at least one layer). Every layer also reserves its KV cache for `shape.context_length`
   tokens. If that split overflows a node, the feasible split nearest to it (the least total shift
   of the stage boundaries, in layers) is taken instead.
5. Nodes that already hold the model's files are preferred (`held`: bytes of them on each node):
   for each number of nodes, the set of that many that holds the most is tried first (then by
   available bytes), and the largest nodes only when that set does not fit. So a model on one node
   that fits it stays there, and a split reuses the holders; rule 2 still comes first (never more
   nodes to avoid a transfer), and within the set chosen, rule 3 orders the stages.

Replicas (`place_replicas`): up to N placements on disjoint sets of nodes, each chosen as above
on the nodes the earlier ones (and the model's running replicas) left free; as many as fit.

Tensor-parallel instances (`place_tensor`): every chosen node holds a slice of every layer (one
rank each, `ModelShape.rank_bytes`), rank 0 on the largest. By default as many ranks as there are
live nodes and as the model's shape allows (`tensor_ranks`): each rank added reads fewer bytes a
token; the holders of the model's files are preferred as in rule 5.

When nothing fits, `PlacementError` says what the model needs and what each node has. A `Placement`
is a plan only (`place` changes nothing): an API can show it before the leader writes it as an
`InstanceRecord` (`Placement.instance`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.model_shape import ModelShape, prefix_sums
from protocol.record_limits import MAX_STAGES
from protocol.sharding import Sharding

__all__ = [
    "ModelShape",
    "Placement",
    "PlacementError",
    "format_bytes",
    "place",
    "place_replicas",
    "place_tensor",
]

MAX_NODES_IN_MESSAGE = 16
"""An error lists this many nodes (the largest) and counts the rest: messages stay readable."""
MAX_REPLICAS = 64
"""Replicas one request may ask for: each needs nodes of its own, and Shoal's clusters are a few
machines to a few dozen; a larger number is a mistake, refused before any work."""


class PlacementError(ValueError):
    """The model cannot be placed on these nodes (too little memory, or an impossible request)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A plan: the stages in pipeline order, what each needs and what its node can give."""

    model: ModelId
    stages: tuple[StageAssignment, ...]
    bytes_per_stage: tuple[int, ...]
    """Bytes each stage needs (weights + KV cache), as `ModelShape.stage_bytes` counts them."""
    capacity_per_stage: tuple[int, ...]
    """Usable bytes of each stage's node (available less headroom); never below `bytes_per_stage`."""
    sharding: Sharding = "pipeline"
    """"tensor": `stages` are ranks (`place_tensor`), each holding a slice of every layer."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_stage)

    def instance(self, instance_id: InstanceId) -> InstanceRecord:
        """The record the leader writes to apply this plan."""
        return InstanceRecord(instance_id, self.model, self.stages, sharding=self.sharding)


def place(
    shape: ModelShape,
    nodes: Sequence[tuple[NodeId, int]],
    *,
    headroom: float = 0.0,
    nodes_wanted: int | None = None,
    held: Mapping[NodeId, int] | None = None,
) -> Placement:
    """Split `shape` across `nodes` (`(node id, available bytes)`, any order); see the module doc.

    `headroom` is the fraction of each node's available bytes kept free; `held` the bytes of the
    model's files each node holds already (rule 5; absent nodes hold none). Raises `PlacementError`
    when nothing fits or `nodes_wanted` cannot be met, and `ValueError` for malformed input
    (a repeated node id, negative bytes, a headroom outside [0, 1)). Deterministic.
    """
    ranked = _rank(nodes, headroom)
    if not ranked:
        raise PlacementError(f"model {shape.model} cannot be placed: no live nodes")
    if nodes_wanted is not None:
        _check_wanted(shape, nodes_wanted, len(ranked))
        counts: Sequence[int] = (nodes_wanted,)
    elif shape.unsplittable:
        counts = (1,)
    else:
        counts = range(1, min(len(ranked), shape.num_layers, MAX_STAGES) + 1)
    prefix = prefix_sums(shape)
    for count in counts:
        for chosen in _candidates(ranked, count, held or {}):
            if (found := _place_on(shape, prefix, chosen)) is not None:
                return found
    raise PlacementError(_no_fit_message(shape, ranked, headroom, nodes_wanted))


def place_tensor(
    shape: ModelShape,
    nodes: Sequence[tuple[NodeId, int]],
    *,
    headroom: float = 0.0,
    nodes_wanted: int | None = None,
    held: Mapping[NodeId, int] | None = None,
) -> Placement:
    """A tensor-parallel group for `shape` on `nodes` (see the module doc); `PlacementError` when the
    model cannot be split so, too few nodes are live, or the ranks do not fit."""
    if shape.tensor_ranks < 2:
        why = shape.tensor_unsplittable or "its shape does not split into ranks"
        raise PlacementError(f"model {shape.model} cannot run tensor-parallel: {why}")
    ranked = _rank(nodes, headroom)
    most = min(len(ranked), shape.tensor_ranks)
    if nodes_wanted is not None:
        if nodes_wanted < 2:
            raise PlacementError("a tensor-parallel instance needs at least 2 nodes")
        if nodes_wanted > shape.tensor_ranks:
            raise PlacementError(
                f"model {shape.model} splits into at most {shape.tensor_ranks} tensor-parallel ranks"
            )
        if nodes_wanted > len(ranked):
            raise PlacementError(f"asked for {nodes_wanted} nodes but only {len(ranked)} are live")
    elif most < 2:
        raise PlacementError(f"a tensor-parallel instance needs 2 live nodes; {len(ranked)} live")
    counts = (nodes_wanted,) if nodes_wanted is not None else range(most, 1, -1)
    for count in counts:
        need = shape.rank_bytes(count)
        for chosen in _candidates(ranked, count, held or {}):
            if all(n.capacity >= need for n in chosen):
                stages = tuple(StageAssignment(n.id, 0, shape.num_layers) for n in chosen)
                caps = tuple(n.capacity for n in chosen)
                return Placement(shape.model, stages, (need,) * count, caps, "tensor")
    fewest = counts[-1]
    listed = ", ".join(f"node {n.id[-8:]} {format_bytes(n.capacity)}" for n in ranked[:MAX_NODES_IN_MESSAGE])
    raise PlacementError(
        f"model {shape.model} needs {format_bytes(shape.rank_bytes(fewest))} on each of {fewest} nodes "
        f"to run tensor-parallel; available: {listed}"
    )


def place_replicas(
    shape: ModelShape,
    nodes: Sequence[tuple[NodeId, int]],
    count: int,
    *,
    exclude: Collection[NodeId] = (),
    headroom: float = 0.0,
    nodes_wanted: int | None = None,
    held: Mapping[NodeId, int] | None = None,
    sharding: Sharding = "pipeline",
) -> list[Placement]:
    """Up to `count` placements of `shape`, none sharing a node with another or using one in
    `exclude` (the nodes of the model's running replicas); `place` (`place_tensor` for "tensor"
    sharding) chooses each on the nodes still
    free. As many as fit come back, in order; `PlacementError` only when not even one fits."""
    if not 1 <= count <= MAX_REPLICAS:
        raise ValueError(f"count must be in [1, {MAX_REPLICAS}], not {count!r}")
    free = [(node, available) for node, available in nodes if node not in exclude]
    if not free and nodes:
        raise PlacementError(f"every live node already runs a replica of model {shape.model}")
    plans: list[Placement] = []
    while len(plans) < count:
        try:
            planner = place_tensor if sharding == "tensor" else place
            plan = planner(shape, free, headroom=headroom, nodes_wanted=nodes_wanted, held=held)
        except PlacementError:
            if not plans:
                raise
            break
        plans.append(plan)
        used = {stage.node for stage in plan.stages}
        free = [(node, available) for node, available in free if node not in used]
        if not free:
            break
    return plans


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


def _candidates(ranked: list[_Node], count: int, held: Mapping[NodeId, int]) -> list[list[_Node]]:
    """The sets of `count` nodes to try, in order (rule 5), each in rank order: the holders' first."""
    largest = ranked[:count]
    if not any(held.get(n.id, 0) > 0 for n in ranked):
        return [largest]
    position = {n.id: i for i, n in enumerate(ranked)}
    by_holding = sorted(ranked, key=lambda n: (-held.get(n.id, 0), position[n.id]))[:count]
    holders_first = sorted(by_holding, key=lambda n: position[n.id])
    return [holders_first] if holders_first == largest else [holders_first, largest]


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
    if wanted > 1 and shape.unsplittable:
        raise PlacementError(
            f"asked for {wanted} nodes but model {shape.model} cannot be split into stages: "
            f"{shape.unsplittable}"
        )


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
    elif shape.unsplittable:
        message += f"; it must fit one node: it cannot be split into stages ({shape.unsplittable})"
    pool = ranked[:1] if shape.unsplittable else ranked if nodes_wanted is None else ranked[:nodes_wanted]
    if sum(n.capacity for n in pool) >= shape.total_bytes:
        largest = max(shape.layer_bytes) + shape.kv_bytes_per_layer
        message += (
            f"; together they have enough, but no contiguous split of the {shape.num_layers} layers "
            f"fits (largest layer {format_bytes(largest)}, embedding {format_bytes(shape.embedding_bytes)}, "
            f"head {format_bytes(shape.head_bytes)}{' + tied embedding' if shape.tied_embeddings else ''})"
        )
    return message
