"""`/v1/instances`: place, list, preview and delete model instances (forwarded to the leader).

`{"model", "replicas": N}` keeps N instances of the model on disjoint nodes: the leader places the
missing ones, as many as fit (201 when it placed any; 200 when none were missing or no more fit;
422 when not even one fits). The answer is the first new instance (else the first running one),
with every replica of the model in `replicas` and the number asked in `replicas_requested`."""

from __future__ import annotations

from typing import Any, assert_never

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend
from api.errors import ApiError, from_validation, parse_body
from api.surface import read_body
from protocol.cluster_view import InstanceView
from protocol.control_wire import (
    Deleted,
    DeleteOutcome,
    Exists,
    Invalid,
    NotFound,
    Placed,
    PlaceOutcome,
    Unavailable,
)
from protocol.placement import MAX_REPLICAS
from protocol.sharding import ShardingChoice

MAX_PLACE_BODY_BYTES = 64 * 1024
"""A placement request is a model reference and two counts: well under 1 KiB."""


class PlaceBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=512)
    nodes: int | None = Field(default=None, ge=1, le=256)
    replicas: StrictInt | None = Field(default=None, ge=1, le=MAX_REPLICAS)
    """Instances of the model to keep, on disjoint nodes (an integer: "2", 2.0 or true are refused)."""
    sharding: ShardingChoice = "pipeline"
    """"pipeline" (layers over the nodes), "tensor" (a slice of every layer on each node) or "auto"
    (the leader picks: `protocol.auto_sharding`)."""


def _object(view: InstanceView) -> dict[str, Any]:
    return {"object": "instance", **view.model_dump(mode="json")}


def _instance(outcome: Placed | Exists | Deleted, status: int) -> Response:
    """The instance; for a `replicas` request, also every replica of the model and the count asked."""
    body = _object(outcome.instance)
    if isinstance(outcome, Placed) and outcome.stage_bytes:
        body["stage_bytes"] = list(outcome.stage_bytes)
    if isinstance(outcome, Placed) and outcome.sharding_reason:
        body["sharding_reason"] = outcome.sharding_reason
    if not isinstance(outcome, Deleted) and outcome.requested is not None:
        body["replicas"] = [_object(view) for view in outcome.replicas]
        body["replicas_requested"] = outcome.requested
    return JSONResponse(body, status_code=status)


def outcome_response(outcome: PlaceOutcome | DeleteOutcome) -> Response:
    """The leader's outcome as HTTP: the instance (201 when just written), or the error it carries.

    The one place where control outcomes get HTTP statuses; `Unavailable` (no leader yet, leader
    unreachable or changed while answering) is a 503: worth retrying.
    """
    match outcome:
        case Placed():
            return _instance(outcome, 200 if outcome.preview else 201)
        case Exists() | Deleted():
            return _instance(outcome, 200)
        case NotFound(kind="instance"):
            raise ApiError(404, outcome.reason, param="instance_id", code="instance_not_found")
        case NotFound():
            raise ApiError(404, outcome.reason, param="model", code="model_not_found")
        case Invalid(kind="does_not_fit"):
            raise ApiError(422, outcome.reason, param="model", code="insufficient_memory")
        case Invalid(kind="unsupported"):
            raise ApiError(400, outcome.reason, param="sharding", code="unsupported_sharding")
        case Invalid():
            raise ApiError(400, outcome.reason, param="model")
        case Unavailable():
            raise ApiError(503, outcome.reason, code="leader_unavailable")
        case _:
            assert_never(outcome)


class InstanceRoutes:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def routes(self) -> list[Route]:
        return [
            Route("/v1/instances", self.list_instances, methods=["GET"]),
            Route("/v1/instances", self.create, methods=["POST"]),
            Route("/v1/instances/preview", self.preview, methods=["GET"]),
            Route("/v1/instances/{instance_id}", self.delete, methods=["DELETE"]),
        ]

    async def list_instances(self, request: Request) -> Response:
        data = [_object(view) for view in self._backend.instances()]
        return JSONResponse({"object": "list", "data": data})

    async def create(self, request: Request) -> Response:
        body = parse_body(PlaceBody, await read_body(request, MAX_PLACE_BODY_BYTES))
        return await self._place(body, preview=False)

    async def preview(self, request: Request) -> Response:
        try:  # query values are text: "2" is the number 2 here
            body = PlaceBody.model_validate_strings(dict(request.query_params))
        except ValidationError as exc:
            raise from_validation(exc) from None
        return await self._place(body, preview=True)

    async def _place(self, body: PlaceBody, *, preview: bool) -> Response:
        outcome = await self._backend.place_instance(
            body.model, body.nodes, preview=preview, replicas=body.replicas, sharding=body.sharding
        )
        return outcome_response(outcome)

    async def delete(self, request: Request) -> Response:
        return outcome_response(await self._backend.delete_instance(request.path_params["instance_id"]))
