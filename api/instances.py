"""`/v1/instances`: place, list, preview and delete model instances (forwarded to the leader)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend
from api.errors import ApiError, from_validation
from protocol.control_wire import ControlAnswer


class PlaceBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=512)
    nodes: int | None = Field(default=None, ge=1, le=256)


_CODES = {404: "model_not_found", 422: "insufficient_memory"}


def _answer(answer: ControlAnswer) -> Response:
    """A control answer as HTTP: the instance (and its bytes per stage), or the error it carries."""
    if answer.instance is not None and answer.status < 300:
        body: dict[str, Any] = {"object": "instance", **answer.instance.model_dump(mode="json")}
        if answer.stage_bytes:
            body["stage_bytes"] = list(answer.stage_bytes)
        return JSONResponse(body, status_code=answer.status)
    message = answer.error or "the leader could not answer"
    if 400 <= answer.status < 500 and answer.status != 409:
        raise ApiError(answer.status, message, param="model", code=_CODES.get(answer.status))
    # No leader yet, leader unreachable or changed while answering: worth retrying.
    raise ApiError(503, message, code="leader_unavailable")


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
        try:
            body = PlaceBody.model_validate_json(await request.body())
        except ValidationError as exc:
            raise from_validation(exc) from None
        return _answer(await self._backend.place_instance(body.model, body.nodes, preview=False))

    async def preview(self, request: Request) -> Response:
        try:
            body = PlaceBody.model_validate(dict(request.query_params))
        except ValidationError as exc:
            raise from_validation(exc) from None
        return _answer(await self._backend.place_instance(body.model, body.nodes, preview=True))

    async def delete(self, request: Request) -> Response:
        instance_id = request.path_params["instance_id"]
        answer = await self._backend.delete_instance(instance_id)
        if answer.status == 404:
            raise ApiError(
                404, answer.error or "no such instance", param="instance_id", code="instance_not_found"
            )
        return _answer(answer)
