"""`/v1/instances`: place, list, preview and delete model instances (forwarded to the leader)."""

from __future__ import annotations

from typing import Any, assert_never

from pydantic import BaseModel, ConfigDict, Field, ValidationError
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

MAX_PLACE_BODY_BYTES = 64 * 1024
"""A placement request is a model reference and a node count: well under 1 KiB."""


class PlaceBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=512)
    nodes: int | None = Field(default=None, ge=1, le=256)


def _instance(view: InstanceView, status: int, stage_bytes: tuple[int, ...] = ()) -> Response:
    body: dict[str, Any] = {"object": "instance", **view.model_dump(mode="json")}
    if stage_bytes:
        body["stage_bytes"] = list(stage_bytes)
    return JSONResponse(body, status_code=status)


def outcome_response(outcome: PlaceOutcome | DeleteOutcome) -> Response:
    """The leader's outcome as HTTP: the instance (201 when just written), or the error it carries.

    The one place where control outcomes get HTTP statuses; `Unavailable` (no leader yet, leader
    unreachable or changed while answering) is a 503: worth retrying.
    """
    match outcome:
        case Placed():
            return _instance(outcome.instance, 200 if outcome.preview else 201, outcome.stage_bytes)
        case Exists() | Deleted():
            return _instance(outcome.instance, 200)
        case NotFound(kind="instance"):
            raise ApiError(404, outcome.reason, param="instance_id", code="instance_not_found")
        case NotFound():
            raise ApiError(404, outcome.reason, param="model", code="model_not_found")
        case Invalid(kind="does_not_fit"):
            raise ApiError(422, outcome.reason, param="model", code="insufficient_memory")
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
        data = [{"object": "instance", **view.model_dump(mode="json")} for view in self._backend.instances()]
        return JSONResponse({"object": "list", "data": data})

    async def create(self, request: Request) -> Response:
        body = parse_body(PlaceBody, await read_body(request, MAX_PLACE_BODY_BYTES))
        return outcome_response(await self._backend.place_instance(body.model, body.nodes, preview=False))

    async def preview(self, request: Request) -> Response:
        try:
            body = PlaceBody.model_validate(dict(request.query_params))
        except ValidationError as exc:
            raise from_validation(exc) from None
        return outcome_response(await self._backend.place_instance(body.model, body.nodes, preview=True))

    async def delete(self, request: Request) -> Response:
        return outcome_response(await self._backend.delete_instance(request.path_params["instance_id"]))
