"""Who may speak on a pipeline stage link: members of the instance, proven before any frame.

A stage listens on a TCP port anyone on the network can reach. So before a frame is read, the
connecting side proves it knows the instance's link key, and the side it dialed proves the same
back: a HELLO whose route names a stranger's address reaches nobody, since the stranger cannot
answer. On the fresh TCP connection (acceptor A, dialer D):

    A -> D   MAGIC(4) | nonce_a(32)
    D -> A   nonce_d(32) | boundary(u32) | HMAC(key, "dialer" | nonce_a | nonce_d | boundary)
    A -> D   HMAC(key, "acceptor" | nonce_a | nonce_d | boundary)

`boundary` is the layer where the link cuts the model: the dialer's end and the acceptor's start
(the model's layer count on the last stage's link back to the driver). A proof is thus bound to
the instance (its key), to the stage's place in it, and through both fresh nonces to this one
connection: it can be neither replayed nor reflected. Comparisons are constant-time.

The instance's link key is HMAC(cluster key, instance id) (`LinkSecurity.for_instance`); the node
hands it to its runner and stage processes in their environment (`LINK_ENV`), not on a command line
that any local user can list. A stage started by hand (tests, `bench/`) without it uses `OPEN`.

With a cluster secret, every frame after the handshake is sealed with AES-GCM under a key of this
connection (HMAC(link key, "frames" | both nonces | boundary)) and a frame counter as nonce, so a
nonce never repeats under a key and a frame altered, replayed, dropped or reordered fails to open.
Without a secret the cluster key follows from the cluster's name, and so does every link key: the
handshake then keeps out only mistakes (another instance's or layer range's stage, a stale ring),
and the frames cross in the clear (see the README).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.framing import FrameError

LINK_ENV = "SHOAL_STAGE_LINK"
"""The environment variable carrying `LinkSecurity.encode()` to runner and stage processes."""
AUTH_TIMEOUT = 2.0
"""Seconds a new connection has to finish the handshake; a silent one is dropped after this."""
MAGIC = b"SHL\x01"
"""First bytes the acceptor sends: a Shoal stage link, handshake version 1."""
NONCE_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
"""What sealing adds to each frame (AES-GCM's tag)."""
_BOUNDARY_BYTES = 4
_LINK_LABEL = b"shoal/stage-link/1"


class LinkAuthError(Exception):
    """The other side of a stage link did not prove the instance's key (or broke the handshake)."""


@dataclass(frozen=True)
class LinkSecurity:
    """The key of one instance's links, and whether its frames are sealed."""

    key: bytes
    sealed: bool

    @classmethod
    def for_instance(cls, cluster_key: bytes, instance: str, *, sealed: bool) -> LinkSecurity:
        return cls(_mac(cluster_key, _LINK_LABEL, instance.encode()), sealed)

    def encode(self) -> str:
        return f"{'sealed' if self.sealed else 'open'}:{self.key.hex()}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> LinkSecurity:
        """What the node handed this process, else `OPEN`; ValueError for a malformed value."""
        text = env.get(LINK_ENV, "")
        if not text:
            return OPEN
        mode, _, key = text.partition(":")
        if mode not in ("sealed", "open") or len(key) != 2 * MAC_BYTES:
            raise ValueError(f"{LINK_ENV} is not a stage link setting")
        return cls(bytes.fromhex(key), mode == "sealed")


def stage_links(cluster_key: bytes, secret: bytes | None) -> Callable[[str], str]:
    """Each instance's `LinkSecurity.encode()`, its frames sealed when the cluster has a secret."""
    return lambda instance: LinkSecurity.for_instance(cluster_key, instance, sealed=bool(secret)).encode()


OPEN = LinkSecurity(hashlib.sha256(_LINK_LABEL + b"/open").digest(), sealed=False)
"""The links of stages started without a node: a key anyone can compute, frames in the clear."""


class FrameCipher:
    """AES-GCM over one direction of one link, frames in order: `seal` sends, `open` receives."""

    def __init__(self, key: bytes) -> None:
        from cryptography.exceptions import InvalidTag  # only sealed links need the library
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)
        self.key = key
        """Also what a tensor link's native side seals with (`node.tensor.mesh`)."""
        self._invalid = InvalidTag
        self._count = 0

    def _nonce(self) -> bytes:
        self._count += 1
        return self._count.to_bytes(12, "big")

    def seal(self, plaintext: bytes | bytearray | memoryview) -> bytes:
        return self._aead.encrypt(self._nonce(), plaintext, None)

    def open(self, sealed: bytes | bytearray) -> bytes:
        """The frame's bytes; `FrameError` when it was not sealed by the other end, in this order."""
        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except self._invalid:
            raise FrameError("a frame failed authentication (altered, replayed or out of order)") from None


def dialer_handshake(sock: socket.socket, security: LinkSecurity, boundary: int) -> FrameCipher | None:
    """Prove ourselves to the stage we dialed and check its proof; the cipher for what we send
    (None: frames in the clear). `LinkAuthError` if it is no member of this instance."""
    deadline = time.monotonic() + AUTH_TIMEOUT
    hello = _read(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise LinkAuthError("the dialed address is not a Shoal stage (or speaks another version)")
    nonce_a, nonce_d = hello[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES)
    cut = boundary.to_bytes(_BOUNDARY_BYTES, "big")
    _send(sock, nonce_d + cut + _mac(security.key, b"dialer", nonce_a, nonce_d, cut), deadline)
    if not hmac.compare_digest(
        _read(sock, MAC_BYTES, deadline), _mac(security.key, b"acceptor", nonce_a, nonce_d, cut)
    ):
        raise LinkAuthError("the dialed stage does not know this instance's link key")
    return _cipher(security, nonce_a, nonce_d, cut)


def acceptor_handshake(sock: socket.socket, security: LinkSecurity, boundary: int) -> FrameCipher | None:
    """Check the proof of whoever connected, then prove ourselves; the cipher for what we receive
    (None: frames in the clear). `LinkAuthError` if it is no member, or not our previous stage."""
    deadline = time.monotonic() + AUTH_TIMEOUT
    nonce_a = secrets.token_bytes(NONCE_BYTES)
    _send(sock, MAGIC + nonce_a, deadline)
    answer = _read(sock, NONCE_BYTES + _BOUNDARY_BYTES + MAC_BYTES, deadline)
    nonce_d, cut, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:-MAC_BYTES], answer[-MAC_BYTES:]
    if not hmac.compare_digest(proof, _mac(security.key, b"dialer", nonce_a, nonce_d, cut)):
        raise LinkAuthError("it does not know this instance's link key")
    if (claimed := int.from_bytes(cut, "big")) != boundary:
        raise LinkAuthError(f"the connecting stage ends at layer {claimed}, this side starts at {boundary}")
    _send(sock, _mac(security.key, b"acceptor", nonce_a, nonce_d, cut), deadline)
    return _cipher(security, nonce_a, nonce_d, cut)


def _cipher(security: LinkSecurity, nonce_a: bytes, nonce_d: bytes, cut: bytes) -> FrameCipher | None:
    return FrameCipher(_mac(security.key, b"frames", nonce_a, nonce_d, cut)) if security.sealed else None


def _mac(key: bytes, *parts: bytes) -> bytes:
    message = b"".join(len(part).to_bytes(2, "big") + part for part in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise LinkAuthError(f"no handshake within {AUTH_TIMEOUT:.1f}s")
    return left


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    try:
        sock.sendall(data)
    except OSError as exc:
        raise LinkAuthError(f"handshake failed: {exc}") from exc


def _read(sock: socket.socket, count: int, deadline: float) -> bytes:
    buffer = bytearray(count)
    view: Any = memoryview(buffer)
    got = 0
    while got < count:
        sock.settimeout(_left(deadline))
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise LinkAuthError(f"no handshake within {AUTH_TIMEOUT:.1f}s") from None
        except OSError as exc:
            raise LinkAuthError(f"handshake failed: {exc}") from exc
        if n == 0:
            raise LinkAuthError("the connection closed during the handshake")
        got += n
    return bytes(buffer)
