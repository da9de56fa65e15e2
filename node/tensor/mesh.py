"""The sockets of a tensor-parallel group: one between every two ranks, each proven.

Rank r dials every lower rank and accepts every higher one, so no two ranks wait on each other.
A dialer first names its rank (4 bytes), then both sides run the stage links' handshake
(`node.pipeline.link_auth`) on a boundary that encodes the pair, so a proof made for one pair
(or for a pipeline cut) opens no other. The connected sockets go to the native `TensorLink`,
which owns them from then on.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from node.native import load_kernels
from node.pipeline.hop import CONNECT_TIMEOUT, HopError, dial, nodelay
from node.pipeline.link_auth import LinkAuthError, LinkSecurity, acceptor_handshake, dialer_handshake

LINK_TIMEOUT = 30.0
"""Seconds a rank waits for the others within one step before the link fails. A sum waits for the
slowest rank's share of one layer: a prefill chunk of 2,048 tokens through one layer of a 3B model
takes a few seconds on one core, so a frozen rank is found within this, never a slow one."""

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


def connect_group(
    rank: int,
    addresses: Sequence[tuple[str, int]],
    listener: socket.socket,
    *,
    security: LinkSecurity,
    timeout: float = CONNECT_TIMEOUT,
    link_timeout: float = LINK_TIMEOUT,
) -> Any:
    """The group's `TensorLink` for `rank`, whose `listener` listens at `addresses[rank]`.

    Raises `HopError` when a rank cannot be reached or proven within `timeout` s.
    """
    kernels = native()
    if security.sealed:
        raise HopError("tensor-parallel links cannot seal their frames yet (the cluster has a secret)")
    size = len(addresses)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    deadline = time.monotonic() + timeout
    socks: list[socket.socket | None] = [None] * size
    try:
        for peer in range(rank):
            sock = dial(addresses[peer], timeout=max(0.1, deadline - time.monotonic()))
            socks[peer] = sock
            try:
                sock.sendall(struct.pack("<I", rank))
                dialer_handshake(sock, security, boundary(rank, peer))
            except (OSError, LinkAuthError) as exc:
                raise HopError(f"rank {peer} at {addresses[peer][0]}:{addresses[peer][1]}: {exc}") from exc
        while any(socks[p] is None for p in range(rank + 1, size)):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [p for p in range(rank + 1, size) if socks[p] is None]
                raise HopError(f"ranks {missing} did not connect within {timeout:.0f}s")
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            proven = _accept(nodelay(conn), rank, size, socks, security)
            if proven is None:
                conn.close()
            else:
                socks[proven] = conn
        fds = [-1 if s is None else s.detach() for s in socks]
    except BaseException:
        for s in socks:
            if s is not None:
                s.close()
        raise
    return kernels.TensorLink(fds, rank, link_timeout)


def _accept(
    conn: socket.socket, rank: int, size: int, socks: list[socket.socket | None], security: LinkSecurity
) -> int | None:
    """The rank a connection proves to be (a higher one not yet connected), else None."""
    try:
        conn.settimeout(5.0)
        head = conn.recv(4, socket.MSG_WAITALL)
        if len(head) != 4:
            return None
        (peer,) = struct.unpack("<I", head)
        if not rank < peer < size or socks[peer] is not None:
            return None
        acceptor_handshake(conn, security, boundary(peer, rank))
    except (OSError, LinkAuthError):
        return None
    conn.settimeout(None)
    return int(peer)
