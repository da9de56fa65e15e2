"""One piece of one file from one peer: a signed `GET` with `Range`, appended to its part file.

The I/O shell under the fetcher. It never retries and never picks a peer; it says how the attempt
ended, as one of three exceptions the fetcher tells apart:

- `PieceMissing`: the peer does not hold the file (404): try another peer, no fault of anyone's;
- `PieceRefused`: the peer refused us (401/403: another cluster secret, or clocks too far apart):
  no other file will work there either;
- `PieceFailed`: anything else (connection, timeout, 5xx, a wrong `Content-Range`, too few or too
  many bytes): worth another try after a pause.

Bytes are appended as they come (in `write_bytes` batches, in a worker thread), so whatever
arrived before a failure stays on disk and the next attempt asks only for the rest. A file that
comes in one piece is hashed on the way (`RunningHash`), so it is not read again to be checked.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

import httpcore._async.http11
import httpx
import trio

from node.files.pieces import Piece, part_file, received
from protocol.model_files import file_url_path

Signer = Callable[[str, str], dict[str, str]]
"""`signer(method, url_path) -> headers`: `node.files.signing.sign` with the key and node id bound."""

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_ERROR_TEXT_BYTES = 300


HTTP_READ_BYTES = 1 << 20
"""httpcore reads a response 64 KiB at a time (`READ_NUM_BYTES`); on loopback that caps one
stream at ~270 MB/s of CPU, 1 MiB reads give ~600 MB/s (measured with bench/transfer.py's server)."""


def widen_http_reads() -> None:
    """Make httpcore read `HTTP_READ_BYTES` per call (process-wide: it is a class attribute, and
    larger reads only cost a larger buffer per call). Idempotent; a no-op if httpcore changes."""
    connection = getattr(httpcore._async.http11, "AsyncHTTP11Connection", None)
    if connection is not None and getattr(connection, "READ_NUM_BYTES", 0) < HTTP_READ_BYTES:
        connection.READ_NUM_BYTES = HTTP_READ_BYTES


class RunningHash:
    """The SHA-256 of a part file, kept up to date as bytes are appended to it."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self.length = 0

    def catch_up(self, part: Path, length: int) -> None:
        """Hash the first `length` bytes of `part` unless that is what the digest covers already
        (after a restart, or a part file emptied as broken). Blocking."""
        if self.length == length:
            return
        self._digest, self.length = hashlib.sha256(), 0
        with open(part, "rb") as handle:
            while self.length < length and (chunk := handle.read(min(1 << 20, length - self.length))):
                self.update(chunk)

    def update(self, data: bytes) -> None:
        self._digest.update(data)
        self.length += len(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


@dataclass(frozen=True)
class Peer:
    """A node to fetch from: its id, the base URL of its HTTP API, and which files it holds."""

    node_id: str
    url: str
    """e.g. `http://10.0.0.2:52415`: the `api_url` of the node's profile."""
    paths: frozenset[str] | None = None
    """The manifest paths it holds; None: all of them."""

    def holds(self, path: str) -> bool:
        return self.paths is None or path in self.paths


class FetchError(Exception):
    """A whole fetch failed after its retries; the message names the model, the file and why."""


class PieceFailed(Exception):
    """The attempt failed in a way another attempt may not; the message says how."""


class PieceRefused(PieceFailed):
    """The peer answered 401/403: it does not take us for a member of its cluster."""


class PieceMissing(Exception):
    """The peer does not hold the file."""


async def download_piece(
    client: httpx.AsyncClient,
    peer: Peer,
    manifest_id: str,
    path: str,
    file_size: int,
    piece: Piece,
    parts_dir: Path,
    *,
    signer: Signer,
    on_bytes: Callable[[int], None],
    write_bytes: int,
    running: RunningHash | None = None,
) -> None:
    """Complete `piece` of `path` in its part file, from what is already there (and keep `running`
    up to date with it). Raises one of the exceptions above; returns only when the part file holds
    the whole piece."""
    have = await trio.to_thread.run_sync(received, parts_dir, path, piece)
    if have == piece.length:
        return
    part = part_file(parts_dir, path, piece)
    if running is not None:
        await trio.to_thread.run_sync(running.catch_up, part, have)
    first, last = piece.start + have, piece.end - 1
    url_path = file_url_path(manifest_id, path)
    headers = {**signer("GET", url_path), "range": f"bytes={first}-{last}", "accept-encoding": "identity"}
    part.parent.mkdir(parents=True, exist_ok=True)
    expected, got = last - first + 1, 0
    try:
        async with client.stream("GET", peer.url.rstrip("/") + quote(url_path), headers=headers) as response:
            await _check_answer(response, first, last, file_size)
            with open(part, "ab") as out:
                batch: list[bytes] = []
                batched = 0
                async for chunk in response.aiter_raw():
                    got += len(chunk)
                    if got > expected:
                        raise PieceFailed(f"sent more than the {expected} bytes asked for")
                    batch.append(chunk)
                    batched += len(chunk)
                    if batched >= write_bytes:
                        await _write(out, batch, on_bytes, running)
                        batch, batched = [], 0
                await _write(out, batch, on_bytes, running)
    except httpx.HTTPError as exc:
        raise PieceFailed(
            f"{type(exc).__name__}: {exc or 'no detail'} after {got} of {expected} bytes"
        ) from exc
    if got != expected:
        raise PieceFailed(f"the answer ended after {got} of {expected} bytes")


async def _write(
    out: BinaryIO, batch: list[bytes], on_bytes: Callable[[int], None], running: RunningHash | None
) -> None:
    """Append a batch in a worker thread (a slow disk must not stall the node's event loop); the
    running hash sees exactly the bytes written (the thread is never abandoned midway)."""
    if not batch:
        return
    data = b"".join(batch)

    def write() -> None:
        out.write(data)
        out.flush()
        if running is not None:
            running.update(data)

    with trio.CancelScope(shield=True):  # the write completes anyway: count it, then be cancelled
        await trio.to_thread.run_sync(write)
    on_bytes(len(data))


async def _check_answer(response: httpx.Response, first: int, last: int, file_size: int) -> None:
    status = response.status_code
    if status == 206:
        match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
        if match is None or (int(match[1]), int(match[2]), int(match[3])) != (first, last, file_size):
            got = response.headers.get("content-range")
            raise PieceFailed(f"asked for bytes {first}-{last}/{file_size}, the answer holds {got!r}")
        return
    head = b""
    async for chunk in response.aiter_raw():  # an error body: its start is enough to report
        head += chunk
        if len(head) >= _ERROR_TEXT_BYTES:
            break
    text = head[:_ERROR_TEXT_BYTES].decode("utf-8", "replace")
    if status == 404:
        raise PieceMissing(text)
    if status in (401, 403):
        raise PieceRefused(f"HTTP {status}: {text}")
    raise PieceFailed(f"HTTP {status}: {text}")
