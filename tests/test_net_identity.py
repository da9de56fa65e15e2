"""The node identity: created once with mode 0600, stable across restarts, one per data dir."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from node.net.identity import IdentityError, identity_path, load_or_create_identity, peer_id_of

pytestmark = pytest.mark.timeout(30)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_once_with_mode_0600(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"  # does not exist yet
    key_pair = load_or_create_identity(data_dir)
    path = identity_path(data_dir)
    assert path.is_file()
    assert _mode(path) == 0o600
    assert peer_id_of(key_pair).startswith("12D3KooW")
    assert [p.name for p in data_dir.iterdir()] == ["identity.key"]  # no temp file left behind
    mtime = path.stat().st_mtime_ns
    load_or_create_identity(data_dir)
    assert path.stat().st_mtime_ns == mtime  # loaded, not rewritten


def test_stable_across_restarts(tmp_path: Path) -> None:
    first = peer_id_of(load_or_create_identity(tmp_path))
    for _ in range(3):
        assert peer_id_of(load_or_create_identity(tmp_path)) == first


def test_distinct_per_data_dir(tmp_path: Path) -> None:
    ids = {peer_id_of(load_or_create_identity(tmp_path / name)) for name in ("a", "b", "c")}
    assert len(ids) == 3


def test_loose_permissions_are_tightened(tmp_path: Path) -> None:
    first = peer_id_of(load_or_create_identity(tmp_path))
    identity_path(tmp_path).chmod(0o644)
    assert peer_id_of(load_or_create_identity(tmp_path)) == first
    assert _mode(identity_path(tmp_path)) == 0o600


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x08\x01\x12\x05short", b"x" * 5000])
def test_corrupt_file_is_refused_not_replaced(tmp_path: Path, content: bytes) -> None:
    path = identity_path(tmp_path)
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match=r"identity\.key"):
        load_or_create_identity(tmp_path)
    assert path.read_bytes() == content
