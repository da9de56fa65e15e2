"""The limits every cluster record keeps, and the checks that enforce them when one is built.

Named once, so the records (`protocol.cluster_records`), the wire codec and the tests agree on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_ID_CHARS = 128
"""Node ids (a peer id is ~52 chars), instance ids."""
MAX_TEXT_CHARS = 256
"""Hostname, os, accelerator, software version, model id."""
MAX_URL_CHARS = 512
"""The API URL and each multiaddr."""
MAX_MULTIADDRS = 16
"""Addresses one node advertises (IPv4 + IPv6 x a few interfaces fits easily)."""
MAX_STAGES = 256
"""Pipeline stages of one instance (at most one per layer of any model we serve)."""
MAX_SUSPECTS = 64
"""Members one liveness record may name as suspected; more are dropped (suspicion is only a hint)."""
MAX_INT = 2**63 - 1
"""Every counter, size and layer index fits in a signed 64-bit integer."""
MAX_LAYERS = 1024
"""Layers in one model shape (the largest public models have ~130)."""
MAX_HOLDINGS = 32
"""Models one node advertises; partial ones list up to `MAX_MANIFEST_FILES` indices: < ~60 KB."""
MAX_TRANSFERS = 8
"""Transfers to one node shown at once: the running ones and the latest finished."""
MAX_ERROR_CHARS = 512
"""Why a transfer or a runner failed; longer reasons are cut by the writer."""
MANIFEST_ID_CHARS = 64
"""A manifest id is a SHA-256 in hex."""
MAX_ENTRY_LOADS = 64
"""Instances one node reports the load of (those it is the entry of: one per model it serves)."""
MAX_LINKS = 64
"""Round trips a profile carries: to this many peers (a home cluster has a handful)."""


class RecordError(ValueError):
    """A record breaks its own rules (a size limit, a negative counter, non-contiguous stages)."""


def check_text(name: str, value: str, limit: int, *, allow_empty: bool = True) -> None:
    if not isinstance(value, str):
        raise RecordError(f"{name} must be text, not {type(value).__name__}")
    if len(value) > limit:
        raise RecordError(f"{name} of {len(value)} chars exceeds {limit}")
    if not allow_empty and not value:
        raise RecordError(f"{name} must not be empty")


def check_int(name: str, value: int) -> None:
    if type(value) is not int:
        raise RecordError(f"{name} must be an integer, not {type(value).__name__}")
    if not 0 <= value <= MAX_INT:
        raise RecordError(f"{name} {value} is out of range [0, {MAX_INT}]")


def check_keyed(name: str, items: object, kind: type, limit: int, key: Callable[[Any], str]) -> None:
    """`items` is a tuple of at most `limit` `kind` values, sorted by `key`, each key once."""
    if not isinstance(items, tuple) or len(items) > limit or not all(isinstance(i, kind) for i in items):
        raise RecordError(f"{name} must be a tuple of at most {limit} {kind.__name__} values")
    keys = [key(item) for item in items]
    if keys != sorted(set(keys)):
        raise RecordError(f"{name} must be sorted by key, each once")


def check_node_id(name: str, value: str) -> None:
    check_text(name, value, MAX_ID_CHARS, allow_empty=False)
