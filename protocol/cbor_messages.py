"""Typed messages as CBOR: the one encode/decode used by every wire (runner, control, generate).

A wire defines pydantic messages and its own error type; these functions add the size cap and turn
any malformed or hostile input into that error, never another exception.
"""

from __future__ import annotations

from typing import TypeVar

import cbor2
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from protocol.framing import FrameError, encode

T = TypeVar("T")


class WireMessage(BaseModel):
    """Base of every wire's messages: immutable, and unknown fields are an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


_UNDECODABLE = (cbor2.CBORDecodeError, ValidationError, ValueError, TypeError, OverflowError, RecursionError)


def encode_cbor(message: BaseModel, *, limit: int, error: type[ValueError]) -> bytes:
    body: bytes = cbor2.dumps(message.model_dump(mode="json"))
    if len(body) > limit:
        raise error(f"message of {len(body)} bytes exceeds the {limit}-byte cap")
    return body


def framed_cbor(message: BaseModel, limit: int) -> bytes:
    """`message` as one frame (`protocol.framing`) of CBOR, for wires over pipes; `FrameError` when
    it is over `limit`."""
    return encode(encode_cbor(message, limit=limit, error=FrameError), limit)


def decode_cbor(adapter: TypeAdapter[T], body: bytes, *, limit: int, error: type[ValueError], what: str) -> T:
    if len(body) > limit:
        raise error(f"{what} of {len(body)} bytes exceeds the {limit}-byte cap")
    try:
        return adapter.validate_python(cbor2.loads(body))
    except _UNDECODABLE as exc:
        raise error(f"undecodable {what}: {exc}") from exc
