"""Typed outcomes on the control wire, and the one place that turns them into HTTP (`api/instances.py`)."""

from __future__ import annotations

import json

import cbor2
import pytest

from api.errors import ApiError
from api.instances import outcome_response
from protocol.cluster_view import InstanceView, StageView
from protocol.control_wire import (
    ControlWireError,
    Deleted,
    DeleteOutcome,
    Exists,
    Invalid,
    NotFound,
    Placed,
    PlaceOutcome,
    Unavailable,
    decode_control,
    encode_control,
)

VIEW = InstanceView(
    id="tiny-abc123", model="tiny", stages=(StageView(node_id="n1", start_layer=0, end_layer=2),)
)
OUTCOMES: list[PlaceOutcome | DeleteOutcome] = [
    Placed(instance=VIEW, stage_bytes=(123,)),
    Placed(instance=VIEW, stage_bytes=(123,), preview=True),
    Exists(instance=VIEW),
    Deleted(instance=VIEW),
    NotFound(kind="model", reason="model 'x' not found"),
    NotFound(kind="instance", reason="no instance 'x'"),
    Invalid(kind="does_not_fit", reason="needs 2 GiB, the largest node has 1 GiB"),
    Invalid(kind="malformed", reason="undecodable control message"),
    Unavailable(kind="no_leader", reason="no leader yet"),
    Unavailable(kind="not_leader", reason="this node is not the leader"),
    Unavailable(kind="no_answer", reason="the leader did not answer"),
]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: f"{o.type}-{getattr(o, 'kind', '')}")
def test_every_outcome_crosses_the_wire_unchanged(outcome: PlaceOutcome | DeleteOutcome) -> None:
    assert decode_control(encode_control(outcome)) == outcome


@pytest.mark.parametrize(
    "body",
    [
        {"type": "answer", "status": 201},  # 1.0.0's HTTP-coded answer: not on this wire
        {"type": "not_found", "kind": "teapot", "reason": "?"},
        {"type": "invalid", "reason": "no kind"},
        {"type": "placed", "instance": VIEW.model_dump(mode="json"), "status": 201},
    ],
)
def test_an_answer_that_is_no_outcome_is_refused(body: dict[str, object]) -> None:
    with pytest.raises(ControlWireError):
        decode_control(cbor2.dumps(body))


@pytest.mark.parametrize(
    ("outcome", "status", "code", "param"),
    [
        (OUTCOMES[0], 201, None, None),
        (OUTCOMES[1], 200, None, None),
        (OUTCOMES[2], 200, None, None),
        (OUTCOMES[3], 200, None, None),
        (OUTCOMES[4], 404, "model_not_found", "model"),
        (OUTCOMES[5], 404, "instance_not_found", "instance_id"),
        (OUTCOMES[6], 422, "insufficient_memory", "model"),
        (OUTCOMES[7], 400, None, "model"),
        (OUTCOMES[8], 503, "leader_unavailable", None),
        (OUTCOMES[9], 503, "leader_unavailable", None),
        (OUTCOMES[10], 503, "leader_unavailable", None),
    ],
)
def test_http_statuses_are_decided_in_the_api_alone(
    outcome: PlaceOutcome | DeleteOutcome, status: int, code: str | None, param: str | None
) -> None:
    try:
        response = outcome_response(outcome)
    except ApiError as error:
        assert (error.status, error.code, error.param) == (status, code, param)
        assert error.message == getattr(outcome, "reason", None)
        return
    assert (response.status_code, code, param) == (status, None, None)
    body = json.loads(bytes(response.body))
    assert body["object"] == "instance" and body["id"] == VIEW.id
    assert body.get("stage_bytes") == ([123] if isinstance(outcome, Placed) else None)
