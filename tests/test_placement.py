"""Placement: the rules as a table, the errors by their messages, then properties over random input."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import placement as placement_module
from protocol.cluster_records import InstanceRecord, StageAssignment
from protocol.ids import InstanceId, ModelId, NodeId
from protocol.placement import ModelShape, Placement, PlacementError, format_bytes, place

A, B, C, D = (NodeId(f"12D3KooW{c}") for c in "abcd")


def uniform(
    layers: int = 30,
    per_layer: int = 100,
    *,
    emb: int = 0,
    head: int = 0,
    tied: bool = False,
    kv: int = 0,
    ctx: int = 0,
) -> ModelShape:
    return ModelShape.uniform(
        ModelId("m"),
        num_layers=layers,
        bytes_per_layer=per_layer,
        embedding_bytes=emb,
        head_bytes=head,
        tied_embeddings=tied,
        kv_bytes_per_token=kv,
        context_length=ctx,
    )


def spans(p: Placement) -> list[tuple[str, int, int]]:
    return [(s.node, s.start_layer, s.end_layer) for s in p.stages]


@pytest.mark.parametrize(
    ("name", "shape", "nodes", "wanted", "expected"),
    [
        ("one node fits: the largest takes all", uniform(), [(A, 3000), (B, 9000)], None, [(B, 0, 30)]),
        ("exactly fits one node", uniform(), [(A, 3000), (B, 1000)], None, [(A, 0, 30)]),
        (
            "two nodes 3:1: 30 layers split 23/7 (half rounds to the larger)",
            uniform(),
            [(A, 2400), (B, 800)],
            None,
            [(A, 0, 23), (B, 23, 30)],
        ),
        (
            "two nodes 3:1: 28 layers split 21/7",
            uniform(28),
            [(B, 800), (A, 2400)],
            None,
            [(A, 0, 21), (B, 21, 28)],
        ),
        (
            "as few nodes as fit: the third is left out",
            uniform(),
            [(A, 2000), (B, 2000), (C, 100)],
            None,
            [(A, 0, 15), (B, 15, 30)],
        ),
        (
            "exactly 3 asked: the 3 largest; the two largest at the ends",
            uniform(),
            [(A, 3000), (B, 2000), (C, 1000), (D, 500)],
            3,
            [(A, 0, 15), (C, 15, 20), (B, 20, 30)],
        ),
        ("exactly 2 asked though one fits", uniform(), [(A, 9000), (B, 3000)], 2, [(A, 0, 23), (B, 23, 30)]),
        (
            "ties by node id: smallest id chosen",
            uniform(10),
            [(C, 1000), (B, 1000), (A, 1000)],
            None,
            [(A, 0, 10)],
        ),
        (
            "ties by node id: smallest id first",
            uniform(10),
            [(C, 600), (B, 600), (A, 600)],
            None,
            [(A, 0, 5), (B, 5, 10)],
        ),
        (
            "KV cache counted per layer: 150 B a layer",
            uniform(10, kv=1, ctx=50),
            [(A, 1400), (B, 200)],
            None,
            [(A, 0, 9), (B, 9, 10)],
        ),
        (
            "rounding overflow rebalanced: embedding pushes a layer to the second node",
            uniform(10, emb=450),
            [(A, 1000), (B, 800)],
            None,
            [(A, 0, 5), (B, 5, 10)],
        ),
        (
            "a heavy last layer moves the boundary back",
            ModelShape(ModelId("m"), (100,) * 9 + (500,), 0, 0, False, 0, 0),
            [(A, 1000), (B, 700)],
            None,
            [(A, 0, 7), (B, 7, 10)],
        ),
        (
            "one layer per node when only that fits",
            uniform(3),
            [(A, 100), (B, 100), (C, 100)],
            None,
            [(A, 0, 1), (C, 1, 2), (B, 2, 3)],
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_place(
    name: str,
    shape: ModelShape,
    nodes: list[tuple[NodeId, int]],
    wanted: int | None,
    expected: list[tuple[str, int, int]],
) -> None:
    result = place(shape, nodes, nodes_wanted=wanted)
    assert spans(result) == expected
    for stage, need, cap in zip(
        result.stages, result.bytes_per_stage, result.capacity_per_stage, strict=True
    ):
        assert need == shape.stage_bytes(stage.start_layer, stage.end_layer) <= cap


def test_input_order_does_not_matter() -> None:
    nodes = [(A, 3000), (B, 2000), (C, 1000), (D, 2000)]
    results = {place(uniform(), perm, nodes_wanted=3) for perm in itertools.permutations(nodes)}
    assert len(results) == 1


def test_tied_embeddings_last_stage_holds_the_embedding_too() -> None:
    tied = uniform(10, emb=500, head=10, tied=True)
    assert tied.total_bytes == 1510  # one node holds the embedding once
    result = place(tied, [(A, 1200), (B, 1200)])
    assert spans(result) == [(A, 0, 5), (B, 5, 10)]
    assert result.bytes_per_stage == (500 + 500, 500 + 10 + 500)
    # Untied, the last stage is 500 B lighter, so a smaller second node suffices.
    assert place(uniform(10, emb=500, head=10), [(A, 1200), (B, 600)]).bytes_per_stage == (1200, 310)
    with pytest.raises(PlacementError):
        place(tied, [(A, 1200), (B, 600)])


def test_headroom_shrinks_each_node() -> None:
    shape = uniform(10)
    assert spans(place(shape, [(A, 1000)])) == [(A, 0, 10)]
    with pytest.raises(PlacementError, match=r"\(after keeping 10% free\): node 2D3KooWa 900 B$"):
        place(shape, [(A, 1000)], headroom=0.1)
    assert place(shape, [(A, 1000), (B, 200)], headroom=0.1).capacity_per_stage == (900, 180)


def test_not_fitting_names_the_need_and_each_node() -> None:
    shape = ModelShape.uniform(
        ModelId("big-model"),
        num_layers=30,
        bytes_per_layer=60_000_000,
        embedding_bytes=0,
        head_bytes=0,
        kv_bytes_per_token=10_000,
        context_length=1000,
    )
    nodes = [(NodeId("12D3KooWXXXXa1b2c3d4"), 900_000_000), (NodeId("12D3KooWYYYYe5f6a7b8"), 700_000_000)]
    with pytest.raises(PlacementError) as caught:
        place(shape, nodes)
    assert str(caught.value) == (
        "model big-model needs 2.10 GB (weights 1.80 GB + KV cache 300.0 MB for 1000 tokens); "
        "available: node a1b2c3d4 900.0 MB, node e5f6a7b8 700.0 MB"
    )


def test_enough_in_total_but_no_split_says_so() -> None:
    shape = ModelShape(ModelId("m"), (100, 900), 0, 0, False, 0, 0)
    with pytest.raises(PlacementError, match="together they have enough, but no contiguous split"):
        place(shape, [(A, 600), (B, 600)])


@pytest.mark.parametrize(
    ("nodes", "wanted", "message"),
    [
        ([], None, "no live nodes"),
        ([(A, 10**6), (B, 10**6)], 3, "asked for 3 nodes but only 2 are live"),
        ([(A, 10**6), (B, 10**6), (C, 10**6)], 3, "asked for 3 nodes but model m has only 2 layers"),
        ([(A, 10**6)], 0, "asked for 0 nodes"),
        ([(A, 150), (B, 150), (C, 150)], 2, "asked for exactly 2 nodes"),
    ],
)
def test_impossible_requests(nodes: list[tuple[NodeId, int]], wanted: int | None, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        place(uniform(2 if wanted != 2 else 4), nodes, nodes_wanted=wanted)


@pytest.mark.parametrize(
    ("nodes", "headroom"),
    [([(A, 10), (A, 20)], 0.0), ([(A, -1)], 0.0), ([(A, 10)], 1.0), ([(A, 10)], -0.1)],
)
def test_malformed_input_is_a_plain_value_error(nodes: list[tuple[NodeId, int]], headroom: float) -> None:
    with pytest.raises(ValueError) as caught:
        place(uniform(2), nodes, headroom=headroom)
    assert not isinstance(caught.value, PlacementError)


def test_a_plan_becomes_an_instance_record() -> None:
    result = place(uniform(), [(A, 2400), (B, 800)])
    record = result.instance(InstanceId("inst-1"))
    assert record == InstanceRecord(
        InstanceId("inst-1"), ModelId("m"), (StageAssignment(A, 0, 23), StageAssignment(B, 23, 30))
    )
    assert result.total_bytes == 3000


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (512, 35_400, 35_400_000, 2_100_000_000)] == [
        "512 B",
        "35.4 kB",
        "35.4 MB",
        "2.10 GB",
    ]


# Properties over random shapes and nodes.

shapes = st.builds(
    ModelShape,
    model=st.just(ModelId("m")),
    layer_bytes=st.lists(st.integers(0, 100), min_size=1, max_size=12).map(tuple),
    embedding_bytes=st.integers(0, 200),
    head_bytes=st.integers(0, 200),
    tied_embeddings=st.booleans(),
    kv_bytes_per_token=st.integers(0, 5),
    context_length=st.integers(0, 10),
)
node_lists = st.lists(
    st.tuples(st.sampled_from([NodeId(f"12D3KooWNode{c}") for c in "ABCDEF"]), st.integers(0, 800)),
    min_size=1,
    max_size=6,
    unique_by=lambda n: n[0],
)


def _outcome(
    shape: ModelShape, nodes: list[tuple[NodeId, int]], headroom: float, wanted: int | None
) -> object:
    try:
        return place(shape, nodes, headroom=headroom, nodes_wanted=wanted)
    except PlacementError as exc:
        return str(exc)


@settings(max_examples=300, deadline=None)
@given(
    shape=shapes,
    nodes=node_lists,
    headroom=st.sampled_from([0.0, 0.25]),
    wanted=st.none() | st.integers(1, 6),
    data=st.data(),
)
def test_placement_properties(
    shape: ModelShape,
    nodes: list[tuple[NodeId, int]],
    headroom: float,
    wanted: int | None,
    data: st.DataObject,
) -> None:
    outcome = _outcome(shape, nodes, headroom, wanted)
    assert _outcome(shape, data.draw(st.permutations(nodes)), headroom, wanted) == outcome
    if not isinstance(outcome, Placement):
        return
    stages = outcome.stages
    assert stages[0].start_layer == 0 and stages[-1].end_layer == shape.num_layers
    assert all(a.end_layer == b.start_layer for a, b in itertools.pairwise(stages))
    assert all(s.end_layer > s.start_layer for s in stages)
    assert len({s.node for s in stages}) == len(stages)
    available = dict(nodes)
    for stage, need, cap in zip(stages, outcome.bytes_per_stage, outcome.capacity_per_stage, strict=True):
        assert need == shape.stage_bytes(stage.start_layer, stage.end_layer)
        assert need <= cap == int(available[stage.node] * (1 - headroom))
    if wanted is not None:
        assert len(stages) == wanted
    elif max(int(a * (1 - headroom)) for _, a in nodes) >= shape.total_bytes:
        assert len(stages) == 1


@settings(max_examples=300, deadline=None)
@given(shape=shapes, caps=st.lists(st.integers(0, 1000), min_size=1, max_size=4))
def test_nearest_fit_matches_brute_force(shape: ModelShape, caps: list[int]) -> None:
    """The split found is one that fits, when any does, with the least shift from the proportional one."""
    layers, count = shape.num_layers, len(caps)
    if count > layers:
        return
    prefix = placement_module.prefix_sums(shape)
    target = placement_module._proportional(layers, caps)

    def fits(bounds: list[int]) -> bool:
        return placement_module._fits(shape, prefix, bounds, caps)

    def shift(bounds: list[int]) -> int:
        return sum(abs(b - t) for b, t in zip(bounds, target, strict=True))

    feasible = [
        [0, *inner, layers]
        for inner in itertools.combinations(range(1, layers), count - 1)
        if fits([0, *inner, layers])
    ]
    found = placement_module._nearest_fit(shape, prefix, target, caps)
    if not feasible:
        assert found is None
        return
    assert found is not None and fits(found)
    assert shift(found) == min(shift(b) for b in feasible)
    if fits(target):
        assert found == target


# Rule 5: nodes that hold the model's files are preferred, never at the cost of more nodes.


@pytest.mark.parametrize(
    ("name", "nodes", "held", "wanted", "expected"),
    [
        ("a holder that fits keeps the model", [(A, 9000), (B, 3000)], {B: 10}, None, [(B, 0, 30)]),
        ("a holder too small: the largest", [(A, 9000), (B, 2000)], {B: 10}, None, [(A, 0, 30)]),
        ("equal memory: the holder, not the smallest id", [(A, 3000), (B, 3000)], {B: 1}, None, [(B, 0, 30)]),
        (
            "a split reuses the holder; the stages still go by memory",
            [(A, 2000), (B, 2000), (C, 1600)],
            {C: 5},
            2,
            [(A, 0, 17), (C, 17, 30)],
        ),
        (
            "more held bytes first",
            [(A, 1600), (B, 1600), (C, 1600)],
            {A: 1, C: 7, B: 3},
            2,
            [(B, 0, 15), (C, 15, 30)],
        ),
        ("holding nothing is no holding", [(A, 9000), (B, 3000)], {B: 0}, None, [(A, 0, 30)]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_holders_are_preferred(
    name: str,
    nodes: list[tuple[NodeId, int]],
    held: dict[NodeId, int],
    wanted: int | None,
    expected: list[tuple[str, int, int]],
) -> None:
    assert spans(place(uniform(), nodes, nodes_wanted=wanted, held=held)) == expected


@settings(max_examples=200, deadline=None)
@given(shape=shapes, nodes=node_lists, data=st.data())
def test_holdings_never_cost_a_node_more(
    shape: ModelShape, nodes: list[tuple[NodeId, int]], data: st.DataObject
) -> None:
    held = {node: data.draw(st.integers(0, 3)) for node, _ in nodes}
    plain = _outcome(shape, nodes, 0.0, None)
    try:
        preferring: object = place(shape, nodes, held=held)
    except PlacementError as exc:
        preferring = str(exc)
    assert isinstance(preferring, Placement) == isinstance(plain, Placement)
    if isinstance(plain, Placement) and isinstance(preferring, Placement):
        assert len(preferring.stages) == len(plain.stages)


def test_an_unsplittable_model_goes_on_one_node_or_is_refused_with_why() -> None:
    shape = dataclasses.replace(uniform(4), unsplittable="its layers take per-layer inputs")
    alone = place(shape, [(A, 500), (B, 300)])
    assert [(s.node, s.start_layer, s.end_layer) for s in alone.stages] == [(A, 0, 4)]
    with pytest.raises(PlacementError, match="cannot be split into stages: its layers take per-layer inputs"):
        place(shape, [(A, 500), (B, 300)], nodes_wanted=2)
    # Two nodes would hold it split; one cannot: refused, saying why it was not split.
    with pytest.raises(
        PlacementError, match=r"must fit one node: it cannot be split into stages \(its layers"
    ):
        place(shape, [(A, 300), (B, 300)])
    assert len(place(uniform(4), [(A, 300), (B, 300)]).stages) == 2
