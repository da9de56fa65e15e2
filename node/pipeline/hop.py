"""The link between neighbouring pipeline stages: framed tensors over plain TCP.

Why plain TCP: a decode step moves one hidden state (hidden_size x 4 bytes) per hop, where
TCP_NODELAY on loopback costs ~40 us a round trip against ~1 ms for a libp2p stream, and unlike
MLX's ring backend a dead peer is an error here, not a spinning core or a hang.

The stages form a ring: the driver (first stage) sends to stage 1, each stage to the next, and the
last stage sends sampled tokens back to the driver. Each TCP connection carries data one way only,
from its `OutLink` (the connecting side) to its `InLink` (the accepting side).

Liveness: an `OutLink` sends a HEARTBEAT whenever it has been quiet for `HEARTBEAT_INTERVAL`, and
an `InLink` treats `timeout` seconds without any frame as a dead or frozen neighbour. A stage busy
in a long MLX computation still heartbeats (MLX releases the GIL), so the timeout measures silence,
never work. Every failure surfaces as `HopError`; nothing here blocks without a bound.

Who may connect is `link_auth` (a handshake before any frame; `gate` runs it for a listener), and
a link given its `FrameCipher` seals or opens every frame. What a frame holds is `frames.py`, how
its bytes are delimited `protocol.framing`, both pure; the link classes here are the short I/O
shell around them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable

from node.pipeline.frames import (
    HEADER_BYTES,
    KIND_OFFSET,
    MAX_FRAME_BYTES,
    Frame,
    Kind,
    decode_frame,
    encode_frame,
)
from node.pipeline.link_auth import TAG_BYTES, FrameCipher, LinkAuthError, LinkSecurity, dialer_handshake
from protocol.framing import PREFIX, FrameDecoder, FrameError, prefix

log = logging.getLogger("shoal.pipeline")

HEARTBEAT_INTERVAL = 0.5
"""Seconds of quiet after which an OutLink sends a heartbeat. Small against HOP_TIMEOUT so that a
few late heartbeats on a loaded machine do not look like a dead peer."""
HOP_TIMEOUT = 3.0
"""Seconds without any frame (data or heartbeat) before an InLink declares its neighbour dead or
frozen: 6 heartbeat intervals."""
CONNECT_TIMEOUT = 30.0
"""How long a dial keeps retrying a refused connection: the neighbour may still be loading."""


class HopError(Exception):
    """The link to a neighbouring stage failed: closed, reset, silent too long or sent garbage."""


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read it back with getsockname)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(8)
    return listener


Address = tuple[str, int]
Target = Address | Callable[[], Address | None]
"""Where to dial: an address, or a function read again before every try (a stage's next hop as its
node last said it, None while unknown)."""


def dial(target: Target, *, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """Connect to a stage, retrying refusals (it may still be loading, or its address may still
    change) for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        address = target() if callable(target) else target
        left = deadline - time.monotonic()
        try:
            if address is None:
                raise OSError("its node has not said where it listens yet")
            sock = socket.create_connection(address, timeout=max(0.1, min(left, HOP_TIMEOUT)))
        except OSError as exc:
            if time.monotonic() + delay >= deadline:
                where = "the next stage" if address is None else f"stage {address[0]}:{address[1]}"
                raise HopError(f"cannot connect to {where}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        sock.settimeout(None)
        return nodelay(sock)


def dial_member(
    target: Target, security: LinkSecurity, boundary: int, *, timeout: float = CONNECT_TIMEOUT
) -> tuple[socket.socket, FrameCipher | None]:
    """`dial`, then prove the instance's key and check the answer (`link_auth`): the socket and the
    cipher that seals what we send; `HopError` when the address is no member of the instance."""
    sock = dial(target, timeout=timeout)
    host, port = sock.getpeername()[:2]
    try:
        return sock, dialer_handshake(sock, security, boundary)
    except LinkAuthError as exc:
        sock.close()
        raise HopError(f"{host}:{port}: {exc}") from exc


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
    """The sending end of a hop: `send` frames (sealed by `cipher` if given); heartbeats and
    peer-close detection run behind it.

    Thread-safe. After the first failure every `send` raises `HopError`, and `on_broken` is called
    once with the error (from whichever thread saw it) so the owner can stop waiting elsewhere.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        cipher: FrameCipher | None = None,
        send_timeout: float = HOP_TIMEOUT,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        on_broken: Callable[[HopError], None] | None = None,
    ) -> None:
        self.name = name
        self._sock = sock
        self._cipher = cipher
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
            if self._cipher is not None:  # sealed in send order: the counter is the nonce
                sealed = self._cipher.seal(memoryview(b"".join(buffers))[PREFIX.size :])
                buffers = [prefix(len(sealed), MAX_FRAME_BYTES + TAG_BYTES), sealed]
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
    """The receiving end of a hop: a reader thread turns bytes into frames (opened by `cipher` if
    given), `recv` hands them out.

    Silence longer than `timeout` (no data, no heartbeat), a closed or reset connection, or a bad
    frame all become a `HopError` that `recv` raises from then on. `fail` injects an error from
    elsewhere (e.g. the owner's OutLink broke) so that a waiting `recv` returns at once.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        name: str,
        cipher: FrameCipher | None = None,
        timeout: float = HOP_TIMEOUT,
    ) -> None:
        self.name = name
        self._sock = sock
        self._cipher = cipher
        self._timeout = timeout
        # Raw frame bodies: they are decoded by `recv`, on the caller's thread, because MLX
        # streams are per thread (an array made lazily here could not be evaluated there).
        self._queue: queue.SimpleQueue[bytes | bytearray | HopError] = queue.SimpleQueue()
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
            self._error = HopError(f"{self.name} sent a bad frame: {exc}")
            raise _detached(self._error) from None

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
        cipher = self._cipher
        decoder = FrameDecoder(MAX_FRAME_BYTES + (TAG_BYTES if cipher is not None else 0))
        try:
            while True:
                # Straight into the frame's own buffer: a clear prefill chunk is copied by nobody.
                count = self._sock.recv_into(decoder.writable())
                if count == 0:
                    raise HopError(f"{self.name} closed the link")
                body = decoder.advance(count)
                if body is None:
                    continue
                plain = body if cipher is None else cipher.open(body)
                if len(plain) < HEADER_BYTES:
                    raise FrameError(f"a {len(plain)}-byte frame, shorter than a header")
                if plain[KIND_OFFSET] != Kind.HEARTBEAT:
                    self._queue.put(plain)
        except FrameError as exc:
            self._queue.put(HopError(f"{self.name} broke the framing: {exc}"))
        except HopError as exc:
            self._queue.put(_detached(exc))
        except TimeoutError:
            self._queue.put(HopError(f"nothing from {self.name} for {self._timeout:.1f}s: frozen or cut off"))
        except OSError as exc:
            reason = "link closed" if self._closed else f"receiving from {self.name} failed: {exc}"
            self._queue.put(HopError(reason))
