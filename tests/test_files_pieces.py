"""Part files on disk (split, resume, join) and the progress meter (rate, one log line per 10%)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node.files import pieces
from node.files.pieces import Piece
from node.files.progress import LOG_STEPS_MIN_BYTES, RATE_WINDOW_S, ProgressBoard, ProgressMeter


@pytest.mark.parametrize(
    ("size", "ways", "min_piece", "expected"),
    [
        (0, 4, 10, [(0, 0)]),
        (100, 1, 10, [(0, 100)]),
        (100, 2, 10, [(0, 50), (50, 100)]),
        (100, 3, 10, [(0, 33), (33, 66), (66, 100)]),
        (100, 4, 40, [(0, 50), (50, 100)]),  # pieces stay >= min_piece
        (30, 4, 40, [(0, 30)]),
    ],
)
def test_plan(size: int, ways: int, min_piece: int, expected: list[tuple[int, int]]) -> None:
    assert pieces.plan(size, ways, min_piece) == tuple(Piece(a, b) for a, b in expected)


def test_a_resumed_file_keeps_the_split_on_disk(tmp_path: Path) -> None:
    parts = tmp_path / ".parts"
    split = pieces.plan(100, 2, 10)
    for piece, data in zip(split, (b"a" * 20, b"b" * 5), strict=True):
        pieces.part_file(parts, "sub/w.safetensors", piece).parent.mkdir(parents=True, exist_ok=True)
        pieces.part_file(parts, "sub/w.safetensors", piece).write_bytes(data)
    # Fewer peers now (one way), but what arrived stays: the split on disk wins.
    assert pieces.pieces_for(parts, "sub/w.safetensors", 100, 1, 10) == split
    assert [pieces.received(parts, "sub/w.safetensors", p) for p in split] == [20, 5]

    # A different size (another manifest) makes them leftovers: removed, and a fresh plan.
    assert pieces.pieces_for(parts, "sub/w.safetensors", 90, 1, 10) == (Piece(0, 90),)
    assert list((parts / "sub").iterdir()) == []


def test_a_part_longer_than_its_piece_is_emptied(tmp_path: Path) -> None:
    piece = Piece(0, 4)
    pieces.part_file(tmp_path, "f", piece).write_bytes(b"12345")
    assert pieces.received(tmp_path, "f", piece) == 0
    assert pieces.received(tmp_path, "f", Piece(4, 8)) == 0  # no file yet


def test_join_and_discard(tmp_path: Path) -> None:
    split = (Piece(0, 3), Piece(3, 5), Piece(5, 9))
    for piece, data in zip(split, (b"abc", b"de", b"fghi"), strict=True):
        pieces.part_file(tmp_path, "f", piece).write_bytes(data)
    whole = pieces.join(tmp_path, "f", split)
    assert whole.read_bytes() == b"abcdefghi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.whole"]
    pieces.discard(tmp_path, "f", split)
    assert list(tmp_path.iterdir()) == []
    assert pieces.join(tmp_path, "empty", (Piece(0, 0),)).read_bytes() == b""


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_logs_each_tenth_once_and_measures_a_recent_rate(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    total = LOG_STEPS_MIN_BYTES * 2
    caplog.set_level(logging.INFO, logger="shoal.files")
    board = ProgressBoard(clock)
    meter = board.start(manifest_id="m" * 64, model="tiny", source="peers", bytes_total=total, files_total=2)
    chunk = total // 400
    for _ in range(400):  # 10 MiB/s-ish: 400 chunks, 0.1 s apart
        clock.now += 0.1
        meter.advance(chunk)
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "%" in line]) == 9  # 10% ... 90%, once each
    assert lines[5] == "tiny: 50% (67.4 MB of 134.2 MB) at 3.4 MB/s"
    snap = board.snapshots()[-1]
    assert snap.rate_bps == pytest.approx(chunk / 0.1, rel=0.02)
    assert (snap.state, snap.bytes_total, snap.files_total) == ("fetching", total, 2)

    clock.now += RATE_WINDOW_S * 2  # a stall: the rate falls to 0
    assert meter.rate() == 0.0
    meter.finish()
    assert board.snapshots()[-1].fraction == 1.0
    assert "all 2 file(s) here and verified" in caplog.records[-1].getMessage()


def test_resumed_bytes_are_progress_not_rate() -> None:
    clock = FakeClock()
    meter = ProgressMeter(
        manifest_id="", model="m", source="hub", bytes_total=1000, files_total=1, clock=clock
    )
    meter.resumed(600)
    clock.now += 1.0
    meter.advance(100)
    assert (meter.bytes_done, meter.rate()) == (700, pytest.approx(100.0))
    meter.fail("no route")
    snap = meter.snapshot()
    assert (snap.state, snap.error, snap.rate_bps) == ("failed", "no route", 0.0)


def test_the_board_keeps_running_transfers_and_the_last_finished(caplog: pytest.LogCaptureFixture) -> None:
    board = ProgressBoard(FakeClock())
    for i in range(40):
        meter = board.start(manifest_id=f"{i}", model="m", source="peers", bytes_total=1, files_total=1)
        if i % 2:
            meter.finish()
    snaps = board.snapshots()
    assert len([s for s in snaps if s.state == "fetching"]) == 20
    assert len([s for s in snaps if s.state == "done"]) == 16
    assert snaps[-1].manifest_id == "39"
