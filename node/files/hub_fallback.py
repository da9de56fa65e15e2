"""The hub as the last resort: a model no peer holds comes from Hugging Face, as before this package.

The download itself is `node.models.hub.download_hub_model` (huggingface_hub's `snapshot_download`
into `<data_dir>/models/hf/<org>--<name>/`, resumable, `HF_ENDPOINT` honoured); this adds what a
cluster transfer needs around it: progress (bytes on disk in that folder, polled, since the
library reports only to its own progress bar), a check of the downloaded files against the
cluster's manifest when there is one, and `HF_HUB_OFFLINE=1` read as "peers only": a repo not
already complete on disk is then a `FetchError` that says so, and nothing is tried on the network.

The hub has no notion of stages: it downloads the whole repo (the same files mlx-lm would).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import trio

from node.files.download import FetchError
from node.files.hashing import HashCache
from node.files.progress import ProgressBoard, ProgressMeter
from node.models.hub import download_hub_model, hub_model_dir, hub_offline
from node.models.store import ModelResolveError, dir_size
from protocol.manifest import FileEntry

log = logging.getLogger("shoal.files")

POLL_S = 0.5
"""How often the hub folder's size is read for progress (one directory walk)."""


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

    `expected` are the files the caller needs, from the cluster's manifest: each must be in the
    folder with that size and SHA-256 afterwards, else FetchError (the repo changed since the
    manifest was made). Every failure is a FetchError naming the repo and the reason.
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
        folder = await _download(repo_id, data_dir, revision, meter, offline=offline)
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
    repo_id: str, data_dir: Path, revision: str | None, meter: ProgressMeter, *, offline: bool
) -> Path:
    done = trio.Event()

    async def poll() -> None:
        folder = hub_model_dir(repo_id, data_dir)
        while not done.is_set():  # ends with the download (bounded by huggingface_hub's timeouts)
            meter.set_done(await trio.to_thread.run_sync(dir_size, folder))
            with trio.move_on_after(POLL_S):
                await done.wait()

    def download() -> Path:
        return download_hub_model(repo_id, data_dir, revision=revision)

    failure: ModelResolveError | None = None
    folder: Path | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        try:
            # abandon_on_cancel: a node shutting down must not wait for a multi-GB download
            folder = await trio.to_thread.run_sync(download, abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stubs are older
        except ModelResolveError as exc:
            failure = exc
        finally:
            done.set()
    if folder is not None:
        return folder
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
