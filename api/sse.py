"""Server-sent-events framing, and the watcher that notices a client has gone.

Frames are bytes ready for the wire: `data: <json>\\n\\n` for events, `: <text>\\n\\n` for comments
(which clients ignore, and which keep proxies and idle timers from closing a quiet stream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from starlette.types import Receive

from protocol.events import PrefillProgress

HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
MEDIA_TYPE = "text/event-stream"

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def data(value: Any) -> bytes:
    """One SSE event whose data is `value` as compact JSON."""
    return f"data: {compact_json(value)}\n\n".encode()


def comment(text: str) -> bytes:
    """One SSE comment line; `text` must not contain a newline."""
    assert "\n" not in text and "\r" not in text, text
    return f": {text}\n\n".encode()


def named(name: str, value: Any) -> bytes:
    """One named SSE event (Anthropic's and the Responses API's frames), its data compact JSON."""
    return f"event: {name}\n".encode() + data(value)


def prefill_progress(event: PrefillProgress) -> bytes:
    """`: prefill_progress {"processed_tokens":N,"total_tokens":M}`: prefill progress on every SSE
    surface, as a comment, so that each surface's official client skips it."""
    progress = {"processed_tokens": event.processed_tokens, "total_tokens": event.total_tokens}
    return comment(f"prefill_progress {compact_json(progress)}")


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Run the body until it ends or the client disconnects, whichever comes first.

    A disconnect cancels the body and the block ends without an exception: the caller tells the two
    apart by whether the body got to its end. Exceptions from the body come out in an ExceptionGroup.
    Use it only once the request body was read: it consumes (and drops) what `receive` yields.
    """
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
        yield
        nursery.cancel_scope.cancel()
