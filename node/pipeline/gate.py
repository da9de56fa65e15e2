"""The door of a stage's (or the driver's) listening port: only members of the instance get in.

Each connection runs the acceptor's handshake (`link_auth`) in a thread of its own, within
`link_auth.AUTH_TIMEOUT`, so a stranger that connects and stays silent, or sends anything else,
never holds the stage: it is dropped while the accepting goes on, and the stage only ever sees
connections that proved the key. At most `MAX_PENDING` handshakes run at once; a connection beyond
them is closed at once.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading

from node.pipeline.hop import nodelay
from node.pipeline.link_auth import FrameCipher, LinkAuthError, LinkSecurity, acceptor_handshake

log = logging.getLogger("shoal.pipeline")

MAX_PENDING = 8
"""Handshakes in flight at once: a ring needs one, a restart or two more; the rest is a flood."""
ACCEPT_POLL = 0.2
"""Seconds between checks of a closed or stop flag while no connection (or frame) comes: here and in
`node.pipeline.stage`, which polls its gate and its link with it."""

Admitted = tuple[socket.socket, FrameCipher | None]
"""A connection that passed the handshake, and the cipher that opens its frames (None: clear)."""


class Gate:
    """Accepts on `listener` in a thread; `admitted` hands out the connections that proved the key."""

    def __init__(self, listener: socket.socket, security: LinkSecurity, *, boundary: int, name: str) -> None:
        self._listener = listener
        self._security = security
        self._boundary = boundary
        self._name = name
        self._queue: queue.SimpleQueue[Admitted] = queue.SimpleQueue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"gate-{name}", daemon=True)
        self._thread.start()

    def admitted(self, timeout: float) -> Admitted | None:
        """The next admitted connection, or None if none comes within `timeout` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop accepting and close what was admitted but not taken; the owner closes the listener."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * ACCEPT_POLL)
        while True:
            try:
                sock, _ = self._queue.get_nowait()
            except queue.Empty:
                return
            sock.close()

    def _accept(self) -> None:
        self._listener.settimeout(ACCEPT_POLL)
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            if not self._pending.acquire(blocking=False):
                log.warning("%s: refused %s: %d handshakes in flight already", self._name, peer, MAX_PENDING)
                sock.close()
                continue
            threading.Thread(target=self._admit, args=(sock, peer), daemon=True).start()

    def _admit(self, sock: socket.socket, peer: object) -> None:
        try:
            cipher = acceptor_handshake(sock, self._security, self._boundary)
        except LinkAuthError as exc:
            log.warning("%s: refused a connection from %s: %s", self._name, peer, exc)
            sock.close()
            return
        finally:
            self._pending.release()
        if self._closed.is_set():
            sock.close()
            return
        sock.settimeout(None)
        try:
            self._queue.put((nodelay(sock), cipher))
        except OSError:  # it closed meanwhile
            sock.close()
