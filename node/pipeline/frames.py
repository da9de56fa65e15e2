"""Pipeline frames: what crosses a hop between stages, as bytes (pure; `hop.py` moves them).

Frame layout (all integers big-endian), inside a `protocol.framing` frame (u32 length first)::

    header: 2s magic "SP" | u8 version | u8 kind | u8 dtype | u64 request | u32 position
            | u32 meta length | u8 ndim
    ndim x u32 shape
    meta: UTF-8 JSON object (often empty: decode frames carry none)
    tensor: the raw bytes of a row-major array of `dtype` and `shape`

`position` is the cache offset of the tensor's first token, so a stage whose cache disagrees
refuses the step instead of computing garbage. A tensor crosses as its own bytes, never copied
into the frame: `encode_frame` gives the buffers to send in order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, cast

import mlx.core as mx
import numpy as np

from protocol.framing import FrameError, prefix

MAGIC = b"SP"
VERSION = 1
MAX_FRAME_BYTES = 1 << 30
"""A prefill chunk of 2048 tokens x 16384 hidden x float32 is 128 MiB; anything past 1 GiB is an
error, not a tensor."""
MAX_NDIM = 8

_HEADER = struct.Struct(">2sBBBQIIB")
_DIM = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
"""The smallest frame: a header without shape, meta or tensor."""
KIND_OFFSET = 3
"""Byte of the header holding the kind, after the magic and the version."""


class Kind(IntEnum):
    """Frame kinds. The numbers are on the wire: ONLY APPEND TO THIS LIST."""

    HELLO = 1
    """First frame on a new link; meta: {"route": the later hops' HOST:PORT, ...}. Which layer the
    receiver starts at is proven by the link's handshake (`link_auth`), not said here."""
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
    head = prefix(length, MAX_FRAME_BYTES) + header + meta
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
