"""The client side of the chaos test: streamed greedy requests, each bounded, and what became of them.

A request ends in one of a few ways, judged against a reference run of the same prompt: `ok` (the
whole answer), `error_event` (an error in the stream, then `[DONE]`), `error_status` (a non-200 in
OpenAI's error shape), `dropped` (the connection broke or closed without `[DONE]`) or `hung` (past
its bound). `judge` says which of those are allowed: a dropped request only when its entry node was
killed while it ran; text that is not the reference's (or, when cut short, its prefix) never.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = (
    "Count to twenty.",
    "Tell me about lighthouses.",
    "Write a haiku about the sea.",
)
MAX_TOKENS = 32
REQUEST_BOUND_S = 60.0
"""No request may take longer: the nodes' failover and load waits (20 s each, the test's flags)
end any request sooner, so one that reaches this bound hung."""
READ_TIMEOUT_S = 45.0
"""Between two lines of a stream; keep-alive comments (every 10 s) arrive well within it."""


@dataclass
class Streamed:
    """What one request got back."""

    status: int = 0
    text: str = ""
    finish: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    broken: str | None = None
    """Why the connection ended early (the transport error), or None."""
    hung: bool = False
    body: str = ""
    """A non-200 answer's body."""


def body(model: str, prompt: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }


def stream(base_url: str, request: dict[str, Any], on_content: Callable[[], None] = lambda: None) -> Streamed:
    """Stream one chat completion, never for longer than `REQUEST_BOUND_S`; `on_content` is called
    for each chunk that carries text. Transport errors are recorded, not raised."""
    out = Streamed()
    deadline = time.monotonic() + REQUEST_BOUND_S
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=request, timeout=timeout) as answer:
            out.status = answer.status_code
            if answer.status_code != 200:
                out.body = answer.read().decode(errors="replace")
                return out
            for line in answer.iter_lines():
                if time.monotonic() > deadline:
                    out.hung = True
                    return out
                if line == "data: [DONE]":
                    out.done = True
                    return out
                if line.startswith("data: "):
                    _take(out, json.loads(line[6:]), on_content)
    except httpx.TimeoutException as exc:
        out.hung, out.broken = True, repr(exc)
    except httpx.TransportError as exc:
        out.broken = repr(exc)
    return out


def _take(out: Streamed, chunk: dict[str, Any], on_content: Callable[[], None]) -> None:
    if "error" in chunk:
        out.errors.append(chunk["error"])
        return
    for choice in chunk["choices"]:
        if content := choice["delta"].get("content"):
            out.text += content
            on_content()
        out.finish = choice.get("finish_reason") or out.finish


@dataclass(frozen=True)
class Outcome:
    prompt: int
    entry: int
    """The slot of the node the request entered at."""
    entry_killed: bool
    """That node was killed while the request ran."""
    got: Streamed


def judge(outcome: Outcome, reference: Streamed) -> tuple[str, str | None]:
    """The outcome's kind, and why it is not allowed (None when it is)."""
    got = outcome.got
    if got.hung:
        return "hung", f"no end within {REQUEST_BOUND_S} s ({got.broken or 'still streaming'})"
    if got.status == 0:  # no answer at all: refused, or cut before the status line
        return "dropped", None if outcome.entry_killed else f"no answer ({got.broken}) though its entry lived"
    if got.status != 200:
        try:
            shaped = isinstance(json.loads(got.body)["error"]["message"], str)
        except (ValueError, KeyError, TypeError):
            shaped = False
        return "error_status", None if shaped else f"{got.status} not in OpenAI's error shape: {got.body!r}"
    if not reference.text.startswith(got.text):
        return "garbled", f"{got.text!r} is not a prefix of the reference {reference.text!r}"
    if got.broken is not None or not got.done:
        allowed = outcome.entry_killed
        return "dropped", None if allowed else f"ended early ({got.broken}) though its entry lived"
    if got.errors:
        shaped = all(isinstance(e.get("message"), str) for e in got.errors)
        return "error_event", None if shaped else f"error events not in OpenAI's shape: {got.errors}"
    if got.text != reference.text or got.finish != reference.finish:
        return "garbled", f"finished {got.finish!r} with {got.text!r}, not {reference.finish!r}"
    return "ok", None


class Entries:
    """The nodes a client may enter at (slot -> base URL), and how often each was killed: the
    killer takes a node out before it kills it, so a request that sees the count change knows its
    entry died under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: dict[int, str] = {}
        self._kills: dict[int, int] = {}

    def open(self, slot: int, url: str) -> None:
        with self._lock:
            self._urls[slot] = url
            self._kills.setdefault(slot, 0)

    def close(self, slot: int) -> None:
        with self._lock:
            self._urls.pop(slot, None)
            self._kills[slot] += 1

    def pick(self, choose: Callable[[list[int]], int]) -> tuple[int, str, int] | None:
        with self._lock:
            if not self._urls:
                return None
            slot = choose(sorted(self._urls))
            return slot, self._urls[slot], self._kills[slot]

    def kills(self, slot: int) -> int:
        with self._lock:
            return self._kills[slot]


class Progress:
    """Content chunks received by all clients so far, for the killer to wait on (an event, not a sleep)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.chunks = 0

    def add(self) -> None:
        with self._cond:
            self.chunks += 1
            self._cond.notify_all()

    def wait_beyond(self, mark: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.chunks >= mark, timeout)
