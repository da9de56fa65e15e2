"""Getting a model's files onto this node from the peers that hold them, checked, resumable.

    fetcher = Fetcher(derive_key(cluster, secret), node_id, HashCache(sidecar_path(data_dir)))
    folder = await fetcher.fetch(manifest, cluster_model_dir(data_dir, manifest.id), peers, hub=hub)
    folder = await fetcher.fetch_stage(manifest, target, peers, start=8, end=16)  # only its shards

- every file is checked against the manifest's SHA-256 before it is used; a file that fails is
  fetched again (from another peer first), at most `attempts` times;
- nothing half-done ever sits at the target: files arrive in the staging folder `.<name>.fetch/`
  beside it, and only complete, checked files are moved into the target (a target that did not
  exist appears whole, by one rename);
- a cut transfer resumes where it stopped, after a restart too: the part files stay in the
  staging folder and the next request asks for the rest with `Range`;
- files go several at once (`streams`), spread over the peers that hold them, and a large file
  held by several peers comes in pieces from several of them;
- a failing attempt waits as `protocol.backoff` says before the next, and after `attempts` the
  fetch fails with a `FetchError` saying which file and why: never a tight loop;
- when a needed file has no peer, the hub (`hub_fallback`) supplies the model, unless
  `HF_HUB_OFFLINE=1`, which then means peers only.
"""

from __future__ import annotations

import functools
import logging
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from node.files import folders, pieces
from node.files.download import (
    FetchError,
    Peer,
    PieceFailed,
    PieceMissing,
    PieceRefused,
    RunningHash,
    download_piece,
    widen_http_reads,
)
from node.files.hashing import HashCache, file_sha256
from node.files.hub_fallback import HubRef, fetch_from_hub
from node.files.progress import ProgressBoard, ProgressMeter
from node.files.signing import sign
from protocol.backoff import Backoff, BackoffPolicy
from protocol.manifest import INDEX_FILE, FileEntry, Manifest, metadata_paths, stage_paths

log = logging.getLogger("shoal.files")

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

FETCH_BACKOFF = BackoffPolicy(min_s=1.0, max_s=30.0, jitter=0.2, stable_s=60.0)
"""Between failed tries: 1, 2, 4 ... 30 s; a try that ran a minute before failing starts over."""


@dataclass(frozen=True)
class FetchPolicy:
    attempts: int = 5
    """Tries per piece, and hash checks per file, before the fetch fails."""
    backoff: BackoffPolicy = FETCH_BACKOFF
    streams: int = 4
    """Downloads at once over all files and peers: enough to fill a LAN link from a few peers."""
    min_piece_bytes: int = 64 * 1024 * 1024
    """A file is split over several peers only into pieces at least this large (each piece is one
    request; small files go whole)."""
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 30.0
    """An answer silent this long fails the attempt (its bytes so far are kept)."""
    min_rate_bps: float = 100_000.0
    """An attempt gets at most max(60 s, its bytes at this rate): a trickling peer is left."""
    write_bytes: int = 1 << 20
    """Bytes gathered before each write to disk (in a worker thread)."""


@dataclass
class _Run:
    """The shared state of one fetch."""

    manifest: Manifest
    parts: Path
    staging: Path
    client: httpx.AsyncClient
    meter: ProgressMeter
    limiter: trio.CapacityLimiter
    load: Counter[str] = field(default_factory=Counter)
    """Downloads in flight per peer id (the progress shows how many peers are sending)."""
    refused: set[str] = field(default_factory=set)
    """Peers that answered 401/403: not asked again in this fetch."""
    failed: Counter[str] = field(default_factory=Counter)
    """Failed tries per peer in this fetch: a peer that failed is asked again only after the others."""


@dataclass
class _File:
    """The state of one file across its pieces and hash checks."""

    entry: FileEntry
    holders: list[Peer]
    meter: ProgressMeter
    counted: int = 0
    """Bytes of this file counted in the progress (taken back when a copy fails its check)."""
    senders: set[str] = field(default_factory=set)
    """Peers that sent pieces of the current copy."""
    suspects: set[str] = field(default_factory=set)
    """Peers that sent pieces of a copy that failed its check: asked last."""
    running: RunningHash | None = None
    reason: str = ""

    def arrived(self, n: int) -> None:
        self.counted += n
        self.meter.advance(n)


class Fetcher:
    def __init__(
        self,
        key: bytes,
        node_id: str,
        cache: HashCache,
        *,
        board: ProgressBoard | None = None,
        policy: FetchPolicy | None = None,
    ) -> None:
        self._key, self._node_id, self._cache = key, node_id, cache
        self.board = board or ProgressBoard()
        self.policy = policy or FetchPolicy()
        self._locks: dict[Path, trio.Lock] = {}
        widen_http_reads()

    async def fetch(
        self,
        manifest: Manifest,
        target: Path,
        peers: Sequence[Peer],
        *,
        paths: Collection[str] | None = None,
        hub: HubRef | None = None,
        model: str = "",
    ) -> Path:
        """The folder holding `paths` (default: every file) of `manifest`, checked: `target`, or the
        hub's folder when the hub had to supply the model. Raises FetchError."""
        wanted = manifest.files if paths is None else manifest.subset(paths)
        async with self._lock(target):
            return await self._fetch(manifest, target, peers, wanted, hub, model, publish=True)

    async def fetch_stage(
        self,
        manifest: Manifest,
        target: Path,
        peers: Sequence[Peer],
        *,
        start: int,
        end: int,
        hub: HubRef | None = None,
        model: str = "",
    ) -> Path:
        """`fetch` of what a stage running layers `[start, end)` needs: first the small files
        (config, tokenizer, weight index) into staging, then only the shards holding its tensors;
        the target gets them all at once. When the hub supplied the small files, it supplies the
        shards too (only those), into its own folder."""
        async with self._lock(target):
            meta = manifest.subset(metadata_paths(manifest))
            folder = await self._fetch(manifest, target, peers, meta, hub, model, publish=False)

            def read(path: str) -> object:
                if folder != target or (target / path).is_file():
                    return folders.read_json(folder / path)
                return folders.read_json(folders.staging_dir(target) / path)

            index = await trio.to_thread.run_sync(read, INDEX_FILE) if manifest.entry(INDEX_FILE) else None
            config = await trio.to_thread.run_sync(read, "config.json")
            wanted = manifest.subset(stage_paths(manifest, index, config, start=start, end=end))
            if hub is not None and folder != target:
                return await self._from_hub(manifest, hub, wanted)
            return await self._fetch(manifest, target, peers, wanted, hub, model, publish=True)

    def _lock(self, target: Path) -> trio.Lock:
        """One fetch per target at a time: two stages on one node wanting one model fetch it once."""
        return self._locks.setdefault(target, trio.Lock())

    async def _fetch(
        self,
        manifest: Manifest,
        target: Path,
        peers: Sequence[Peer],
        wanted: Sequence[FileEntry],
        hub: HubRef | None,
        model: str,
        *,
        publish: bool,
    ) -> Path:
        name = model or (hub.repo_id if hub else manifest.id[:12])
        staging = folders.staging_dir(target)
        todo, staged = await trio.to_thread.run_sync(folders.inventory, self._cache, target, staging, wanted)
        homeless = [e.path for e in todo if not any(p.holds(e.path) for p in peers)]
        if homeless:
            if hub is None:
                raise FetchError(
                    f"{name}: no peer holds {homeless[0]!r} (and {len(homeless) - 1} more), "
                    "and the model has no Hugging Face repo to fall back on"
                )
            return await self._from_hub(manifest, hub, wanted)
        if todo:
            await self._from_peers(manifest, staging, todo, peers, name)
        if publish and (todo or staged):
            await trio.to_thread.run_sync(folders.publish, self._cache, staging, target)
        return target

    async def _from_hub(self, manifest: Manifest, hub: HubRef, wanted: Sequence[FileEntry]) -> Path:
        """The hub's folder with `wanted` downloaded (only they) and checked against the manifest."""
        return await fetch_from_hub(
            hub.repo_id,
            hub.data_dir,
            self._cache,
            revision=hub.revision,
            expected=wanted,
            manifest_id=manifest.id,
            board=self.board,
        )

    # --- peers ------------------------------------------------------------------------------------
    async def _from_peers(
        self, manifest: Manifest, staging: Path, todo: list[FileEntry], peers: Sequence[Peer], name: str
    ) -> None:
        policy = self.policy
        meter = self.board.start(
            manifest_id=manifest.id,
            model=name,
            source="peers",
            bytes_total=sum(e.size for e in todo),
            files_total=len(todo),
        )
        timeout = httpx.Timeout(policy.idle_timeout_s, connect=policy.connect_timeout_s)
        limits = httpx.Limits(max_connections=policy.streams * 2, max_keepalive_connections=policy.streams)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            parts, limiter = staging / folders.PARTS_DIR, trio.CapacityLimiter(policy.streams)
            run = _Run(manifest, parts, staging, client, meter, limiter)
            jobs = [
                functools.partial(self._file, run, entry, [p for p in peers if p.holds(entry.path)])
                for entry in todo
            ]
            try:
                await _all_or_first_error(jobs)
            except FetchError as exc:
                meter.fail(str(exc))
                raise
        meter.finish()

    async def _file(self, run: _Run, entry: FileEntry, holders: list[Peer]) -> None:
        """One file into the staging folder, its hash checked; fetched again (suspects last) when
        the check fails, at most `attempts` times."""
        dest = run.staging / entry.path
        if entry.size == 0:
            if entry.sha256 != EMPTY_SHA256:
                raise FetchError(f"{entry.path}: the manifest gives an empty file a non-empty hash")
            await trio.to_thread.run_sync(folders.write_empty, dest)
            run.meter.file_done()
            return
        state = _File(entry, holders, run.meter)
        backoff = Backoff(self.policy.backoff)
        for _check in range(self.policy.attempts):
            ways = min(len(holders), self.policy.streams)
            split = await trio.to_thread.run_sync(
                pieces.pieces_for, run.parts, entry.path, entry.size, ways, self.policy.min_piece_bytes
            )
            on_disk = sum(
                [await trio.to_thread.run_sync(pieces.received, run.parts, entry.path, p) for p in split]
            )
            run.meter.resumed(on_disk - state.counted)  # bytes of an earlier run: progress, not rate
            state.counted, state.senders = on_disk, set()
            state.running = RunningHash() if len(split) == 1 else None
            jobs = [
                functools.partial(self._piece, run, state, piece, turn) for turn, piece in enumerate(split)
            ]
            await _all_or_first_error(jobs)
            whole = await trio.to_thread.run_sync(pieces.join, run.parts, entry.path, split)
            if state.running is not None and state.running.length == entry.size:
                sha = state.running.hexdigest()
            else:  # pieces, or a part that was complete before this run: read it back
                sha = await trio.to_thread.run_sync(file_sha256, whole)
            if sha == entry.sha256:
                await trio.to_thread.run_sync(folders.place, self._cache, whole, dest, sha)
                run.meter.file_done()
                return
            await trio.to_thread.run_sync(pieces.discard, run.parts, entry.path, split)
            run.meter.advance(-state.counted)
            state.counted = 0
            state.suspects |= state.senders
            state.reason = (
                f"hash mismatch (got {sha[:12]}, want {entry.sha256[:12]}) from {sorted(state.senders)}"
            )
            log.warning("%s: %s; fetching it again", entry.path, state.reason)
            await trio.sleep(backoff.failed(trio.current_time()))
        raise FetchError(
            f"{entry.path}: {self.policy.attempts} copies failed the hash check; the last: {state.reason}"
        )

    async def _piece(self, run: _Run, state: _File, piece: pieces.Piece, turn: int) -> None:
        """One piece, retried over the holders (suspects of a bad copy last, then those that failed
        most); raises FetchError when the tries are spent."""
        policy, entry, holders = self.policy, state.entry, state.holders
        backoff = Backoff(policy.backoff)
        missing: set[str] = set()
        reasons: list[str] = []
        # Each piece has a peer of its own (files spread by a hash of their path, the pieces of one
        # file over consecutive peers), taken unless it failed; the next one in turn after it.
        preferred = zlib.crc32(entry.path.encode()) + turn
        for _attempt in range(policy.attempts):
            usable = [p for p in holders if p.node_id not in missing and p.node_id not in run.refused]
            if not usable:
                raise FetchError(
                    f"{entry.path}: no peer can send it ({'; '.join(reasons) or 'none holds it'})"
                )
            peer = min(
                usable,
                key=lambda p: (
                    p.node_id in state.suspects,
                    run.failed[p.node_id],
                    (holders.index(p) - preferred) % len(holders),
                ),
            )
            left = piece.length - await trio.to_thread.run_sync(pieces.received, run.parts, entry.path, piece)
            backoff.started(trio.current_time())
            try:
                async with run.limiter:
                    run.load[peer.node_id] += 1
                    run.meter.peers = sum(1 for n in run.load.values() if n)
                    state.senders.add(peer.node_id)
                    try:
                        with trio.fail_after(max(60.0, left / policy.min_rate_bps)):
                            await download_piece(
                                run.client,
                                peer,
                                run.manifest.id,
                                entry.path,
                                entry.size,
                                piece,
                                run.parts,
                                signer=self._signer,
                                on_bytes=state.arrived,
                                write_bytes=policy.write_bytes,
                                running=state.running,
                            )
                    finally:
                        run.load[peer.node_id] -= 1
                        run.meter.peers = sum(1 for n in run.load.values() if n)
                return
            except PieceMissing:
                missing.add(peer.node_id)
                reasons.append(f"{peer.node_id} does not hold it")
                continue
            except PieceRefused as exc:
                run.refused.add(peer.node_id)
                reasons.append(f"{peer.node_id} refused us: {exc}")
                log.warning("%s refused to send %s: %s", peer.node_id, entry.path, exc)
                continue
            except (PieceFailed, trio.TooSlowError) as exc:
                reasons.append(f"{peer.node_id}: {exc or 'too slow'}")
                run.failed[peer.node_id] += 1
            delay = backoff.failed(trio.current_time())
            log.info(
                "%s from %s failed (%s); next try in %.1f s", entry.path, peer.node_id, reasons[-1], delay
            )
            await trio.sleep(delay)
        raise FetchError(f"{entry.path}: {policy.attempts} tries failed; the last: {reasons[-1]}")

    def _signer(self, method: str, url_path: str) -> dict[str, str]:
        return sign(self._key, method, url_path, self._node_id, time.time())


async def _all_or_first_error(jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run `jobs` at once; the first to fail cancels the others, and its FetchError is raised alone
    (a disk error becomes one). Their bytes on disk stay for the next fetch."""
    failures: list[FetchError] = []
    async with trio.open_nursery() as nursery:

        async def one(job: Callable[[], Awaitable[None]]) -> None:
            try:
                await job()
            except FetchError as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()
            except OSError as exc:
                failures.append(FetchError(f"writing the model to disk failed: {exc}"))
                nursery.cancel_scope.cancel()

        for job in jobs:
            nursery.start_soon(one, job)
    if failures:
        raise failures[0]
