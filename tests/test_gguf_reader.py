"""`FastGGUFReader` (metadata arrays in one pass) reads every field and tensor as gguf-py's reader does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from node.models import GGUFImportError, builtin_gguf_path
from node.models.gguf_convert import read_gguf
from node.models.gguf_reader import FastGGUFReader

ARRAYS: dict[str, list[object]] = {
    "strings": ["", "a", "Ġthe", "中文", "🙂 ok", "x" * 1000],
    "empty": [],
    "ints": [0, -1, 2**31 - 1, 7],
    "floats": [0.5, -2.25, 1e-6],
    "bools": [True, False, True],
    "nested": [[1, 2], [3]],
}


def _contents(reader: GGUFReader) -> dict[str, object]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _tensors(reader: GGUFReader) -> list[tuple[object, ...]]:
    return [(t.name, t.tensor_type, t.data_offset, tuple(t.shape), t.data.tobytes()) for t in reader.tensors]


def _write(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in ARRAYS.items():
        writer.add_array(f"test.{key}", value)
    writer.add_string("test.text", "after the arrays")
    writer.add_uint32("test.number", 42)
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("source", ["written", "smollm2"])
def test_every_field_and_tensor_reads_as_gguf_py_reads_it(source: str, tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf") if source == "written" else builtin_gguf_path()
    fast, plain = FastGGUFReader(path), GGUFReader(path)
    assert _contents(fast) == _contents(plain)
    assert _tensors(fast) == _tensors(plain)
    if source == "written":
        assert _contents(fast)["test.strings"] == ARRAYS["strings"]
        assert _contents(fast)["test.text"] == "after the arrays"


def test_a_string_array_cut_short_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf")
    data = path.read_bytes()
    cut = data.index(b"x" * 1000) + 10  # inside the last string of `test.strings`
    path.write_bytes(data[:cut])
    with pytest.raises(GGUFImportError, match=r"cannot read .* truncated"):
        read_gguf(path)
