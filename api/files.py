"""`GET /v1/files/{manifest_id}/{path}`: a model file for another member of the cluster, with `Range`.

Nodes fetch the models they need from the nodes that hold them (`node/files/`); this is the
serving side. Only cluster members get bytes: the `FileSource` checks each request's signature
(401 without credentials, 403 with wrong or stale ones, in OpenAI's error shape) before anything
is looked up, so a stranger learns nothing, not even whether a file exists. A file the node does
not hold (or no longer holds as described) is a 404.

Starlette's `FileResponse` answers `Range: bytes=a-b` with a 206 and `Content-Range` (416 past
the end), `HEAD` with the headers alone; a fetcher resumes a cut file from its length with it.
The route reads with 1 MiB chunks instead of Starlette's 64 KiB: each chunk is one thread hop to
read the file, and at 64 KiB those hops, not the network, bound a loopback transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Protocol

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from api.errors import ApiError
from protocol.model_files import FILES_PREFIX

AuthVerdict = Literal["ok", "unauthenticated", "forbidden"]


class FileSource(Protocol):
    """What the node provides to serve files (node/files/server.py implements it). Both calls are
    sync and cheap (one HMAC; a dict lookup and a stat), so they run on the event loop."""

    def authorize(self, headers: Mapping[str, str], method: str, path: str) -> AuthVerdict:
        """Whether the request for URL path `path` comes from a cluster member, from its headers
        (Starlette's case-insensitive `Headers`, or a mapping with lowercase names)."""
        ...

    def locate(self, manifest_id: str, path: str) -> Path | None:
        """The local file that is `path` of the model with this manifest id, or None."""
        ...


class _ChunkedFileResponse(FileResponse):
    chunk_size = 1 << 20


class FileRoutes:
    def __init__(self, source: FileSource) -> None:
        self._source = source

    def routes(self) -> list[Route]:
        return [Route(FILES_PREFIX + "/{manifest_id}/{path:path}", self.file, methods=["GET", "HEAD"])]

    async def file(self, request: Request) -> Response:
        verdict = self._source.authorize(request.headers, request.method, request.scope["path"])
        if verdict == "unauthenticated":
            raise ApiError(
                401,
                "Model files are served to cluster members only: sign the request",
                code="unauthenticated",
            )
        if verdict != "ok":
            raise ApiError(
                403,
                "The request's signature is wrong or stale (a different cluster secret, or clocks more "
                "than a few minutes apart)",
                code="forbidden",
            )
        manifest_id, path = request.path_params["manifest_id"], request.path_params["path"]
        found = self._source.locate(manifest_id, path)
        if found is None:
            raise ApiError(404, f"This node does not hold {path!r} of model {manifest_id}", code="not_found")
        return _ChunkedFileResponse(found, media_type="application/octet-stream")
