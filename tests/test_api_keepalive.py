"""The SSE keep-alive of a streamed completion, on trio's mock clock: one comment per quiet interval.

`EventStream` runs as a plain ASGI app in this process over a backend that sends scripted events at
scripted (virtual) times; the test reads what went out and when. The real-node check that a quiet
prefill carries keep-alives is in tests/test_api_stream_shape.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NoReturn, cast

import pytest
import trio
import trio.testing

from api import sse
from api.backend import Backend
from api.completions import ChatEncoder
from api.streaming import EventStream
from api.surface import OPENAI
from protocol.chat import ChatMessage, GenerateRequest
from protocol.events import ChunkEvent, Finish, TextDelta, Usage
from protocol.ids import ModelId, RequestId

REQUEST = GenerateRequest(
    request_id=RequestId("chatcmpl-test"),
    model=ModelId("m"),
    messages=(ChatMessage(role="user", content="hi"),),
)


class ScriptedBackend:
    """Sends `TextDelta`s after the given pauses (seconds on trio's clock), then a `Finish`."""

    def __init__(self, pauses: list[float]) -> None:
        self.pauses = pauses

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[AsyncIterator[ChunkEvent]]:
        async def events() -> AsyncIterator[ChunkEvent]:
            for i, pause in enumerate(self.pauses):
                await trio.sleep(pause)
                yield TextDelta(text=f"t{i}")
            yield Finish(reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=len(self.pauses)))

        yield events()


def stream(pauses: list[float], keepalive_s: float) -> list[tuple[float, bytes]]:
    """Every body frame the response sent, with the (virtual) time it went out."""
    sent: list[tuple[float, bytes]] = []

    async def receive() -> NoReturn:  # the client never hangs up
        await trio.sleep_forever()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            sent.append((trio.current_time(), message["body"]))

    async def main() -> None:
        encoder = ChatEncoder(REQUEST.request_id, REQUEST.model, 0, include_usage=False)
        backend = cast(Backend, ScriptedBackend(pauses))
        response = EventStream(backend, REQUEST, encoder, surface=OPENAI, keepalive_s=keepalive_s)
        await response({"type": "http"}, receive, send)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return sent


def keep_alives(sent: list[tuple[float, bytes]]) -> list[float]:
    return [at for at, frame in sent if frame == sse.KEEP_ALIVE]


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
    sent = stream(pauses, keepalive_s)
    assert keep_alives(sent) == pytest.approx(expected)
    assert sent[-1][1].endswith(sse.DONE)
    assert len(sent) == 1 + len(pauses) + 1 + len(expected)  # role, tokens, finish + [DONE], comments


def test_nothing_goes_out_before_the_first_event() -> None:
    """The status waits for the first event (an error there is a plain JSON answer), so a slow start
    sends no keep-alive: the role chunk and the first token leave together, at 30 s."""
    sent = stream([30.0, 1.0], keepalive_s=10.0)
    assert keep_alives(sent) == []
    assert [at for at, _ in sent[:2]] == [30.0, 30.0]
