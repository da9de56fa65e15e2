"""A Responses answer on the wire: SSE frames (`ResponsesEncoder`) or one object (`ResponsesCollector`).

Sans-I/O, both over the same `ResponseAssembler`. A stream frame is OpenAI's: `event: <type>` and
`data: <json>` whose `sequence_number` counts from 0; no `[DONE]` (the Responses API sends none).
Prefill progress and keep-alives are SSE comments, which SDKs skip.
"""

from __future__ import annotations

from typing import Any

from api import sse
from api.errors import ApiError, from_generation_error
from api.responses_output import Json, ResponseAssembler, surface_param
from api.surface import Surface
from protocol.events import UNFINISHED, ChunkEvent, Finish, GenerationError, PrefillProgress


def _error_body(error: ApiError) -> Any:
    """OpenAI's error shape, with a backend error's param in this surface's words."""
    body = error.body()
    body["error"]["param"] = surface_param(error.param)
    return body


RESPONSES = Surface("openai-responses", error_body=_error_body)


class ResponsesEncoder:
    """One streamed response: `start()`, then `feed()` each event until `done`."""

    def __init__(self, assembler: ResponseAssembler) -> None:
        self._assembler = assembler
        self._sequence = 0
        self.done = False
        """True once the terminal event's frame was returned; feed nothing more."""

    def _frames(self, events: list[Json]) -> bytes:
        frames = b""
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
            frames += sse.named(event["type"], event)
        return frames

    def start(self) -> bytes:
        return self._frames(self._assembler.opening())

    def feed(self, event: ChunkEvent) -> bytes:
        assert not self.done, "event after the end of the stream"
        if isinstance(event, PrefillProgress):
            return sse.prefill_progress(event)
        frames = self._frames(self._assembler.feed(event))
        self.done = self._assembler.end is not None
        return frames

    def broken_off(self) -> bytes:
        return self.feed(UNFINISHED)

    def keep_alive(self) -> bytes:
        return sse.KEEP_ALIVE


class ResponsesCollector:
    """One non-streamed response: `feed()` every event, then `result()`."""

    def __init__(self, assembler: ResponseAssembler) -> None:
        self._assembler = assembler

    def feed(self, event: ChunkEvent) -> None:
        self._assembler.feed(event)

    def result(self) -> Json:
        """The response object; raises `ApiError` if the generation failed or broke off."""
        end, final = self._assembler.end, self._assembler.final
        if not isinstance(end, Finish) or final is None:
            raise failure(end)
        return final


def failure(end: ChunkEvent | None) -> ApiError:
    """The HTTP error of a non-streamed answer that did not finish: its error, or a broken-off one."""
    return from_generation_error(end if isinstance(end, GenerationError) else UNFINISHED)
