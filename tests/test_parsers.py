"""Output parsers: harmony tokens (real o200k encoding) and tagged text, streamed piece by piece."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.models.harmony_vocab import load_harmony_encoding_offline, prepare_harmony_vocab
from node.runner.parsers import HarmonyParser, OutputParser, ParsedEvent, TaggedTextParser
from protocol.events import ReasoningDelta, TextDelta, ToolCall


@pytest.fixture(scope="module")
def encoding(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_harmony_encoding_offline(prepare_harmony_vocab(tmp_path_factory.mktemp("data")))


def collapse(events: list[ParsedEvent]) -> list[tuple[str, str]]:
    """Join consecutive deltas of one kind; tool calls become ("tool:NAME", arguments)."""
    out: list[tuple[str, str]] = []
    for event in events:
        if isinstance(event, ToolCall):
            assert event.id.startswith("call_") and len(event.id) > len("call_")
            out.append((f"tool:{event.name}", event.arguments))
        elif out and out[-1][0] == event.kind:
            out[-1] = (event.kind, out[-1][1] + event.text)
        else:
            out.append((event.kind, event.text))
    return out


def run_tokens(parser: OutputParser, tokens: list[int]) -> list[ParsedEvent]:
    events: list[ParsedEvent] = []
    for token in tokens:
        events += parser.feed(token, "")
    return events + parser.flush()


def run_pieces(parser: OutputParser, pieces: list[str]) -> list[ParsedEvent]:
    events: list[ParsedEvent] = []
    for piece in pieces:
        events += parser.feed(0, piece)
    return events + parser.flush()


# Harmony -------------------------------------------------------------------------------------------

TOOL_CALL = (
    "<|channel|>analysis<|message|>Think about weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = (
    "<|channel|>analysis<|message|>Simple arithmetic: 2+2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4, ça va.<|return|>"
)


def test_harmony_tool_call(encoding: Any) -> None:
    events = run_tokens(HarmonyParser(encoding), encoding.encode(TOOL_CALL, allowed_special="all"))
    assert [type(e) for e in events[:-1]] == [ReasoningDelta] * (len(events) - 1)  # streamed per token
    assert len(events) > 3
    assert collapse(events) == [
        ("reasoning", "Think about weather."),
        ("tool:get_weather", '{"city": "Paris"}'),
    ]
    call = events[-1]
    assert isinstance(call, ToolCall)
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_harmony_tool_call_emitted_when_message_completes(encoding: Any) -> None:
    tokens = encoding.encode(TOOL_CALL, allowed_special="all")
    parser = HarmonyParser(encoding)
    before = [e for t in tokens[:-1] for e in parser.feed(t, "")]
    assert not any(isinstance(e, ToolCall) for e in before)
    assert collapse(parser.feed(tokens[-1], "")) == [("tool:get_weather", '{"city": "Paris"}')]
    assert parser.flush() == []


def test_harmony_tool_call_without_stop_token_completes_at_flush(encoding: Any) -> None:
    tokens = encoding.encode(TOOL_CALL, allowed_special="all")[:-1]  # the runner ate <|call|>
    assert collapse(run_tokens(HarmonyParser(encoding), tokens))[-1] == (
        "tool:get_weather",
        '{"city": "Paris"}',
    )


def test_harmony_reasoning_then_answer(encoding: Any) -> None:
    tokens = encoding.encode(ANSWER, allowed_special="all")
    assert collapse(run_tokens(HarmonyParser(encoding), tokens)) == [
        ("reasoning", "Simple arithmetic: 2+2."),
        ("text", "The answer is 4, ça va."),
    ]
    # Without the final <|return|> (stopped by the runner): the same.
    assert collapse(run_tokens(HarmonyParser(encoding), tokens[:-1]))[-1] == (
        "text",
        "The answer is 4, ça va.",
    )


def test_harmony_recipient_in_role_header(encoding: Any) -> None:
    text = (
        "<|channel|>analysis<|message|>Need data.<|end|>"
        "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>"
    )
    events = run_tokens(HarmonyParser(encoding), encoding.encode(text, allowed_special="all"))
    assert collapse(events) == [("reasoning", "Need data."), ("tool:lookup", "{}")]


def test_harmony_broken_format_falls_back_to_text(encoding: Any) -> None:
    parser = HarmonyParser(encoding)
    events: list[ParsedEvent] = []
    pieces = ["<|channel|>", "final", "<|message|>", "Hi", "<|end|>", "oops", " more"]
    for piece in pieces:
        (token,) = encoding.encode(piece, allowed_special="all")[:1]
        events += parser.feed(token, piece)
    events += parser.flush()
    assert collapse(events) == [("text", "Hioops more")]


def test_harmony_no_header_at_all_comes_out_at_flush(encoding: Any) -> None:
    parser = HarmonyParser(encoding)
    events: list[ParsedEvent] = []
    for piece in ["just", " words"]:
        events += parser.feed(encoding.encode(piece)[0], piece)
    assert events == []
    assert collapse(parser.flush()) == [("text", "just words")]


# Tagged text ---------------------------------------------------------------------------------------

TAGGED_CASES: list[tuple[str, bool, list[tuple[str, str]]]] = [
    ("Hello world", False, [("text", "Hello world")]),
    ("a < b and c<d, x <= y", False, [("text", "a < b and c<d, x <= y")]),
    ("<think>\nLet me see.\n</think>\n\nParis.", False, [("reasoning", "Let me see."), ("text", "Paris.")]),
    ("<think>\n\n</think>\n\nParis.", False, [("text", "Paris.")]),
    ("Let me see.\n</think>\n\nParis.", True, [("reasoning", "Let me see."), ("text", "Paris.")]),
    ("Still thinking", True, [("reasoning", "Still thinking")]),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        False,
        [("tool:get_weather", '{"city": "Paris"}')],
    ),
    (
        "<think>Weather?</think>\nChecking.\n"
        '<tool_call>{"name": "f", "arguments": {"x": [1, "é"]}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>',
        False,
        [
            ("reasoning", "Weather?"),
            ("text", "Checking.\n"),
            ("tool:f", '{"x": [1, "é"]}'),
            ("tool:g", '{"y": 2}'),
        ],
    ),
    ('<tool_call>{"name": "f"}</tool_call>', False, [("tool:f", "{}")]),
    (
        "<tool_call>{not json}</tool_call> after",
        False,
        [("text", "<tool_call>{not json}</tool_call>"), ("text", " after")],
    ),
    (
        '<tool_call>{"arguments": {}}</tool_call>',
        False,
        [("text", '<tool_call>{"arguments": {}}</tool_call>')],
    ),
    # Generation cut inside a block.
    ('<tool_call>{"name": "f", "arguments": {}}', False, [("tool:f", "{}")]),
    ('<tool_call>{"name": "f", "argu', False, [("text", '<tool_call>{"name": "f", "argu')]),
    ("<think>half a thou", False, [("reasoning", "half a thou")]),
    # Partial tags that never complete are plain text.
    ("The tag <thin", False, [("text", "The tag <thin")]),
    ("x <tool_cal", False, [("text", "x <tool_cal")]),
    # `<think>` only counts before any visible text.
    ("Use <think> tags.", False, [("text", "Use <think> tags.")]),
    ("  \n<think>r</think>a", False, [("reasoning", "r"), ("text", "a")]),
    ("  leading space", False, [("text", "leading space")]),
    # Inside reasoning, only `</think>` matters.
    ("<think>a <tool_call> b</think>c", False, [("reasoning", "a <tool_call> b"), ("text", "c")]),
    (
        "<think>x < y\n \n</thinking> z</think>done",
        False,
        [("reasoning", "x < y\n \n</thinking> z"), ("text", "done")],
    ),
]


def tagged(pieces: list[str], starts_in_reasoning: bool) -> list[tuple[str, str]]:
    events = run_pieces(TaggedTextParser(starts_in_reasoning=starts_in_reasoning), pieces)
    return collapse(events)


def merge_texts(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in items:
        if out and out[-1][0] == kind and not kind.startswith("tool:"):
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


@pytest.mark.parametrize(("text", "starts_in_reasoning", "expected"), TAGGED_CASES)
def test_tagged_whole(text: str, starts_in_reasoning: bool, expected: list[tuple[str, str]]) -> None:
    assert tagged([text], starts_in_reasoning) == merge_texts(expected)


@pytest.mark.parametrize(("text", "starts_in_reasoning", "expected"), TAGGED_CASES)
def test_tagged_split_at_every_position(
    text: str, starts_in_reasoning: bool, expected: list[tuple[str, str]]
) -> None:
    for cut in range(1, len(text)):
        assert tagged([text[:cut], text[cut:]], starts_in_reasoning) == merge_texts(expected), cut


@pytest.mark.parametrize(("text", "starts_in_reasoning", "expected"), TAGGED_CASES)
def test_tagged_character_by_character(
    text: str, starts_in_reasoning: bool, expected: list[tuple[str, str]]
) -> None:
    assert tagged(list(text), starts_in_reasoning) == merge_texts(expected)


def test_tagged_streams_without_waiting() -> None:
    parser = TaggedTextParser()
    assert parser.feed(0, "<th") == []
    assert parser.feed(0, "ink>") == []
    assert parser.feed(0, "Hmm") == [ReasoningDelta(text="Hmm")]
    assert parser.feed(0, " so\n") == [ReasoningDelta(text=" so")]  # trailing whitespace waits
    assert parser.feed(0, "</th") == []
    assert parser.feed(0, "ink>\n\nIt is") == [TextDelta(text="It is")]
    assert parser.feed(0, " a <") == [TextDelta(text=" a ")]
    assert parser.feed(0, " b") == [TextDelta(text="< b")]
    assert parser.feed(0, "") == []
    assert parser.flush() == []


def test_tagged_tool_call_ids_are_unique() -> None:
    body = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events = run_pieces(TaggedTextParser(), [body, body])
    ids = {e.id for e in events if isinstance(e, ToolCall)}
    assert len(ids) == 2


def test_ids_ignored_by_tagged_parser() -> None:
    assert TaggedTextParser().feed(12345, "") == []


def test_vocab_fixture_is_real(tmp_path: Path) -> None:
    folder = prepare_harmony_vocab(tmp_path)
    assert (folder / "o200k_base.tiktoken").stat().st_size == 3_613_922
