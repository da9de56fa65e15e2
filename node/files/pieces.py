"""How a file in flight lies on disk: byte ranges ("pieces"), each in its own part file, resumable.

A file comes in one piece from one peer, or, when it is large and several peers hold it, in a few
pieces from different peers at once. Each piece is written to `<parts>/<path>.<start>-<end>.part`
and only ever appended to, so its length is what arrived: after a crash or a restart the download
resumes with `Range: bytes=<start + length>-<end - 1>`. The pieces already on disk decide the
split of a resumed file (whatever the peers are now), so nothing that arrived is thrown away.

When every piece is complete they are joined into one file (the first piece renamed, the others
appended), which the fetcher hashes before it gets its real name. Blocking file I/O: worker threads.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

PART_SUFFIX = ".part"
WHOLE_SUFFIX = ".whole"
"""A file joined from its pieces, before its hash is checked."""


@dataclass(frozen=True, order=True)
class Piece:
    """Bytes `[start, end)` of a file."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def plan(size: int, ways: int, min_piece_bytes: int) -> tuple[Piece, ...]:
    """`ways` near-equal pieces of a `size`-byte file, fewer when pieces would be under `min_piece_bytes`."""
    ways = max(1, min(ways, size // max(1, min_piece_bytes)))
    bounds = [size * i // ways for i in range(ways + 1)]
    return tuple(Piece(a, b) for a, b in itertools.pairwise(bounds))


def part_file(parts_dir: Path, path: str, piece: Piece) -> Path:
    return parts_dir / f"{path}.{piece.start}-{piece.end}{PART_SUFFIX}"


def whole_file(parts_dir: Path, path: str) -> Path:
    return parts_dir / f"{path}{WHOLE_SUFFIX}"


def pieces_on_disk(parts_dir: Path, path: str, size: int) -> tuple[Piece, ...] | None:
    """The pieces of `path` already on disk, if they tile `[0, size)` exactly; otherwise any part
    files found are leftovers of another split (or size) and are removed, and the answer is None."""
    folder, name = (parts_dir / path).parent, Path(path).name
    pattern = re.compile(re.escape(name) + r"\.(\d+)-(\d+)" + re.escape(PART_SUFFIX))
    found: list[Piece] = []
    files: list[Path] = []
    with contextlib.suppress(OSError):
        for child in folder.iterdir():
            if match := pattern.fullmatch(child.name):
                found.append(Piece(int(match.group(1)), int(match.group(2))))
                files.append(child)
    found.sort()
    tiles = (
        bool(found)
        and found[0].start == 0
        and found[-1].end == size
        and all(a.end == b.start and b.length > 0 for a, b in itertools.pairwise(found))
    )
    if tiles:
        return tuple(found)
    for file in files:
        with contextlib.suppress(OSError):
            file.unlink()
    return None


def pieces_for(parts_dir: Path, path: str, size: int, ways: int, min_piece_bytes: int) -> tuple[Piece, ...]:
    """The split to use for `path`: the one on disk (resume), else a new plan."""
    with contextlib.suppress(OSError):
        whole_file(parts_dir, path).unlink()  # a join that a crash cut short
    return pieces_on_disk(parts_dir, path, size) or plan(size, ways, min_piece_bytes)


def received(parts_dir: Path, path: str, piece: Piece) -> int:
    """Bytes of `piece` on disk; a part file longer than its piece is broken and emptied."""
    file = part_file(parts_dir, path, piece)
    try:
        length = file.stat().st_size
    except FileNotFoundError:
        return 0
    if length > piece.length:
        os.truncate(file, 0)
        return 0
    return length


def discard(parts_dir: Path, path: str, pieces: tuple[Piece, ...]) -> None:
    """Remove every part file of `path` (after its joined file failed the hash check)."""
    for piece in pieces:
        with contextlib.suppress(FileNotFoundError):
            part_file(parts_dir, path, piece).unlink()
    with contextlib.suppress(FileNotFoundError):
        whole_file(parts_dir, path).unlink()


def join(parts_dir: Path, path: str, pieces: tuple[Piece, ...]) -> Path:
    """The complete pieces of `path` as one file (`whole_file`); the part files are gone after."""
    whole = whole_file(parts_dir, path)
    first = part_file(parts_dir, path, pieces[0])
    if not first.exists() and pieces[0].length == 0:
        first.parent.mkdir(parents=True, exist_ok=True)
        first.touch()
    os.replace(first, whole)
    with open(whole, "ab") as out:
        for piece in pieces[1:]:
            part = part_file(parts_dir, path, piece)
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            part.unlink()
    return whole
