"""Peers that serve model files, for tests and `bench/transfer.py`: the real route (`api.files`) over
a real `FileServer`, on hypercorn in the caller's trio loop, as a node serves its API.

`Recorder` wraps the app to see what went over the wire: each request's path, `Range`, status and
the body bytes actually sent; it can also flip one byte of the first answers (a corrupted copy) or
pause after each chunk (a slow link, so a test can cut a transfer half way).

`python -m tests.file_peers fetch ARGS.json` runs one fetch in its own process, so that a test can
kill it with SIGKILL mid-transfer, as a crashed node would be.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import EXCEPTION_HANDLERS
from api.files import FileRoutes, FileSource
from node.files import Fetcher, FileServer, HashCache, Peer, folder_manifest
from node.net.auth import derive_key
from protocol.manifest import Manifest

CLUSTER = "files-test"
SECRET = b"the cluster secret"
KEY = derive_key(CLUSTER, SECRET)


@dataclass
class Served:
    path: str
    range: str | None
    status: int = 0
    body_bytes: int = 0


class Recorder:
    """An ASGI wrapper that records every request (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, corrupt_first: int = 0, pause_per_chunk_s: float = 0.0) -> None:
        self.app = app
        self.requests: list[Served] = []
        self.corrupt_left = corrupt_first
        self.pause_per_chunk_s = pause_per_chunk_s

    @property
    def body_bytes(self) -> int:
        return sum(r.body_bytes for r in self.requests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        served = Served(scope["path"], headers.get("range"))
        self.requests.append(served)
        corrupt = False

        async def recording_send(message: Message) -> None:
            nonlocal corrupt
            if message["type"] == "http.response.start":
                served.status = message["status"]
                corrupt = self.corrupt_left > 0 and served.status in (200, 206)
                self.corrupt_left -= corrupt
            elif message["type"] == "http.response.body" and (body := message.get("body", b"")):
                if corrupt:
                    flipped = bytearray(body)
                    flipped[len(flipped) // 2] ^= 0xFF
                    message = {**message, "body": bytes(flipped)}
                    corrupt = False
                served.body_bytes += len(body)
                await send(message)
                if self.pause_per_chunk_s:
                    await trio.sleep(self.pause_per_chunk_s)
                return
            await send(message)

        await self.app(scope, receive, recording_send)


def file_app(source: FileSource) -> Starlette:
    """Only the files route, with the API's error handlers: what `create_app` will include."""
    return Starlette(routes=FileRoutes(source).routes(), exception_handlers=EXCEPTION_HANDLERS)


@asynccontextmanager
async def serving(app: ASGIApp) -> AsyncIterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) until the block ends; yields its base URL."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.graceful_timeout = 0.5
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        asgi = cast(Any, app)  # starlette's and hypercorn's ASGI types differ in name only
        binds = await nursery.start(functools.partial(serve, asgi, config, shutdown_trigger=stop.wait))
        try:
            yield binds[0]
        finally:
            stop.set()


@asynccontextmanager
async def file_peer(
    folder: Path,
    *,
    key: bytes = KEY,
    corrupt_first: int = 0,
    pause_per_chunk_s: float = 0.0,
    derived_from: Path | None = None,
) -> AsyncIterator[tuple[str, Recorder, Manifest]]:
    """A node holding the model in `folder` (imported from the .gguf `derived_from`): yields its
    URL, what it served, and the manifest."""
    manifest = folder_manifest(folder, HashCache(None), derived_from=derived_from)
    server = FileServer(key)
    server.offer(manifest, folder)
    recorder = Recorder(file_app(server), corrupt_first=corrupt_first, pause_per_chunk_s=pause_per_chunk_s)
    async with serving(recorder) as url:
        yield url, recorder, manifest


def run(fn: Callable[[], Awaitable[object]], limit_s: float = 30) -> None:
    """`trio.run(fn)` within `limit_s` seconds."""

    async def main() -> None:
        with trio.fail_after(limit_s):
            await fn()

    trio.run(main)


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def sharded_model(num_layers: int, shard_bytes: int) -> dict[str, bytes]:
    """A model folder's files: config, tokenizer, a weight index and one shard per layer (random
    bytes: the transfer never parses them), the embedding in the first, norm and head in the last."""
    shards = [f"model-{i + 1:05d}-of-{num_layers:05d}.safetensors" for i in range(num_layers)]
    weight_map: dict[str, str] = {"model.embed_tokens.weight": shards[0]}
    for i, shard in enumerate(shards):
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight"):
            weight_map[f"model.layers.{i}.{name}"] = shard
    weight_map |= {"model.norm.weight": shards[-1], "lm_head.weight": shards[-1]}
    config = {"model_type": "llama", "num_hidden_layers": num_layers, "tie_word_embeddings": False}
    files = {
        "config.json": json.dumps(config).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": weight_map}).encode(),
    }
    return files | {shard: os.urandom(shard_bytes) for shard in shards}


def _fetch_main(args_file: str) -> None:
    """One fetch with the arguments in a JSON file: manifest, target, peer url, node id."""
    args: dict[str, Any] = json.loads(Path(args_file).read_text())
    manifest = Manifest.model_validate(args["manifest"])
    fetcher = Fetcher(KEY, args["node_id"], HashCache(None))
    peers = [Peer(f"peer{i}", url) for i, url in enumerate(args["peers"])]
    trio.run(fetcher.fetch, manifest, Path(args["target"]), peers)


if __name__ == "__main__":
    if sys.argv[1:2] != ["fetch"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.file_peers fetch ARGS.json")
    _fetch_main(sys.argv[2])
