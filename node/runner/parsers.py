"""Output parsers: generated tokens in, chunk events (text, reasoning, tool calls) out.

Sans-I/O: the runner feeds each generated token with its detokenized text and forwards the events.
Two parsers: `HarmonyParser` for GPT-OSS (token based, openai-harmony does the work) and
`TaggedTextParser` for template models (`<think>` and Hermes/Qwen `<tool_call>` tags in the text).
Neither ever raises on odd model output: what cannot be parsed comes out as plain text.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Protocol

from protocol.events import ReasoningDelta, TextDelta, ToolCall

ParsedEvent = TextDelta | ReasoningDelta | ToolCall

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNCTIONS_PREFIX = "functions."


class OutputParser(Protocol):
    def feed(self, token: int, text: str) -> list[ParsedEvent]:
        """One generated token and its detokenized text (possibly "")."""
        ...

    def flush(self) -> list[ParsedEvent]:
        """End of generation: emit anything held back."""
        ...


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class HarmonyParser:
    """GPT-OSS output via openai-harmony's `StreamableParser`; uses token ids, not `text`.

    - analysis channel -> `ReasoningDelta`, streamed;
    - final channel, and commentary without a recipient (a preamble) -> `TextDelta`, streamed;
    - a message with a recipient (`functions.NAME`, commentary channel) -> one `ToolCall` when the
      message completes (its stop token `<|call|>` is fed, or at `flush`). `name` is NAME; the
      arguments are the message text as the model wrote it (not validated: a generation cut by
      `max_tokens` can leave them incomplete).

    Whether the runner feeds the final stop token (`<|return|>`, `<|call|>`) or not makes no
    difference: `flush` completes a message left open. If the model breaks the harmony format, the
    parser gives up interpreting: the `text` of the unparsed tokens since the last delta, and of
    every later token, comes out as `TextDelta`.
    """

    def __init__(self, encoding: Any) -> None:
        from openai_harmony import Role, StreamableParser

        self._encoding = encoding
        self._parser = StreamableParser(encoding, Role.ASSISTANT)
        self._done_messages = 0
        self._unparsed: list[str] = []  # text of header tokens since the last delta
        self._broken = False

    def feed(self, token: int, text: str) -> list[ParsedEvent]:
        if self._broken:
            return [TextDelta(text=text)] if text else []
        from openai_harmony import HarmonyError

        try:
            self._parser.process(token)
        except HarmonyError:
            self._unparsed.append(text)
            return self._give_up()
        events: list[ParsedEvent] = []
        delta = self._parser.last_content_delta
        if delta and self._parser.current_recipient is None:
            if self._parser.current_channel == "analysis":
                events.append(ReasoningDelta(text=delta))
            else:
                events.append(TextDelta(text=delta))
        if delta:
            self._unparsed.clear()
        else:
            self._unparsed.append(text)
        if self._encoding.is_special_token(token):  # only a special token can end a message
            events.extend(self._completed_tool_calls())
        return events

    def flush(self) -> list[ParsedEvent]:
        if self._broken:
            return []
        from openai_harmony import HarmonyError

        try:
            self._parser.process_eos()
        except HarmonyError:
            return self._give_up()
        return self._completed_tool_calls()

    def _give_up(self) -> list[ParsedEvent]:
        self._broken = True
        raw, self._unparsed = "".join(self._unparsed), []
        return [TextDelta(text=raw)] if raw else []

    def _completed_tool_calls(self) -> list[ParsedEvent]:
        self._unparsed.clear()
        messages = self._parser.messages
        new, self._done_messages = messages[self._done_messages :], len(messages)
        calls: list[ParsedEvent] = []
        for message in new:
            if not message.recipient:
                continue
            name = message.recipient.removeprefix(FUNCTIONS_PREFIX)
            arguments = "".join(getattr(c, "text", "") for c in message.content)
            calls.append(ToolCall(id=new_tool_call_id(), name=name, arguments=arguments))
        return calls


class TaggedTextParser:
    """Text of template models: `<think>` blocks, Hermes/Qwen `<tool_call>` blocks, plain text.

    - `<think>...</think>` -> `ReasoningDelta`; recognised only before any visible text (models
      think first), so an answer that talks about `<think>` tags stays text.
    - `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> one `ToolCall`, with the
      arguments re-serialised as a JSON string (a JSON string value is kept as is). If the block is
      not such JSON, its raw text, tags included, comes out as a `TextDelta`.
    - Whitespace around blocks is trimmed: leading and trailing whitespace of the reasoning, and
      whitespace at the very start and right after `</think>` or a tool call.
    - Tags may arrive split across pieces; only a possible tag prefix is held back, the rest
      streams at once.

    `starts_in_reasoning`: the prompt already opened `<think>`, so the output starts as reasoning.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._mode = "think" if starts_in_reasoning else "text"
        self._held = ""  # text not yet classified: a possible tag prefix, or trailing reasoning spaces
        self._tool_body = ""
        self._seen_visible = False
        self._skip_space = True  # the answer (or reasoning) never starts with whitespace

    def feed(self, token: int, text: str) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        self._held += text
        while self._held:
            if self._skip_space:
                stripped = self._held.lstrip()
                self._held = stripped
                if not stripped:
                    break
                self._skip_space = False
            if not self._step(events):
                break
        return _merge(events)

    def flush(self) -> list[ParsedEvent]:
        events: list[ParsedEvent] = []
        held, self._held = self._held, ""
        if self._mode == "text" and held:
            events.append(TextDelta(text=held))
        elif self._mode == "think":
            held = held.rstrip()
            if held:
                events.append(ReasoningDelta(text=held))
        elif self._mode == "tool":
            events.extend(self._finish_tool_call(self._tool_body + held, closed=False))
            self._tool_body = ""
        self._mode = "text"
        return events

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "think":
            return (THINK_CLOSE,)
        if self._mode == "tool":
            return (TOOL_CLOSE,)
        return (TOOL_OPEN,) if self._seen_visible else (THINK_OPEN, TOOL_OPEN)

    def _step(self, events: list[ParsedEvent]) -> bool:
        """Consume what can be classified in `_held`; False when the rest must wait for more text."""
        found = _first_tag(self._held, self._tags())
        if found is None:
            keep = _partial_tag_len(self._held, self._tags())
            ready, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            if self._mode == "think":
                # Hold trailing whitespace: it is dropped if `</think>` follows.
                body = ready.rstrip()
                self._held = ready[len(body) :] + self._held
                ready = body
            self._emit(ready, events)
            return False
        start, tag = found
        before = self._held[:start]
        if tag == THINK_OPEN and before.strip():
            # Visible text first: from here on `<think>` is just text. Look again without it.
            self._emit(before, events)
            self._held = self._held[start:]
            return True
        self._emit(before.rstrip() if self._mode == "think" else before, events)
        self._held = self._held[start + len(tag) :]
        if tag == THINK_OPEN:
            self._mode, self._skip_space = "think", True
        elif tag == TOOL_OPEN:
            self._mode, self._tool_body = "tool", ""
        elif tag == THINK_CLOSE:
            self._mode, self._skip_space = "text", True
        else:  # TOOL_CLOSE
            body, self._tool_body = self._tool_body, ""
            finished = self._finish_tool_call(body, closed=True)
            events.extend(finished)
            self._mode, self._skip_space = "text", isinstance(finished[0], ToolCall)
        return True

    def _emit(self, text: str, events: list[ParsedEvent]) -> None:
        if not text:
            return
        if self._mode == "text":
            events.append(TextDelta(text=text))
            self._seen_visible = self._seen_visible or bool(text.strip())
        elif self._mode == "think":
            events.append(ReasoningDelta(text=text))
        else:
            self._tool_body += text

    def _finish_tool_call(self, body: str, *, closed: bool) -> list[ParsedEvent]:
        self._seen_visible = True  # no `<think>` after a tool call either
        call = _parse_tool_call(body)
        if call is not None:
            return [call]
        raw = TOOL_OPEN + body + (TOOL_CLOSE if closed else "")
        return [TextDelta(text=raw)]


def _parse_tool_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters"))
    if arguments is None:
        text = "{}"
    elif isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        text = arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_tool_call_id(), name=data["name"], arguments=text)


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


def _merge(events: list[ParsedEvent]) -> list[ParsedEvent]:
    """Join neighbouring deltas of the same kind, so one piece gives at most one delta per kind run."""
    merged: list[ParsedEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(text=last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(text=last.text + event.text)
        else:
            merged.append(event)
    return merged
