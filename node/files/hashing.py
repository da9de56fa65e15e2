"""A folder's manifest, with every file's SHA-256 cached so a restart does not hash gigabytes again.

Hashing reads the whole file (~1-2 GB/s): a 10 GB model costs seconds, so `HashCache` keeps each
hash in a sidecar JSON file keyed by (path, size, mtime_ns). A file whose size or modification
time changed is hashed again; one rewritten with the same size inside the same mtime tick would
not be noticed (as with `make`), which a fetch then catches, because the fetcher checks the hash
of every file it receives.

Everything here blocks (file reads): call it from a worker thread (`trio.to_thread.run_sync`).
`HashCache` is thread-safe, so the fetcher's threads and the file server can share one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from node.models.gguf import MARKER_FILE
from node.models.store import models_dir
from protocol.manifest import MAX_MANIFEST_FILES, FileEntry, Manifest, ManifestError, check_path, manifest_of

log = logging.getLogger("shoal.files")

SIDECAR_NAME = ".file-hashes.json"
"""In `<data_dir>/models/`: hidden, so the model store never lists it."""
SIDECAR_VERSION = 1
MAX_CACHE_ENTRIES = 100_000
"""Hashes kept; past this the entries of files that no longer exist are dropped first, then the oldest."""
READ_CHUNK = 1 << 20
"""Bytes per read while hashing: large enough that hashlib releases the GIL for most of the time."""


def sidecar_path(data_dir: Path) -> Path:
    return models_dir(data_dir) / SIDECAR_NAME


def file_sha256(path: Path) -> str:
    """The SHA-256 (lowercase hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class HashCache:
    """SHA-256 of files by (absolute path, size, mtime_ns), kept in `sidecar` (None: in memory only).

    A sidecar that cannot be read starts empty; one that cannot be written is logged once and the
    cache goes on in memory: a hash cache is never a reason to fail.
    """

    def __init__(self, sidecar: Path | None) -> None:
        self.sidecar = sidecar
        self.hashed_bytes = 0
        """Bytes actually read to hash (cache misses), for tests and the log."""
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[int, int, str]] = self._load()
        self._dirty = False
        self._warned = False

    def sha256(self, path: Path) -> str:
        """The hash of `path` now: from the cache when its size and mtime are unchanged, else read."""
        key, stat = str(path.absolute()), path.stat()
        with self._lock:
            cached = self._entries.get(key)
        if cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns):
            return cached[2]
        sha = file_sha256(path)
        after = path.stat()
        with self._lock:
            self.hashed_bytes += stat.st_size
            if (after.st_size, after.st_mtime_ns) == (
                stat.st_size,
                stat.st_mtime_ns,
            ):  # not written meanwhile
                self._put(key, (stat.st_size, stat.st_mtime_ns, sha))
        return sha

    def remember(self, path: Path, sha256: str) -> None:
        """Record the hash of a file whose bytes the caller just checked (e.g. a fetched file)."""
        stat = path.stat()
        with self._lock:
            self._put(str(path.absolute()), (stat.st_size, stat.st_mtime_ns, sha256))

    def matches(self, path: Path, entry: FileEntry) -> bool:
        """Whether `path` is a regular file with `entry`'s size and hash (hashing only on a cache miss)."""
        try:
            return path.is_file() and path.stat().st_size == entry.size and self.sha256(path) == entry.sha256
        except OSError:
            return False

    def save(self) -> None:
        """Write the sidecar atomically if anything changed."""
        if self.sidecar is None:
            return
        with self._lock:
            if not self._dirty:
                return
            self._prune()
            body = {"version": SIDECAR_VERSION, "entries": {k: list(v) for k, v in self._entries.items()}}
            self._dirty = False
        tmp = self.sidecar.with_name(f"{self.sidecar.name}.{os.getpid()}.tmp")
        try:
            self.sidecar.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.sidecar)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._warned:
                self._warned = True
                log.warning("cannot write the hash cache %s (%s): hashes are kept in memory only", tmp, exc)

    def _put(self, key: str, value: tuple[int, int, str]) -> None:
        self._entries.pop(key, None)  # re-insert: dict order is the age order `_prune` drops by
        self._entries[key] = value
        self._dirty = True

    def _prune(self) -> None:
        if len(self._entries) <= MAX_CACHE_ENTRIES:
            return
        for key in [k for k in self._entries if not os.path.exists(k)]:
            del self._entries[key]
        for key in list(self._entries)[: max(0, len(self._entries) - MAX_CACHE_ENTRIES)]:
            del self._entries[key]

    def _load(self) -> dict[str, tuple[int, int, str]]:
        if self.sidecar is None:
            return {}
        try:
            body = json.loads(self.sidecar.read_text(encoding="utf-8"))
            entries = body["entries"] if body.get("version") == SIDECAR_VERSION else {}
            return {
                key: (int(size), int(mtime), str(sha))
                for key, (size, mtime, sha) in list(entries.items())[:MAX_CACHE_ENTRIES]
            }
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}


def folder_files(folder: Path) -> list[str]:
    """The relative paths of the regular files under `folder` (links to files followed, links to
    folders not), sorted; hidden names (`.cache/`, the store's own files) are skipped, and so is a
    `.gguf` import's marker: it names the file's path and mtime on the importing node, so leaving it
    in would give one `.gguf`'s import another manifest on every node (`node.files.local_copy`)."""
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_root = Path(root).relative_to(folder)
        for name in files:
            if name.startswith(".") or not os.path.isfile(os.path.join(root, name)):
                continue
            if name == MARKER_FILE and rel_root == Path("."):
                continue
            found.append((rel_root / name).as_posix())
            if len(found) > MAX_MANIFEST_FILES:
                raise ManifestError(
                    f"{folder} holds more than {MAX_MANIFEST_FILES} files: not a model folder"
                )
    return sorted(found)


def file_entry(path: Path, rel_path: str, cache: HashCache) -> FileEntry:
    return FileEntry(path=check_path(rel_path), size=path.stat().st_size, sha256=cache.sha256(path))


def folder_manifest(folder: Path, cache: HashCache, *, derived_from: Path | None = None) -> Manifest:
    """The manifest of every file in `folder` (see `folder_files`); `derived_from` is the `.gguf` the
    folder was imported from, recorded by its file name. Saves the cache before returning."""
    try:
        entries = [file_entry(folder / rel, rel, cache) for rel in folder_files(folder)]
        source = file_entry(derived_from, derived_from.name, cache) if derived_from is not None else None
        return manifest_of(entries, derived_from=source)
    finally:
        cache.save()
