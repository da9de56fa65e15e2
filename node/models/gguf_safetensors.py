"""A `.safetensors` file written tensor part by tensor part, never all of it in memory at once.

`mx.save_safetensors` wants every array at once: the whole model in memory. Here the header is
written first from the planned names, dtypes and shapes (all known from the GGUF's tensor infos),
then each piece of data goes straight to its place in the file (`write_at`), in any order: one
row chunk of a quantized tensor yields its weight, scales and biases rows together. `close`
checks that every byte was written exactly once, so a planning mistake cannot leave a hole.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "U8": 1}
"""Bytes per element of the dtypes the GGUF import writes."""
HEADER_ALIGN = 8
"""safetensors pads the JSON header with spaces so the data starts 8-byte aligned."""


class SafetensorsWriter:
    """Write `specs` (name -> (dtype, shape)) to `path`; data via `write_at`, then `close`."""

    def __init__(
        self,
        path: Path,
        specs: Mapping[str, tuple[str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, (dtype, shape) in specs.items():
            size = ITEM_SIZE[dtype] * math.prod(shape)
            self._offsets[name] = (offset, size)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % HEADER_ALIGN)
        self._data_start = 8 + len(raw)
        self._written = dict.fromkeys(specs, 0)
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() / the context manager
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._data_start + offset)

    def write_at(self, name: str, byte_offset: int, data: np.ndarray[Any, Any]) -> None:
        """Write `data` (C-ordered bytes) at `byte_offset` inside tensor `name`'s region."""
        start, size = self._offsets[name]
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        if byte_offset < 0 or byte_offset + buf.nbytes > size:
            raise ValueError(f"{name}: write of {buf.nbytes} bytes at {byte_offset} exceeds its {size}")
        self._file.seek(self._data_start + start + byte_offset)
        self._file.write(buf)
        self._written[name] += buf.nbytes

    def close(self) -> None:
        """Flush and close; raise if some tensor did not get exactly its size in bytes."""
        self._file.close()
        if short := [n for n, (_, size) in self._offsets.items() if self._written[n] != size]:
            raise ValueError(f"safetensors tensors not written exactly once: {short[:3]}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
