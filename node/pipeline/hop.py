"""The link between neighbouring pipeline stages: framed tensors over plain TCP.

Why plain TCP: a decode step moves one hidden state (hidden_size x 4 bytes) per hop, where
TCP_NODELAY on loopback costs ~40 us a round trip against ~1 ms for a libp2p stream, and unlike
MLX's ring backend a dead peer is an error here, not a spinning core or a hang.

The stages form a ring: the driver (first stage) sends to stage 1, each stage to the next, and the
last stage sends sampled tokens back to the driver. Each TCP connection carries data one way only,
from its `OutLink` (the connecting side) to its `InLink` (the accepting side).

Frame layout (all integers big-endian)::

    u32 length of the rest
    header: 2s magic "SP" | u8 version | u8 kind | u8 dtype | u64 request | u32 position
            | u32 meta length | u8 ndim
    ndim x u32 shape
    meta: UTF-8 JSON object (often empty: decode frames carry none)
    tensor: the raw bytes of a row-major array of `dtype` and `shape`

`position` is the cache offset of the tensor's first token, so a stage whose cache disagrees
refuses the step instead of computing garbage.

Liveness: an `OutLink` sends a HEARTBEAT whenever it has been quiet for `HEARTBEAT_INTERVAL`, and
an `InLink` treats `timeout` seconds without any frame as a dead or frozen neighbour. A stage busy
in a long MLX computation still heartbeats (MLX releases the GIL), so the timeout measures silence,
never work. Every failure surfaces as `HopError`; nothing here blocks without a bound.

`encode_frame`/`decode_frame` are pure; the link classes are the short I/O shell around them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, cast

import mlx.core as mx
import numpy as np

log = logging.getLogger("shoal.pipeline")

MAGIC = b"SP"
VERSION = 1
MAX_FRAME_BYTES = 1 << 30
"""A prefill chunk of 2048 tokens x 16384 hidden x float32 is 128 MiB; anything past 1 GiB is an
error, not a tensor."""
MAX_NDIM = 8
HEARTBEAT_INTERVAL = 0.5
"""Seconds of quiet after which an OutLink sends a heartbeat. Small against HOP_TIMEOUT so that a
few late heartbeats on a loaded machine do not look like a dead peer."""
HOP_TIMEOUT = 3.0
"""Seconds without any frame (data or heartbeat) before an InLink declares its neighbour dead or
frozen: 6 heartbeat intervals."""
CONNECT_TIMEOUT = 30.0
"""How long a dial keeps retrying a refused connection: the neighbour may still be loading."""

_PREFIX = struct.Struct(">I")
_HEADER = struct.Struct(">2sBBBQIIB")
_DIM = struct.Struct(">I")
_KIND_OFFSET = 3
"""Byte of the header holding the kind, after the magic and the version."""


class Kind(IntEnum):
    """Frame kinds. The numbers are on the wire: ONLY APPEND TO THIS LIST."""

    HELLO = 1
    """First frame on a new link; meta: {"layer": first layer the receiver must run, ...}."""
    PREFILL = 2
    """A prompt chunk (token ids for the first stage, hidden states after): fill the caches."""
    DECODE = 3
    """One position (the last prompt token or the previous sample): the last stage samples."""
    TOKEN = 4
    """Last stage -> driver: the sampled token id, an int32 tensor of shape (1,)."""
    ACK = 5
    """Last stage -> driver: a PREFILL chunk is in every stage's cache; position = new offset."""
    RESET = 6
    """The request ended: drop its caches. The last stage echoes it to the driver."""
    CANCEL = 7
    """The request was abandoned: drop its caches. The last stage echoes it to the driver."""
    ERROR = 8
    """A stage could not run a step; meta: {"message": ...}. Travels on to the driver."""
    HEARTBEAT = 9
    """Keeps a quiet link alive; consumed by the InLink, never delivered."""


_DTYPES: tuple[tuple[int, mx.Dtype], ...] = (
    (1, mx.float32),
    (2, mx.float16),
    (3, mx.bfloat16),
    (4, mx.int32),
    (5, mx.uint32),
)
_CODE_OF = {dtype: code for code, dtype in _DTYPES}
_DTYPE_OF = dict(_DTYPES)
_NO_TENSOR = 0


class HopError(Exception):
    """The link to a neighbouring stage failed: closed, reset, silent too long or sent garbage."""


class FrameError(HopError):
    """The other side sent bytes that are not a valid frame (a protocol violation)."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    request: int = 0
    position: int = 0
    tensor: mx.array | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)


def encode_frame(frame: Frame) -> list[bytes | memoryview]:
    """The frame as buffers to send in order: prefix+header+meta, then the tensor's own bytes."""
    meta = json.dumps(dict(frame.meta), separators=(",", ":")).encode() if frame.meta else b""
    payload: memoryview | None = None
    shape: tuple[int, ...] = ()
    code = _NO_TENSOR
    if frame.tensor is not None:
        tensor = frame.tensor
        if tensor.dtype not in _CODE_OF:
            raise ValueError(f"cannot send a {tensor.dtype} tensor between stages")
        code, shape = _CODE_OF[tensor.dtype], tuple(tensor.shape)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"cannot send a {len(shape)}-dimensional tensor")
        # Row-major bytes without a copy when already contiguous (evaluates the array).
        payload = memoryview(cast(Any, mx.contiguous(tensor).reshape(-1).view(mx.uint8)))
    header = _HEADER.pack(
        MAGIC, VERSION, frame.kind, code, frame.request, frame.position, len(meta), len(shape)
    ) + b"".join(_DIM.pack(d) for d in shape)
    length = len(header) + len(meta) + (payload.nbytes if payload is not None else 0)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    head = _PREFIX.pack(length) + header + meta
    return [head] if payload is None else [head, payload]


def decode_frame(body: bytes | bytearray | memoryview) -> Frame:
    """One frame from its bytes after the length prefix; `FrameError` when they are not one."""
    view = memoryview(body)
    try:
        magic, version, kind, code, request, position, meta_len, ndim = _HEADER.unpack_from(view)
        if magic != MAGIC or version != VERSION:
            raise FrameError(f"not a pipeline frame (magic {bytes(magic)!r}, version {version})")
        if ndim > MAX_NDIM:
            raise FrameError(f"tensor with {ndim} dimensions")
        offset = _HEADER.size
        shape = tuple(_DIM.unpack_from(view, offset + 4 * i)[0] for i in range(ndim))
        offset += 4 * ndim
        meta: dict[str, Any] = json.loads(bytes(view[offset : offset + meta_len])) if meta_len else {}
        if not isinstance(meta, dict):
            raise FrameError("frame meta is not a JSON object")
        offset += meta_len
        tensor: mx.array | None = None
        if code != _NO_TENSOR:
            dtype = _DTYPE_OF[code]
            size = dtype.size
            for d in shape:
                size *= d
            if len(view) - offset != size:
                raise FrameError(
                    f"tensor of shape {shape} needs {size} bytes, frame has {len(view) - offset}"
                )
            raw = np.frombuffer(view, np.uint8, count=size, offset=offset)
            tensor = mx.array(raw).view(dtype).reshape(shape)
        elif len(view) != offset:
            raise FrameError(f"{len(view) - offset} stray bytes after a frame without a tensor")
        return Frame(Kind(kind), request, position, tensor, meta)
    except FrameError:
        raise
    except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise FrameError(f"undecodable pipeline frame: {exc}") from exc


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read it back with getsockname)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(8)
    return listener


def accept(listener: socket.socket, *, timeout: float) -> socket.socket:
    """The next incoming connection within `timeout` seconds, else `HopError`."""
    listener.settimeout(timeout)
    try:
        sock, _ = listener.accept()
    except TimeoutError as exc:
        raise HopError(f"no stage connected within {timeout:.1f}s") from exc
    except OSError as exc:
        raise HopError(f"accept failed: {exc}") from exc
    sock.settimeout(None)
    return _nodelay(sock)


def dial(address: tuple[str, int], *, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """Connect to a stage, retrying refusals (it may still be loading) for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(left, HOP_TIMEOUT)))
        except OSError as exc:
            if time.monotonic() + delay >= deadline:
                raise HopError(f"cannot connect to stage {address[0]}:{address[1]}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        sock.settimeout(None)
        return _nodelay(sock)


def _detached(error: HopError) -> HopError:
    """A fresh copy of an error, to raise: a link keeps its failure and raises copies, so that no
    traceback (holding frames and the arrays they computed) stays attached to the link."""
    return type(error)(*error.args)


def _join(thread: threading.Thread) -> None:
    """Wait briefly for a link's thread to finish, so that a closed link leaves no thread behind."""
    if thread is not threading.current_thread():
        thread.join(timeout=1.0)


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' (or ':port', meaning 127.0.0.1) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return (host or "127.0.0.1", int(port))


class OutLink:
    """The sending end of a hop: `send` frames; heartbeats and peer-close detection run behind it.

    Thread-safe. After the first failure every `send` raises `HopError`, and `on_broken` is called
    once with the error (from whichever thread saw it) so the owner can stop waiting elsewhere.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        send_timeout: float = HOP_TIMEOUT,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        on_broken: Callable[[HopError], None] | None = None,
    ) -> None:
        self.name = name
        self._sock = sock
        self._sock.settimeout(send_timeout)  # bounds a send into a peer that stopped reading
        self._interval = heartbeat_interval
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._error: HopError | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hop-out-{name}", daemon=True)
        self._thread.start()

    @property
    def broken(self) -> bool:
        return self._error is not None

    def send(self, frame: Frame) -> None:
        buffers = encode_frame(frame)
        with self._lock:
            if self._error is not None:
                raise _detached(self._error)
            try:
                for buffer in buffers:
                    self._send_all(memoryview(buffer).cast("B"))
            except OSError as exc:  # includes TimeoutError: the peer stopped reading
                error = HopError(f"sending to {self.name} failed: {exc}")
                self._fail(error)
                raise _detached(error) from exc
            self._last_send = time.monotonic()

    def _send_all(self, view: memoryview) -> None:
        # Not `sendall`: its timeout bounds the whole transfer, which would fail a large prefill
        # chunk on a slow network. Here the timeout bounds each wait for progress.
        sent = 0
        while sent < len(view):
            sent += self._sock.send(view[sent:])

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher's select
        _join(self._thread)
        self._sock.close()

    def _fail(self, error: HopError) -> None:
        if self._error is None and not self._closed.is_set():
            self._error = error
            if self._on_broken is not None:
                self._on_broken(error)

    def _watch(self) -> None:
        """Heartbeat when quiet; the peer never sends, so readability means it closed the link."""
        while not self._closed.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], self._interval / 2)
            except (OSError, ValueError):
                return  # closed under us
            if self._closed.is_set():
                return
            if readable:
                self._fail(HopError(f"{self.name} closed the link"))
                return
            if time.monotonic() - self._last_send >= self._interval:
                with contextlib.suppress(HopError):
                    self.send(Frame(Kind.HEARTBEAT))
            if self._error is not None:
                return


class InLink:
    """The receiving end of a hop: a reader thread turns bytes into frames, `recv` hands them out.

    Silence longer than `timeout` (no data, no heartbeat), a closed or reset connection, or a bad
    frame all become a `HopError` that `recv` raises from then on. `fail` injects an error from
    elsewhere (e.g. the owner's OutLink broke) so that a waiting `recv` returns at once.
    """

    def __init__(self, sock: socket.socket, *, name: str, timeout: float = HOP_TIMEOUT) -> None:
        self.name = name
        self._sock = sock
        self._timeout = timeout
        # Raw frame bodies: they are decoded by `recv`, on the caller's thread, because MLX
        # streams are per thread (an array made lazily here could not be evaluated there).
        self._queue: queue.SimpleQueue[bytearray | HopError] = queue.SimpleQueue()
        self._error: HopError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._read, name=f"hop-in-{name}", daemon=True)
        self._thread.start()

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame; None if `timeout` (seconds) passes first; `HopError` if the link failed."""
        if self._error is not None:
            raise _detached(self._error)
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, HopError):
            self._error = item
            raise _detached(item)
        try:
            return decode_frame(item)
        except FrameError as exc:
            self._error = _detached(exc)
            raise

    def fail(self, error: HopError) -> None:
        self._queue.put(error)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
        _join(self._thread)
        self._sock.close()

    def _read(self) -> None:
        self._sock.settimeout(self._timeout)
        try:
            while True:
                (length,) = _PREFIX.unpack(self._read_exactly(_PREFIX.size))
                if length > MAX_FRAME_BYTES:
                    raise FrameError(f"{self.name} announced a {length}-byte frame")
                body = self._read_exactly(length)
                if length < _HEADER.size:
                    raise FrameError(f"{self.name} sent a {length}-byte frame, shorter than a header")
                if body[_KIND_OFFSET] != Kind.HEARTBEAT:
                    self._queue.put(body)
        except HopError as exc:
            self._queue.put(_detached(exc))
        except TimeoutError:
            self._queue.put(HopError(f"nothing from {self.name} for {self._timeout:.1f}s: frozen or cut off"))
        except OSError as exc:
            reason = "link closed" if self._closed else f"receiving from {self.name} failed: {exc}"
            self._queue.put(HopError(reason))

    def _read_exactly(self, n: int) -> bytearray:
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            count = self._sock.recv_into(view[got:])
            if count == 0:
                raise HopError(f"{self.name} closed the link")
            got += count
        return buffer
