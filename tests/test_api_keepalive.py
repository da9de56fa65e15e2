"""The SSE keep-alive of a streamed completion, on trio's mock clock: one comment per quiet interval,
and the status of a stream whose generation is slow to begin (a model still loading).

`EventStream` runs as a plain ASGI app in this process over a backend that sends scripted events at
scripted (virtual) times; the test reads what went out and when. The real-node checks are in
tests/test_api_stream_shape.py (a quiet prefill carries keep-alives) and tests/test_loading_wait.py
(a request for a loading instance waits for it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import trio
import trio.testing

from api import sse
from api.backend import Backend
from api.completions import ChatEncoder
from api.streaming import EventStream
from api.surface import OPENAI
from protocol.chat import ChatMessage, GenerateRequest
from protocol.events import ChunkEvent, Finish, GenerationError, TextDelta, Usage
from protocol.ids import ModelId, RequestId

REQUEST = GenerateRequest(
    request_id=RequestId("chatcmpl-test"),
    model=ModelId("m"),
    messages=(ChatMessage(role="user", content="hi"),),
)
LOADING = GenerationError(error_kind="server_error", message="still loading", code="model_loading")


class ScriptedBackend:
    """Takes `enter_s` to enter (a model loading), then sends `TextDelta`s after the given pauses
    (seconds on trio's clock) and a `Finish`, or `error` after the last pause instead."""

    def __init__(self, pauses: list[float], *, enter_s: float = 0.0, error: GenerationError | None = None):
        self.pauses = pauses
        self.enter_s = enter_s
        self.error = error
        self.left_at: float | None = None
        """When the stream's context was left (None: never entered to its end)."""

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        try:
            await trio.sleep(self.enter_s)

            async def events() -> AsyncIterator[ChunkEvent]:
                for i, pause in enumerate(self.pauses):
                    await trio.sleep(pause)
                    if self.error is not None and i == len(self.pauses) - 1:
                        yield self.error
                        return
                    yield TextDelta(text=f"t{i}")
                yield Finish(reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=len(self.pauses)))

            yield events()
        finally:
            self.left_at = trio.current_time()


@dataclass
class Sent:
    status: int | None = None
    frames: list[tuple[float, bytes]] = field(default_factory=list)
    """Every body frame the response sent, with the (virtual) time it went out."""

    @property
    def keep_alives(self) -> list[float]:
        return [at for at, frame in self.frames if frame == sse.KEEP_ALIVE]

    @property
    def body(self) -> bytes:
        return b"".join(frame for _, frame in self.frames)


def respond(backend: ScriptedBackend, keepalive_s: float, *, hang_up_at: float | None = None) -> Sent:
    """Run the response over `backend`; the client hangs up at `hang_up_at`, if given."""
    sent = Sent()

    async def receive() -> dict[str, str]:
        if hang_up_at is None:
            await trio.sleep_forever()
        await trio.sleep_until(hang_up_at)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            sent.status = message["status"]
        elif message["type"] == "http.response.body" and message["body"]:
            sent.frames.append((trio.current_time(), message["body"]))

    async def main() -> None:
        encoder = ChatEncoder(REQUEST.request_id, REQUEST.model, 0, include_usage=False)
        response = EventStream(
            cast(Backend, backend), REQUEST, encoder, surface=OPENAI, keepalive_s=keepalive_s
        )
        await response({"type": "http"}, receive, send)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return sent


@pytest.mark.parametrize(
    ("pauses", "keepalive_s", "expected"),
    [
        # Quiet for 25 s after the first token: a comment at 10 s and at 20 s after it, none after.
        ([1.0, 25.0, 3.0], 10.0, [11.0, 21.0]),
        # Every event restarts the interval: events 9 s apart never let one go out.
        ([1.0, 9.0, 9.0, 9.0, 9.0], 10.0, []),
        # Just over one interval of quiet is one comment.
        ([0.0, 10.5], 10.0, [10.0]),
        # A short interval over a long quiet: one per interval, never a burst.
        ([0.0, 0.9], 0.25, [0.25, 0.5, 0.75]),
    ],
    ids=["long-quiet", "reset-by-events", "just-over-one-interval", "short-interval"],
)
def test_one_keep_alive_per_quiet_interval(
    pauses: list[float], keepalive_s: float, expected: list[float]
) -> None:
    sent = respond(ScriptedBackend(pauses), keepalive_s)
    assert sent.keep_alives == pytest.approx(expected)
    assert sent.frames[-1][1].endswith(sse.DONE)
    assert len(sent.frames) == 1 + len(pauses) + 1 + len(expected)  # role, tokens, finish + [DONE], comments


@pytest.mark.parametrize("enter_s", [0.0, 24.0], ids=["slow-first-event", "slow-to-enter"])
def test_a_slow_start_commits_the_stream_after_one_interval(enter_s: float) -> None:
    """No first event within 10 s: the 200 and the role chunk go out then, with a keep-alive, and one
    keep-alive per quiet interval after, until the first token at 25 s. A backend that is slow to
    enter (a model loading) is treated the same as one slow to send its first event."""
    sent = respond(ScriptedBackend([25.0 - enter_s, 1.0], enter_s=enter_s), keepalive_s=10.0)
    assert sent.status == 200
    role, first_keep_alive = sent.frames[0], sent.frames[1]
    assert role[0] == 10.0 and b'"role":"assistant"' in role[1]
    assert first_keep_alive == (10.0, sse.KEEP_ALIVE)
    assert sent.keep_alives == [10.0, 20.0]
    assert [at for at, frame in sent.frames if b'"content":"t0"' in frame] == [25.0]
    assert sent.frames[-1][1].endswith(sse.DONE)


def test_an_error_before_the_first_interval_gets_its_status() -> None:
    """An error within the first interval (here at 4 s) is a plain JSON answer with its status."""
    sent = respond(ScriptedBackend([4.0], error=LOADING), keepalive_s=10.0)
    assert sent.status == 503
    assert json.loads(sent.body)["error"]["code"] == "model_loading"
    assert sent.keep_alives == []


def test_an_error_after_the_commit_is_an_in_stream_error_event() -> None:
    """The loading bound passed at 25 s, after the stream was committed at 10 s: 200, then the
    surface's error event and [DONE]."""
    sent = respond(ScriptedBackend([25.0], error=LOADING), keepalive_s=10.0)
    assert sent.status == 200
    assert sent.keep_alives == [10.0, 20.0]
    error_at, error_frame = sent.frames[-1]
    assert error_at == 25.0 and error_frame.endswith(sse.DONE)
    data = json.loads(error_frame.removesuffix(sse.DONE).decode().removeprefix("data: "))
    assert data["error"]["code"] == "model_loading"


def test_a_client_hanging_up_while_waiting_leaves_the_backend_at_once() -> None:
    """The client leaves at 15 s while the backend is still entering (loading until 100 s): its
    context is left at 15 s, not at 100 s."""
    backend = ScriptedBackend([1.0], enter_s=100.0)
    sent = respond(backend, keepalive_s=10.0, hang_up_at=15.0)
    assert sent.status == 200 and sent.keep_alives == [10.0]
    assert backend.left_at == 15.0
