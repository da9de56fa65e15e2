"""The sockets of a tensor-parallel group: one between every two ranks, each proven.

Rank 0 (the runner that serves the instance) knows where every other rank listens, as the
pipeline's entry does (the nodes answer `StageAddress`). It dials each of them and sends the list
over that connection, so a rank learns the group from rank 0 alone, never from a stranger. Every
rank then dials the ranks above it and accepts those below: the highest rank dials nobody, so
nobody waits in a circle. A dialer names its rank (4 bytes), then both sides run the stage links'
handshake (`node.pipeline.link_auth`) on a boundary that encodes the pair, so a proof made for one
pair (or for a pipeline cut) opens no other. The connected sockets go to the native `TensorLink`,
which owns them from then on. In a cluster with a secret each pair's handshake also gives the key
its frames are sealed with (AES-GCM, natively: `native/kernels/link_seal.h`), and rank 0's list is
sealed under it too.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import cbor2

from node.native import load_kernels, tensor_links_seal
from node.pipeline.hop import CONNECT_TIMEOUT, HopError, dial, nodelay, parse_address
from node.pipeline.link_auth import (
    FrameCipher,
    LinkAuthError,
    LinkSecurity,
    acceptor_handshake,
    dialer_handshake,
)
from protocol.framing import FrameError

log = logging.getLogger("shoal.tensor")

LINK_TIMEOUT = 30.0
"""Seconds a rank waits for the others within one step before the link fails. A sum waits for the
slowest rank's share of one layer: a prefill chunk of 2,048 tokens through one layer of a 3B model
takes a few seconds on one core, so a frozen rank is found within this, never a slow one."""

MAX_GROUP = 64
"""Ranks in one group, at most (what a rank accepts to read from rank 0's list)."""

_PAIR = 0x7E000000
"""Tensor-link boundaries: above any layer count a pipeline cut can name."""


def native() -> ModuleType:
    """The kernels extension, whose `TensorLink` and sums a group runs on (`HopError` without it)."""
    load = load_kernels()
    if load.module is None:
        raise HopError(f"tensor-parallel runs on the native kernels, which are unavailable: {load.reason}")
    return load.module


def boundary(dialer: int, acceptor: int) -> int:
    return _PAIR | dialer << 8 | acceptor


def _link(kernels: ModuleType, fds: list[int], rank: int, timeout: float, ciphers: Sequence[Any]) -> Any:
    """The native link over `fds`, sealed with each pair's key when the handshakes gave ciphers."""
    keys = [b"" if c is None else c.key for c in ciphers] if any(ciphers) else []
    return kernels.TensorLink(fds, rank, timeout, keys)


def _check_security(security: LinkSecurity) -> None:
    if security.sealed and not tensor_links_seal():
        raise HopError(
            "tensor-parallel links cannot seal their frames here (the native kernels were built "
            "without OpenSSL), and the cluster has a secret"
        )


def _dial_rank(
    me: int, peer: int, address: tuple[str, int], security: LinkSecurity, deadline: float
) -> tuple[socket.socket, FrameCipher | None]:
    sock = dial(address, timeout=max(0.1, deadline - time.monotonic()))
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(struct.pack("<I", me))
        cipher = dialer_handshake(sock, security, boundary(me, peer))
    except (OSError, LinkAuthError) as exc:
        sock.close()
        raise HopError(f"rank {peer} at {address[0]}:{address[1]}: {exc}") from exc
    return sock, cipher


def dial_group(
    followers: Sequence[str],
    *,
    security: LinkSecurity,
    timeout: float = CONNECT_TIMEOUT,
    link_timeout: float = LINK_TIMEOUT,
) -> Any:
    """Rank 0's `TensorLink` to ranks 1.. listening at `followers` (HOST:PORT each, in rank order).

    Raises `HopError` when a rank cannot be reached or proven within `timeout` s.
    """
    kernels = native()
    _check_security(security)
    deadline = time.monotonic() + timeout
    listing = cbor2.dumps(list(followers))
    socks: list[socket.socket] = []
    ciphers: list[FrameCipher | None] = [None]
    try:
        for rank, text in enumerate(followers, start=1):
            sock, cipher = _dial_rank(0, rank, parse_address(text), security, deadline)
            socks.append(sock)
            ciphers.append(cipher)
            sent = listing if cipher is None else cipher.seal(listing)
            try:
                sock.sendall(struct.pack("<I", len(sent)) + sent)
            except OSError as exc:
                raise HopError(f"rank {rank} at {text}: {exc}") from exc
        fds = [-1] + [s.detach() for s in socks]
    except BaseException:
        for s in socks:
            s.close()
        raise
    return _link(kernels, fds, 0, link_timeout, ciphers)


def join_group(
    rank: int,
    size: int,
    listener: socket.socket,
    *,
    security: LinkSecurity,
    timeout: float = CONNECT_TIMEOUT,
    link_timeout: float = LINK_TIMEOUT,
) -> Any:
    """Rank `rank`'s `TensorLink`, once rank 0 (waited for as long as it takes) and then every other
    rank connected within `timeout` s. A new connection from rank 0 starts the group over."""
    kernels = native()
    _check_security(security)
    socks: list[socket.socket | None] = [None] * size
    ciphers: list[FrameCipher | None] = [None] * size
    deadline = float("inf")

    def drop_all() -> None:
        for i, s in enumerate(socks):
            if s is not None:
                s.close()
                socks[i] = None

    try:
        while any(s is None for i, s in enumerate(socks) if i != rank):
            left = deadline - time.monotonic()
            if left <= 0:
                drop_all()  # the group did not form: wait for rank 0 to try again
                deadline = float("inf")
                continue
            listener.settimeout(None if left == float("inf") else left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted = _accept(nodelay(conn), rank, security)
            if accepted is None:
                conn.close()
                continue
            peer, ciphers[accepted[0]] = accepted
            if peer == 0:
                followers = _read_listing(conn, size, ciphers[0])
                if followers is None:
                    conn.close()
                    continue
                for i in [0, *range(rank + 1, size)]:  # rank 0 starts over: so do our links up
                    if (old := socks[i]) is not None:
                        old.close()
                        socks[i] = None
                socks[0] = conn
                deadline = time.monotonic() + timeout
                try:
                    for higher in range(rank + 1, size):
                        address = parse_address(followers[higher - 1])
                        socks[higher], ciphers[higher] = _dial_rank(rank, higher, address, security, deadline)
                except HopError as exc:
                    log.warning("rank %d could not reach the ranks above it: %s", rank, exc)
                    drop_all()
                    deadline = float("inf")
            else:  # a rank below (it may come before rank 0's own connection): the newest counts
                if (old := socks[peer]) is not None:
                    old.close()
                socks[peer] = conn
        fds = [-1 if s is None else s.detach() for s in socks]
    except BaseException:
        drop_all()
        raise
    return _link(kernels, fds, rank, link_timeout, ciphers)


def _accept(conn: socket.socket, rank: int, security: LinkSecurity) -> tuple[int, FrameCipher | None] | None:
    """The lower rank a connection proves to be, and the pair's cipher; else None."""
    try:
        conn.settimeout(5.0)
        head = conn.recv(4, socket.MSG_WAITALL)
        if len(head) != 4:
            return None
        (peer,) = struct.unpack("<I", head)
        if not 0 <= peer < rank:
            return None
        cipher = acceptor_handshake(conn, security, boundary(peer, rank))
    except (OSError, LinkAuthError):
        return None
    conn.settimeout(None)
    return int(peer), cipher


def _read_listing(conn: socket.socket, size: int, cipher: FrameCipher | None) -> list[str] | None:
    """Rank 0's list of the other ranks' addresses, if it is one for a group of `size`."""
    try:
        conn.settimeout(5.0)
        head = conn.recv(4, socket.MSG_WAITALL)
        (length,) = struct.unpack("<I", head) if len(head) == 4 else (-1,)
        if not 0 < length <= MAX_GROUP * 300:
            return None
        body = conn.recv(length, socket.MSG_WAITALL)
        listing = cbor2.loads(body if cipher is None else cipher.open(body))
    except (OSError, ValueError, cbor2.CBORDecodeError, FrameError):
        return None
    if (
        not isinstance(listing, list)
        or len(listing) != size - 1
        or not all(isinstance(a, str) for a in listing)
    ):
        return None
    return listing
