"""`python -m tests.slow_node run ...`: `shoal run` whose model-file route sends slowly (a slow link),
so a test sees a transfer in progress rather than only its end: 256 KiB per `SHOAL_TEST_FILE_PAUSE_S`
(default 0.05 s, ~5 MB/s). Each response, finished or cut, ends with a line on stdout,
`served <requester> <url path> from <range start> <body bytes>`, so a test counts the bytes a node
served. Everything else is the real node.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import trio

import api.files
from node.cli.main import main

CHUNK_BYTES = 256 * 1024


class _SlowFileResponse(api.files._ChunkedFileResponse):
    chunk_size = CHUNK_BYTES

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        pause = float(os.environ.get("SHOAL_TEST_FILE_PAUSE_S", "0.05"))

        sent = 0

        async def slow_send(message: Any) -> None:
            nonlocal sent
            await send(message)
            if message["type"] == "http.response.body" and message.get("body"):
                sent += len(message["body"])
                await trio.sleep(pause)

        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        start = headers.get("range", "bytes=0-").removeprefix("bytes=").split("-")[0] or "0"
        try:
            await super().__call__(scope, receive, slow_send)
        finally:
            print(
                f"served {headers.get('x-shoal-node', '-')} {scope['path']} from {start} {sent}", flush=True
            )


if __name__ == "__main__":
    api.files._ChunkedFileResponse = _SlowFileResponse  # type: ignore[misc]  # looked up per request
    sys.exit(main())
