"""StopMatcher: cutting streamed text at the first stop sequence."""

from __future__ import annotations

import pytest

from node.runner.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Feed pieces until a stop hits; return what each feed emitted, whether it hit, and the flush."""
    matcher = StopMatcher(stops)
    emitted: list[str] = []
    hit = False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        emitted.append(text)
        if hit:
            break
    return emitted, hit, matcher.flush()


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "hit", "tail"),
    [
        # No stops: everything passes straight through.
        ([], ["a", "b<"], ["a", "b<"], False, ""),
        ([""], ["abc"], ["abc"], False, ""),
        # Stop inside one piece: text before it only.
        (["END"], ["hello END world"], ["hello "], True, ""),
        (["END"], ["END"], [""], True, ""),
        # Stop split across pieces: the possible start is held back, then dropped.
        (["END"], ["hello E", "N", "D more"], ["hello ", "", ""], True, ""),
        (["\n\n"], ["line\n", "\nnext"], ["line", ""], True, ""),
        # A prefix that never completes is released as soon as it can't be a stop.
        (["END"], ["hello E", "N", "X"], ["hello ", "", "ENX"], False, ""),
        (["END"], ["a EN", "x"], ["a ", "ENx"], False, ""),
        # ...or at flush, if generation ends while it is held.
        (["END"], ["hello EN"], ["hello "], False, "EN"),
        # Several stops: the first one to complete wins.
        (["STOP", "###"], ["x ### y STOP"], ["x "], True, ""),
        (["STOP", "###"], ["x ST", "OP ###"], ["x ", ""], True, ""),
        (["abcd", "bc"], ["abc"], ["a"], True, ""),
        # Overlapping prefixes: the longest possible start is held.
        (["aab"], ["xaa", "ab"], ["x", "a"], True, ""),
        (["<|end|>", "<|x"], ["hi <|", "e", "nd|>"], ["hi ", "", ""], True, ""),
        # Unicode.
        (["。"], ["答え。次"], ["答え"], True, ""),
    ],
)
def test_stop_matcher(stops: list[str], pieces: list[str], emitted: list[str], hit: bool, tail: str) -> None:
    assert run(stops, pieces) == (emitted, hit, tail)


@pytest.mark.parametrize("split", range(1, 12))
def test_split_at_every_position(split: int) -> None:
    text = "say hi STOP bye"
    emitted, hit, tail = run(["STOP"], [text[:split], text[split:]])
    assert "".join(emitted) + tail == "say hi "
    assert hit


def test_done_after_hit() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("ax") == ("a", True)
    assert matcher.hit
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_character_by_character_matches_whole() -> None:
    text = "one <END two <EN three <END> four"
    matcher = StopMatcher(["<END>"])
    out = ""
    for ch in text:
        piece, hit = matcher.feed(ch)
        out += piece
        if hit:
            break
    assert (out, hit) == ("one <END two <EN three ", True)


@pytest.mark.parametrize(
    ("stops", "pieces", "matched"),
    [
        (["abcd", "bc"], ["xa", "bcd"], "bc"),  # ends earliest wins, though "abcd" started first
        (["END", "ND"], ["xxE", "ND yy"], "END"),  # same end: the earlier start wins
        (["ab", "abc"], ["zab", "c"], "ab"),
        (["stop"], ["no", " match"], None),
    ],
)
def test_matched_names_the_stop_that_won(stops: list[str], pieces: list[str], matched: str | None) -> None:
    """Claude Messages reports the stop sequence that ended the text (`stop_sequence`)."""
    matcher = StopMatcher(stops)
    for piece in pieces:
        matcher.feed(piece)
    assert matcher.matched == matched
