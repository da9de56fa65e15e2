"""The node's persistent libp2p identity: one Ed25519 key in `<data_dir>/identity.key`.

The peer id derived from it ("12D3KooW...") is the node id everywhere in Shoal, so the key must
survive restarts: it is created once, on first start, with an atomic write (a temporary file in the
same folder, fsync, rename), mode 0600. Two data dirs mean two identities.

The file holds the key in libp2p's standard protobuf encoding (`PrivateKey.serialize()`: key type
Ed25519 + 32-byte seed), so other libp2p tools can read it. We avoid libp2p's legacy
`save_keypair()`/`load_keypair()`, which use a fixed relative path.

How it fails:
- A file that cannot be decoded as an Ed25519 key raises `IdentityError` naming the file; it is
  never silently replaced, because a new key would be a new node to the rest of the cluster.
- A file readable or writable by group/others is tightened to 0600 with a warning, not refused: the
  cluster secret, not the identity, is what admits a node, and refusing would turn an innocent
  `cp -r` of a data dir into a node that cannot start. (If the key leaked, delete the file to get a
  new identity.)
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

log = logging.getLogger("shoal.net")

IDENTITY_FILE = "identity.key"
KEY_MODE = 0o600
MAX_KEY_FILE_BYTES = 1024
"""A serialized Ed25519 key is 36 bytes; anything much larger is not our file."""


class IdentityError(Exception):
    """The identity file exists but cannot be used; the message says which file and why."""


def identity_path(data_dir: Path) -> Path:
    return data_dir / IDENTITY_FILE


def peer_id_of(key_pair: KeyPair) -> str:
    """The node id: the base58 libp2p peer id of the key ("12D3KooW...")."""
    return ID.from_pubkey(key_pair.public_key).to_base58()


def load_or_create_identity(data_dir: Path) -> KeyPair:
    """Load the node's key pair from `data_dir`, creating it (mode 0600) on first start."""
    path = identity_path(data_dir)
    try:
        return _load(path)
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    key_pair = create_new_key_pair()
    if _write_new(path, key_pair.private_key.serialize()):
        log.info("created node identity %s in %s", peer_id_of(key_pair), path)
        return key_pair
    return _load(path)  # another process created it first: use theirs


def _load(path: Path) -> KeyPair:
    with path.open("rb") as file:
        mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
        if mode & 0o077:
            log.warning("%s had mode %o; tightening it to %o", path, mode, KEY_MODE)
            os.fchmod(file.fileno(), KEY_MODE)
        data = file.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise IdentityError(f"{path} is not a Shoal identity key (too large); move it away to start anew")
    try:
        private_key = deserialize_private_key(data)
    except Exception as exc:  # protobuf/cryptography raise many types for bad bytes
        raise IdentityError(f"{path} is corrupt ({exc}); move it away to start with a new identity") from exc
    if not isinstance(private_key, Ed25519PrivateKey):
        raise IdentityError(f"{path} holds a {type(private_key).__name__}, not an Ed25519 key")
    return KeyPair(private_key, private_key.get_public_key())


def _write_new(path: Path, data: bytes) -> bool:
    """Atomically create `path` with `data` (mode 0600); False if it already exists."""
    fd, tmp_name = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, KEY_MODE)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(tmp, path)  # unlike rename, never replaces a file another process just wrote
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: rename, still atomic
            if path.exists():
                return False
            os.rename(tmp, path)
        _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
