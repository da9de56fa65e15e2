"""Cluster admission: a mutual HMAC challenge-response on `/shoal/auth/1.0.0`.

Noise already proves each side's peer id; this proves each side knows the cluster key. Exactly one
side of a peer pair runs the initiator role (the lower peer id, so both sides agree even when both
dialed), on one stream:

    initiator -> responder   VERSION(1) | nonce_i(32)
    responder -> initiator   nonce_r(32) | HMAC(key, "responder" | nonce_i | nonce_r | id_i | id_r)
    initiator -> responder   HMAC(key, "initiator" | nonce_i | nonce_r | id_i | id_r)
    responder -> initiator   ACCEPT(1)

Both MACs cover both fresh nonces and both peer ids, with a role label, so a proof can be neither
replayed to another peer nor reflected back. Comparisons are constant-time (`hmac.compare_digest`).
Wrong key, wrong bytes, EOF or silence all end in failure; the I/O shell (Mesh) then disconnects
the peer and refuses it for a while, and delivers nothing from it.

The key is HMAC-SHA256 of (cluster name, secret). Without a secret it depends on the name alone:
zero-config clusters work, but anyone who knows the name can join. The secret is the protection.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from libp2p.abc import INetStream

from node.net.framing import read_exactly

PROTOCOL_ID = "/shoal/auth/1.0.0"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
ACCEPT = b"\x01"
_KEY_LABEL = b"shoal/cluster-key/1"


class AuthError(Exception):
    """The peer failed the challenge (wrong key, wrong version or malformed answer)."""


def derive_key(cluster: str, secret: bytes | None) -> bytes:
    """The 32-byte cluster key; the same (cluster, secret) gives the same key on every node."""
    name = cluster.encode()
    material = len(name).to_bytes(2, "big") + name + (secret or b"")
    return hmac.new(_KEY_LABEL, material, hashlib.sha256).digest()


def proof(key: bytes, role: bytes, nonce_i: bytes, nonce_r: bytes, id_i: bytes, id_r: bytes) -> bytes:
    message = b"|".join((role, nonce_i, nonce_r)) + _lp(id_i) + _lp(id_r)
    return hmac.new(key, message, hashlib.sha256).digest()


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


def _check(expected: bytes, got: bytes) -> None:
    if not hmac.compare_digest(expected, got):
        raise AuthError("the peer does not know the cluster key")


async def initiate(stream: INetStream, key: bytes, my_id: bytes, peer_id: bytes) -> None:
    """Run the initiator side; returns when both sides accepted, else raises AuthError/transport."""
    nonce_i = secrets.token_bytes(NONCE_BYTES)
    await stream.write(bytes([VERSION]) + nonce_i)
    answer = await read_exactly(stream, NONCE_BYTES + MAC_BYTES)
    nonce_r, mac_r = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    _check(proof(key, b"responder", nonce_i, nonce_r, my_id, peer_id), mac_r)
    await stream.write(proof(key, b"initiator", nonce_i, nonce_r, my_id, peer_id))
    if await read_exactly(stream, 1) != ACCEPT:
        raise AuthError("the peer rejected our proof")


async def respond(stream: INetStream, key: bytes, my_id: bytes, peer_id: bytes) -> None:
    """Run the responder side; returns when the initiator proved the key, else raises."""
    hello = await read_exactly(stream, 1 + NONCE_BYTES)
    if hello[0] != VERSION:
        raise AuthError(f"unknown auth version {hello[0]}")
    nonce_i, nonce_r = hello[1:], secrets.token_bytes(NONCE_BYTES)
    await stream.write(nonce_r + proof(key, b"responder", nonce_i, nonce_r, peer_id, my_id))
    mac_i = await read_exactly(stream, MAC_BYTES)
    _check(proof(key, b"initiator", nonce_i, nonce_r, peer_id, my_id), mac_i)
    await stream.write(ACCEPT)
