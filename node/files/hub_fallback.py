"""The hub as the last resort: a model no peer holds comes from Hugging Face, as before this package.

The download itself is `node.models.hub.download_hub_model` (huggingface_hub's `snapshot_download`
into `<data_dir>/models/hf/<org>--<name>/`, resumable, `HF_ENDPOINT` honoured); this adds what a
cluster transfer needs around it: progress (bytes on disk in that folder, polled, since the
library reports only to its own progress bar), a check of the downloaded files against the
cluster's manifest when there is one, and `HF_HUB_OFFLINE=1` read as "peers only": a repo not
already complete on disk is then a `FetchError` that says so, and nothing is tried on the network.

Given the files a caller needs (`expected`, from the manifest: a stage's config, tokenizer and
shards), only those are downloaded (`allow_patterns`); without, the files mlx-lm would download.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from node.files.download import FetchError
from node.files.hashing import HashCache
from node.files.progress import ProgressBoard, ProgressMeter
from node.models.hub import ALLOW_PATTERNS, download_hub_model, exact_patterns, hub_model_dir, hub_offline
from node.models.store import ModelResolveError, dir_size
from protocol.manifest import FileEntry

log = logging.getLogger("shoal.files")

POLL_S = 0.5
"""How often the hub folder's size is read for progress (one directory walk)."""


@dataclass(frozen=True)
class HubRef:
    """Where the hub fallback finds a model: a Hugging Face repo, downloaded into the data dir."""

    repo_id: str
    data_dir: Path
    revision: str | None = None


async def fetch_from_hub(
    repo_id: str,
    data_dir: Path,
    cache: HashCache,
    *,
    revision: str | None = None,
    expected: Sequence[FileEntry] = (),
    manifest_id: str = "",
    board: ProgressBoard | None = None,
) -> Path:
    """The folder of `repo_id` in the data dir, downloaded first unless already complete.

    `expected` are the files the caller needs, from the cluster's manifest: only they are
    downloaded, and each must be in the folder with that size and SHA-256 afterwards, else
    FetchError (the repo changed since the manifest was made). Without them, the whole model comes.
    Every failure is a FetchError naming the repo and the reason.
    """
    offline = hub_offline()
    meter = (board or ProgressBoard()).start(
        manifest_id=manifest_id,
        model=repo_id,
        source="hub",
        bytes_total=sum(e.size for e in expected),
        files_total=len(expected),
    )
    try:
        patterns = exact_patterns([e.path for e in expected]) if expected else ALLOW_PATTERNS
        folder = await _download(repo_id, data_dir, revision, patterns, meter, offline=offline)
        if bad := await trio.to_thread.run_sync(_mismatches, folder, expected, cache):
            raise FetchError(
                f"{repo_id} on the hub differs from the cluster's manifest: {bad[0]!r} (and {len(bad) - 1} "
                "more) has another size or hash; the repo changed since the manifest was made"
            )
    except FetchError as exc:
        meter.fail(str(exc))
        raise
    meter.finish()
    return folder


async def _download(
    repo_id: str,
    data_dir: Path,
    revision: str | None,
    patterns: Sequence[str],
    meter: ProgressMeter,
    *,
    offline: bool,
) -> Path:
    done = trio.Event()
    folder = hub_model_dir(repo_id, data_dir)
    before = await trio.to_thread.run_sync(dir_size, folder)  # files of an earlier, other download

    async def poll() -> None:
        while not done.is_set():  # ends with the download (bounded by huggingface_hub's timeouts)
            meter.set_done(max(0, await trio.to_thread.run_sync(dir_size, folder) - before))
            with trio.move_on_after(POLL_S):
                await done.wait()

    def download() -> Path:
        return download_hub_model(repo_id, data_dir, revision=revision, allow_patterns=patterns)

    failure: ModelResolveError | None = None
    got: Path | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        try:
            # abandon_on_cancel: a node shutting down must not wait for a multi-GB download
            got = await trio.to_thread.run_sync(download, abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stubs are older
        except ModelResolveError as exc:
            failure = exc
        finally:
            done.set()
    if got is not None:
        return got
    if offline:
        raise FetchError(
            f"no peer holds the files of {repo_id} and HF_HUB_OFFLINE=1 allows peers only ({failure})"
        ) from failure
    raise FetchError(str(failure)) from failure


def _mismatches(folder: Path, expected: Sequence[FileEntry], cache: HashCache) -> list[str]:
    try:
        return [e.path for e in expected if not cache.matches(folder / e.path, e)]
    finally:
        cache.save()
