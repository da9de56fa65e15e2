"""Fetching a model's files from peers: real HTTP servers (the files route on hypercorn) on 127.0.0.1.

Every peer is `tests.file_peers.file_peer`: a `FileServer` offering a folder behind the real route,
wrapped in a `Recorder` that sees each request and the body bytes actually sent, so the tests count
bytes on the wire rather than trusting the fetcher's own account. Backoff is shortened (the delays'
schedule is `protocol.backoff`'s, tested there).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from node.files import Fetcher, FetchError, FetchPolicy, HashCache, Peer, cluster_model_dir, folder_manifest
from node.files.folders import PARTS_DIR, staging_dir
from protocol.backoff import BackoffPolicy
from tests.file_peers import KEY, file_peer, run, sharded_model, write_files
from tests.waiting import wait_until_async

QUICK = FetchPolicy(attempts=3, backoff=BackoffPolicy(min_s=0.01, max_s=0.05, jitter=0.0))
REPO_ROOT = Path(__file__).resolve().parent.parent


def fetcher(policy: FetchPolicy = QUICK) -> Fetcher:
    return Fetcher(KEY, "12D3KooWfetcher", HashCache(None), policy=policy)


def model_folder(tmp_path: Path, num_layers: int = 2, shard_bytes: int = 300_000) -> Path:
    folder = tmp_path / "holder" / "tiny"
    write_files(folder, sharded_model(num_layers, shard_bytes) | {"sub/chat_template.jinja": b"{{ x }}"})
    return folder


def same_files(a: Path, b: Path, paths: set[str]) -> bool:
    return all((a / p).read_bytes() == (b / p).read_bytes() for p in paths)


def test_a_model_moves_between_two_servers_checked_file_by_file(tmp_path: Path) -> None:
    source = model_folder(tmp_path)

    async def main() -> None:
        async with file_peer(source) as (url_a, served_a, manifest):
            target_b = cluster_model_dir(tmp_path / "b", manifest.id)
            got = await fetcher().fetch(manifest, target_b, [Peer("a", url_a)])
            assert got == target_b
            assert folder_manifest(target_b, HashCache(None)) == manifest
            assert not staging_dir(target_b).exists()
            assert served_a.body_bytes == manifest.total_bytes
            assert {r.status for r in served_a.requests} == {206}

            # B now serves what it fetched, to C; fetching again at B moves nothing.
            async with file_peer(target_b) as (url_b, served_b, manifest_b):
                assert manifest_b == manifest
                target_c = tmp_path / "c" / "model"
                await fetcher().fetch(manifest, target_c, [Peer("b", url_b)])
                assert same_files(source, target_c, {f.path for f in manifest.files})
                assert served_b.body_bytes == manifest.total_bytes
            assert await fetcher().fetch(manifest, target_b, [Peer("a", url_a)]) == target_b
            assert served_a.body_bytes == manifest.total_bytes

    run(main)


def test_a_corrupted_byte_is_caught_and_the_file_fetched_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = model_folder(tmp_path, num_layers=1)

    async def main() -> None:
        async with file_peer(source, corrupt_first=1) as (url, served, manifest):
            target = tmp_path / "got"
            await fetcher().fetch(manifest, target, [Peer("a", url)])
            assert folder_manifest(target, HashCache(None)) == manifest
            fetched = [r.path.rsplit("/", 1)[-1] for r in served.requests]
            assert len(fetched) == len(manifest.files) + 1  # one file twice: the bad copy, then a good one
            assert served.body_bytes > manifest.total_bytes

    caplog.set_level(logging.WARNING, logger="shoal.files")
    run(main)
    assert any("hash mismatch" in r.getMessage() for r in caplog.records)


def test_a_peer_that_always_corrupts_fails_the_fetch_with_the_reason(tmp_path: Path) -> None:
    source = model_folder(tmp_path, num_layers=1)

    async def main() -> None:
        async with file_peer(source, corrupt_first=1000) as (url, _, manifest):
            target = tmp_path / "got"
            with pytest.raises(FetchError, match=r"3 copies failed the hash check; the last: hash mismatch"):
                await fetcher().fetch(manifest, target, [Peer("a", url)])
            assert not target.exists()  # nothing that failed its check is ever at the target

    run(main)


def test_a_killed_transfer_resumes_where_it_stopped(tmp_path: Path) -> None:
    source = tmp_path / "holder"
    size = 24 * 1024 * 1024
    write_files(source, {"config.json": b"{}", "model.safetensors": os.urandom(size)})
    target = tmp_path / "got" / "model"
    part = staging_dir(target) / PARTS_DIR / f"model.safetensors.0-{size}.part"

    async def main() -> None:
        # ~0.15 s per 1 MiB chunk: the transfer would take ~4 s; it is killed after a third.
        async with file_peer(source, pause_per_chunk_s=0.15) as (url, served, manifest):
            args = tmp_path / "args.json"
            plain = manifest.model_dump(mode="json")
            job = {"manifest": plain, "target": str(target), "peers": [url], "node_id": "12D3KooWkilled"}
            args.write_text(json.dumps(job))
            child = await trio.lowlevel.open_process(
                [sys.executable, "-m", "tests.file_peers", "fetch", str(args)], cwd=REPO_ROOT
            )
            try:
                await wait_until_async(
                    lambda: part.exists() and part.stat().st_size >= size // 3, 20, "a third"
                )
            finally:
                child.send_signal(signal.SIGKILL)
                await child.wait()
            kept = part.stat().st_size
            assert size // 3 <= kept < size
            assert not target.exists()
            sent_before = served.body_bytes
            served.pause_per_chunk_s = 0.0  # the rest may come at full speed

            await fetcher().fetch(manifest, target, [Peer("a", url)])
            resumed = [r for r in served.requests if r.path.endswith("model.safetensors")][-1]
            assert resumed.range == f"bytes={kept}-{size - 1}"
            assert resumed.body_bytes == size - kept  # only the rest moved
            assert served.body_bytes - sent_before == size - kept
            assert (target / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()

    run(main, limit_s=40)


def test_a_stage_fetches_only_its_shards(tmp_path: Path) -> None:
    source = model_folder(tmp_path, num_layers=4, shard_bytes=200_000)

    async def main() -> None:
        async with file_peer(source) as (url, served, manifest):
            meta = sum(f.size for f in manifest.files if not f.path.endswith(".safetensors"))
            target = tmp_path / "stage"
            await fetcher().fetch_stage(manifest, target, [Peer("a", url)], start=1, end=3)
            held = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
            shards = {f"model-0000{i}-of-00004.safetensors" for i in (2, 3)}
            assert {h for h in held if h.endswith(".safetensors")} == shards
            assert served.body_bytes == meta + 2 * 200_000

            # The first stage moves to this node too: only its other shard comes.
            await fetcher().fetch_stage(manifest, target, [Peer("a", url)], start=0, end=2)
            assert (target / "model-00001-of-00004.safetensors").is_file()
            assert served.body_bytes == meta + 3 * 200_000

    run(main)


def test_files_come_from_two_peers_at_once(tmp_path: Path) -> None:
    source = model_folder(tmp_path, num_layers=2, shard_bytes=2_000_000)
    policy = FetchPolicy(attempts=3, backoff=QUICK.backoff, min_piece_bytes=500_000)

    async def main() -> None:
        async with file_peer(source) as (url_a, a, manifest), file_peer(source) as (url_b, b, _):
            peers = [Peer("a", url_a), Peer("b", url_b)]
            target = tmp_path / "got"
            await fetcher(policy).fetch(manifest, target, peers)
            assert folder_manifest(target, HashCache(None)) == manifest
            # Each 2 MB shard came in two pieces, one from each peer; both peers sent half the weights.
            for served in (a, b):
                pieces = [r for r in served.requests if r.path.endswith(".safetensors")]
                assert len(pieces) == 2
                assert sum(r.body_bytes for r in pieces) == 2_000_000

    run(main)


def test_progress_is_seen_moving(tmp_path: Path) -> None:
    source = tmp_path / "holder"
    write_files(source, {"config.json": b"{}", "model.safetensors": os.urandom(6 * 1024 * 1024)})

    async def main() -> None:
        async with file_peer(source, pause_per_chunk_s=0.1) as (url, _, manifest):
            fetch = fetcher()
            seen = []

            def moving() -> bool:
                snaps = fetch.board.snapshots()
                if snaps and 0 < snaps[-1].bytes_done < snaps[-1].bytes_total and snaps[-1].rate_bps > 0:
                    seen.append(snaps[-1])
                return len(seen) >= 3 and seen[-1].bytes_done > seen[0].bytes_done

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch.fetch, manifest, tmp_path / "got", [Peer("a", url)])
                await wait_until_async(moving, 10, "progress moving", interval=0.05)
            assert seen[0].state == "fetching" and seen[0].peers == 1 and seen[0].source == "peers"
            [done] = fetch.board.snapshots()
            assert (done.state, done.bytes_done, done.files_done) == ("done", manifest.total_bytes, 2)

    run(main)


def test_a_dead_peer_is_retried_with_backoff_then_reported(tmp_path: Path) -> None:
    source = model_folder(tmp_path, num_layers=1)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens

    async def main() -> None:
        async with file_peer(source) as (url, served, manifest):
            # A dead peer beside a live one costs a retry, not the fetch.
            await fetcher().fetch(manifest, tmp_path / "ok", [Peer("dead", dead), Peer("live", url)])
            assert served.body_bytes == manifest.total_bytes

            fetch = fetcher()
            began = trio.current_time()
            with pytest.raises(FetchError, match=r"3 tries failed; the last: dead: ConnectError"):
                await fetch.fetch(manifest, tmp_path / "never", [Peer("dead", dead)])
            assert trio.current_time() - began >= 0.01 + 0.02  # two backoff pauses, not a tight loop
            assert fetch.board.snapshots()[-1].state == "failed"
            assert "ConnectError" in (fetch.board.snapshots()[-1].error or "")

    run(main)


def test_a_peer_without_the_file_sends_the_fetcher_to_another(tmp_path: Path) -> None:
    source = model_folder(tmp_path, num_layers=1)
    partial = tmp_path / "partial"
    write_files(partial, {"config.json": (source / "config.json").read_bytes()})

    async def main() -> None:
        async with file_peer(source) as (url, served, manifest), file_peer(partial) as (url_p, served_p, _):
            # `partial` offers a manifest of its own folder, so it holds none of this model's files.
            await fetcher().fetch(manifest, tmp_path / "got", [Peer("partial", url_p), Peer("full", url)])
            assert {r.status for r in served_p.requests} == {404}  # asked, answered "not here", skipped
            assert served.body_bytes == manifest.total_bytes
            with pytest.raises(FetchError, match="no peer holds"):
                await fetcher().fetch(manifest, tmp_path / "none", [Peer("a", url, paths=frozenset())])

    run(main)
