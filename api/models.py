"""`GET /v1/models`, `GET /v1/models/{model_id}` and `GET /health`: read-only views of the backend."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.backend import Backend, ModelCard
from api.errors import ApiError
from protocol.chat import SamplingParams
from protocol.sampling import resolve_sampling


def model_json(card: ModelCard) -> dict[str, Any]:
    """OpenAI's model object, plus `context_length` once the model is loaded and `sampling_defaults`
    where the node can tell them: what a request that sets no sampling field runs with (the model's
    generation_config.json over the server's defaults), and which of them the model set."""
    shape: dict[str, Any] = {
        "id": card.id,
        "object": "model",
        "created": card.created,
        "owned_by": card.owned_by,
    }
    if card.context_length is not None:
        shape["context_length"] = card.context_length
    if card.sampling_defaults is not None:
        effective = resolve_sampling(SamplingParams(), card.sampling_defaults)
        shape["sampling_defaults"] = {
            **effective.model_dump(exclude={"seed"}),
            "from_model": list(card.sampling_defaults.given()),
        }
    return shape


class ModelRoutes:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models),
            # Model ids look like "org/name": the path convertor keeps the slash.
            Route("/v1/models/{model_id:path}", self.get_model),
            Route("/health", self.health),
        ]

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_json(card) for card in self._backend.models()]})

    async def get_model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        for card in self._backend.models():
            if card.id == model_id:
                return JSONResponse(model_json(card))
        raise ApiError(
            404,
            f"The model '{model_id}' does not exist or is not served here",
            param="model",
            code="model_not_found",
        )

    async def health(self, request: Request) -> Response:
        """The backend's picture of its runners; `status` is "ok" unless the backend says otherwise."""
        return JSONResponse({"status": "ok", **self._backend.health().model_dump(mode="json")})
