"""The serving side of model files: which folders this node offers, and to whom (`api.files.FileSource`).

The node offers a model with `offer(manifest, folder)` once it has its manifest (computed or
fetched); peers then get its files through `GET /v1/files/{manifest_id}/{path}`. A folder may hold
only some of the manifest's files (a stage fetched only its shards): `locate` answers for those
present. A file is served only while it is as it was when offered (same size and mtime): a file
changed or removed since is a 404, and the requester goes to another peer, rather than receiving
bytes that no longer match the hash it will check.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from node.files.signing import MAX_SKEW_S, RequestChecker, Verdict
from protocol.manifest import Manifest


@dataclass(frozen=True)
class _Offer:
    manifest: Manifest
    folder: Path
    stats: dict[str, tuple[int, int]]
    """path -> (size, mtime_ns) when offered, for the files present then."""


class FileServer:
    """Implements `api.files.FileSource` for this node. Thread-safe (offers come from worker threads).

    `key` is `node.net.auth.derive_key(cluster, secret)`; `members` (optional) lists the node ids
    allowed now, e.g. the live members of the cluster view.
    """

    def __init__(
        self,
        key: bytes,
        *,
        clock: Callable[[], float] = time.time,
        max_skew_s: float = MAX_SKEW_S,
        members: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self._checker = RequestChecker(key, clock=clock, max_skew_s=max_skew_s, members=members)
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()

    def offer(self, manifest: Manifest, folder: Path) -> frozenset[str]:
        """Serve the files of `manifest` present (with their manifest size) in `folder`, replacing an
        earlier offer of the same manifest; returns the paths offered. Blocking: a stat per file."""
        stats: dict[str, tuple[int, int]] = {}
        for entry in manifest.files:
            try:
                stat = (folder / entry.path).stat()
            except OSError:
                continue
            if stat.st_size == entry.size:
                stats[entry.path] = (stat.st_size, stat.st_mtime_ns)
        with self._lock:
            self._offers[manifest.id] = _Offer(manifest, folder, stats)
        return frozenset(stats)

    def withdraw(self, manifest_id: str) -> None:
        """Stop serving a model (before deleting or replacing its folder)."""
        with self._lock:
            self._offers.pop(manifest_id, None)

    def offered(self) -> dict[str, frozenset[str]]:
        """manifest id -> the paths this node serves of it: what the cluster view can advertise."""
        with self._lock:
            return {mid: frozenset(offer.stats) for mid, offer in self._offers.items()}

    # --- api.files.FileSource -------------------------------------------------------------------
    def authorize(self, headers: Mapping[str, str], method: str, path: str) -> Verdict:
        return self._checker.check(headers, method, path)

    def locate(self, manifest_id: str, path: str) -> Path | None:
        with self._lock:
            offer = self._offers.get(manifest_id)
        if offer is None or (expected := offer.stats.get(path)) is None:
            return None
        file = offer.folder / path
        try:
            stat = os.stat(file)
        except OSError:
            return None
        return file if (stat.st_size, stat.st_mtime_ns) == expected else None
