"""The one error shape every failure takes, and the handlers that produce it.

Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`. Bad input from the
client is a 4xx of type `invalid_request_error` that names the offending field in `param`; a 5xx of
type `server_error` is only ever a fault on our side (an unexpected exception, which is logged, or a
runner that broke off). A model whose request queue is full answers 429 of type `rate_limit_error`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from protocol.events import GenerationError

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

# Codes for HTTP-level failures Starlette detects before a handler runs.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}

# pydantic error type -> OpenAI-style error code; anything not listed is "invalid_value".
_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "model_type": "invalid_type",
    "model_attributes_type": "invalid_type",
    "string_type": "invalid_type",
    "int_type": "invalid_type",
    "float_type": "invalid_type",
    "bool_type": "invalid_type",
    "list_type": "invalid_type",
    "dict_type": "invalid_type",
    "int_from_float": "invalid_type",
    "content_type": "invalid_type",
    "unsupported_value": "unsupported_value",
}


class ApiError(Exception):
    """A request we answer with an error body; raise it from a handler, the app turns it into JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def param_path(loc: Sequence[int | str]) -> str | None:
    """A pydantic location as a JSON path: `("messages", 0, "role")` -> `"messages[0].role"`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or None


def from_validation(exc: ValidationError) -> ApiError:
    """The first problem pydantic found in a request body, as a 400 naming the field."""
    error: ErrorDetails = exc.errors(include_url=False)[0]
    param = param_path(error["loc"])
    if error["type"] == "json_invalid":
        message = f"We could not parse the JSON body of your request: {error['msg']}"
    elif error["type"] == "model_type" and param is None:
        message = "The request body must be a JSON object"
    elif error["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    else:
        message = f"Invalid value for '{param}': {error['msg']}"
    return ApiError(400, message, param=param, code=_VALIDATION_CODES.get(error["type"], "invalid_value"))


Body = TypeVar("Body", bound=BaseModel)


def parse_body(kind: type[Body], body: bytes) -> Body:
    """A JSON request body as `kind`; any problem becomes a 400 `ApiError` naming the field."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


def from_generation_error(event: GenerationError) -> ApiError:
    """A backend error that came before any output: 400 for a bad request, 429 when the model's queue
    is full, 503 for a broken runner."""
    if event.error_kind == "overloaded":
        return ApiError(429, event.message, param=event.param, code=event.code, type=RATE_LIMIT)
    status = 400 if event.error_kind == "invalid_request" else 503
    return ApiError(status, event.message, param=event.param, code=event.code)


def error_type(event: GenerationError) -> str:
    """The OpenAI error `type` of a backend error, e.g. inside a stream that already started."""
    return {"invalid_request": INVALID_REQUEST, "overloaded": RATE_LIMIT}.get(event.error_kind, SERVER_ERROR)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail or HTTPStatus(exc.status_code).phrase
    code = _HTTP_CODES.get(exc.status_code)
    return ApiError(exc.status_code, message, code=code).response(headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up while sending its body: nobody will read this, and it is no fault of ours."""
    return Response(status_code=499)


def unexpected(request: Request, exc: Exception) -> ApiError:
    """A fault of ours, logged with its traceback; the client learns only that it happened."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "The server had an error while processing your request")


async def _unexpected(request: Request, exc: Exception) -> Response:
    return unexpected(request, exc).response()


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    ClientDisconnect: _client_gone,
    Exception: _unexpected,
}
"""For `Starlette(exception_handlers=...)`; `Exception` goes to the outermost, 500, handler."""
