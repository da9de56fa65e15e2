"""Only cluster members get model files: signed requests, 401/403 in OpenAI's shape, no bytes otherwise."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from node.files import Fetcher, FetchError, FileServer, HashCache, Peer, folder_manifest
from node.files.signing import MAC_HEADER, MAX_SKEW_S, NODE_HEADER, TIME_HEADER, RequestChecker, sign
from node.net.auth import derive_key
from protocol.model_files import file_url_path
from tests.file_peers import CLUSTER, KEY, SECRET, file_app, file_peer, run, serving, write_files

WEIGHTS = os.urandom(50_000)


def holder(tmp_path: Path) -> Path:
    folder = tmp_path / "holder"
    write_files(folder, {"config.json": b"{}", "model.safetensors": WEIGHTS})
    return folder


def test_the_route_answers_members_only(tmp_path: Path) -> None:
    async def main() -> None:
        async with file_peer(holder(tmp_path)) as (url, served, manifest), httpx.AsyncClient() as client:
            path = file_url_path(manifest.id, "model.safetensors")

            async def get(headers: dict[str, str], method: str = "GET", at: str = path) -> httpx.Response:
                return await client.request(method, url + at, headers=headers)

            now = time.time()
            signed = sign(KEY, "GET", path, "n", now)
            refused = [
                ("unsigned", {}, 401),
                ("wrong secret", sign(derive_key(CLUSTER, b"guess"), "GET", path, "n", now), 403),
                ("another cluster", sign(derive_key("other", SECRET), "GET", path, "n", now), 403),
                ("stale", sign(KEY, "GET", path, "n", now - MAX_SKEW_S - 5), 403),
                ("from the future", sign(KEY, "GET", path, "n", now + MAX_SKEW_S + 5), 403),
                ("another path", sign(KEY, "GET", file_url_path(manifest.id, "config.json"), "n", now), 403),
                ("another method", sign(KEY, "HEAD", path, "n", now), 403),
                ("malformed time", {**signed, TIME_HEADER: "soon"}, 401),
                ("no node id", {**signed, NODE_HEADER: ""}, 401),
            ]
            for why, headers, status in refused:
                response = await get(headers)
                assert response.status_code == status, why
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error", why
                assert error["code"] == ("unauthenticated" if status == 401 else "forbidden"), why
                assert WEIGHTS[:64] not in response.content
            assert all(r.body_bytes < 300 for r in served.requests)  # error bodies only

            # Refused before anything is looked up: a stranger cannot even probe which models exist.
            assert (await get({}, at=file_url_path("0" * 64, "x"))).status_code == 401
            assert (
                await get(sign(KEY, "GET", p := file_url_path("0" * 64, "x"), "n", now), at=p)
            ).status_code == 404

            ok = await get({**sign(KEY, "GET", path, "n", now), "range": "bytes=10-19"})
            assert (ok.status_code, ok.content) == (206, WEIGHTS[10:20])
            head = await get(sign(KEY, "HEAD", path, "n", now), method="HEAD")
            assert (head.status_code, head.headers["content-length"], head.content) == (
                200,
                str(len(WEIGHTS)),
                b"",
            )

    run(main)


def test_a_fetcher_with_another_secret_gets_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with file_peer(holder(tmp_path)) as (url, served, manifest):
            stranger = Fetcher(derive_key(CLUSTER, b"wrong"), "12D3KooWstranger", HashCache(None))
            with pytest.raises(FetchError, match="refused us: HTTP 403"):
                await stranger.fetch(manifest, tmp_path / "got", [Peer("holder", url)])
            assert not (tmp_path / "got").exists()
            assert len(served.requests) <= len(manifest.files)  # refused once, not retried
            assert {r.status for r in served.requests} == {403}

    run(main)


def test_only_listed_members_and_unchanged_files_are_served(tmp_path: Path) -> None:
    folder = holder(tmp_path)
    manifest = folder_manifest(folder, HashCache(None))
    server = FileServer(KEY, members=lambda: {"12D3KooWmember"})
    assert server.offer(manifest, folder) == {"config.json", "model.safetensors"}
    path = file_url_path(manifest.id, "config.json")
    assert server.authorize(sign(KEY, "GET", path, "12D3KooWmember", time.time()), "GET", path) == "ok"
    assert server.authorize(sign(KEY, "GET", path, "12D3KooWgone", time.time()), "GET", path) == "forbidden"

    assert server.locate(manifest.id, "config.json") == folder / "config.json"
    assert server.locate(manifest.id, "../holder/config.json") is None
    (folder / "config.json").write_bytes(b"[]")  # changed since offered: it no longer is that file
    assert server.locate(manifest.id, "config.json") is None
    assert server.offered() == {manifest.id: {"config.json", "model.safetensors"}}
    server.withdraw(manifest.id)
    assert server.locate(manifest.id, "model.safetensors") is None

    async def main() -> None:
        async with serving(file_app(server)) as url, httpx.AsyncClient() as client:
            headers = sign(KEY, "GET", path, "12D3KooWgone", time.time())
            assert (await client.get(url + path, headers=headers)).status_code == 403

    run(main)


def test_the_checker_is_constant_in_what_it_accepts() -> None:
    clock = [1_000_000.0]
    checker = RequestChecker(KEY, clock=lambda: clock[0], max_skew_s=10)
    headers = sign(KEY, "get", "/v1/files/x/y", "node", clock[0])
    assert checker.check(headers, "GET", "/v1/files/x/y") == "ok"  # the method's case does not matter
    assert checker.check({**headers, MAC_HEADER: headers[MAC_HEADER].upper()}, "GET", "/v1/files/x/y") == "ok"
    assert checker.check({**headers, MAC_HEADER: "é" * 64}, "GET", "/v1/files/x/y") == "unauthenticated"
    clock[0] += 11
    assert checker.check(headers, "GET", "/v1/files/x/y") == "forbidden"
