"""Stop sequences: cut the visible text where the client asked generation to end.

Sans-I/O: text in, text out. The runner feeds it the visible content only (never reasoning or tool
call arguments), piece by piece as it streams.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop sequence in streamed text, holding back what might be the start of one.

    `feed` returns the text safe to emit now and whether a stop sequence was hit; the returned text
    never includes the stop sequence nor anything after it. Once a stop is hit, the matcher is done:
    later `feed` calls return `("", True)` and `flush` returns `""`. If several stops match, the one
    that ends the text earliest (and, among those, starts earliest) wins. Empty stop strings are
    ignored.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._hit = False
        self.matched: str | None = None
        """The stop sequence that was hit, once one was."""

    @property
    def hit(self) -> bool:
        return self._hit

    def feed(self, text: str) -> tuple[str, bool]:
        if self._hit:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        found = self._first_stop(buffer)
        if found is not None:
            cut, self.matched = found
            self._hit = True
            self._held = ""
            return buffer[:cut], True
        keep = self._possible_start(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The text held back at the end of generation (it turned out not to be a stop)."""
        held, self._held = self._held, ""
        return "" if self._hit else held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """Where the winning stop starts in `buffer`, and which one it is."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _possible_start(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
