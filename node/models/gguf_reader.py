"""gguf-py's `GGUFReader`, with metadata arrays read in one pass.

gguf-py makes numpy views per element of a metadata array (two per string): a gpt-oss GGUF's
vocabulary (201,088 tokens and 446,189 merges) takes it 12-36 s on a 2-core host, once for the
header check before `shoal run` starts and again for the import. `FastGGUFReader` reads a number
array as one view and a string array with `struct` over one memoryview, and gives
`ReaderField.contents()` parts it reads the same way (`tolist()`, `tobytes()`), so every field
reads as before. Nested arrays and other fields are gguf-py's own.

This is the one module that touches gguf-py's internals, read from gguf 0.19.0: the private
`GGUFReader._get_field_parts` (overridden), `_get` and `gguf_scalar_to_np`. tests/test_gguf_reader.py
compares every field and tensor with gguf-py's own reader, so a gguf release that changes them fails there.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

_LENGTH = struct.Struct("<Q")


class _Text(bytes):
    """One string of an array, as `ReaderField.contents()` reads a part (`tobytes()`, `nbytes`)."""

    __slots__ = ()

    def tobytes(self) -> bytes:
        return self

    @property
    def nbytes(self) -> int:
        return len(self)


class FastGGUFReader(GGUFReader):
    """A `GGUFReader` whose metadata arrays are parsed without numpy views per element."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item = GGUFValueType(int(raw_itype[0]))
        types = [GGUFValueType.ARRAY] + ([item] if count[0] else [])
        parts: list[Any] = [raw_itype, count]
        offs = orig_offs + 12
        if (numbers := self.gguf_scalar_to_np.get(item)) is not None:  # one view of all of them
            values = self._get(offs, numbers, int(count[0]))
            if len(values) != count[0]:
                raise ValueError(f"the array at offset {orig_offs} is truncated")
            return 12 + int(values.nbytes), [*parts, values], [2], types
        if item != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        view = memoryview(self.data)  # type: ignore[arg-type]
        try:
            for _ in range(int(count[0])):
                (length,) = _LENGTH.unpack_from(view, offs)
                offs += 8 + length
                if offs > len(view):
                    raise ValueError("past the end of the file")
                parts.append(_Text(view[offs - length : offs]))
        except (struct.error, ValueError) as exc:
            raise ValueError(f"the string array at offset {orig_offs} is truncated: {exc}") from exc
        return offs - orig_offs, parts, list(range(2, len(parts))), types
