"""`ensure_gguf_model` imports in a child process: the node's memory never holds the weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from node.models import GGUFImportError, builtin_gguf_path, ensure_gguf_model, gguf_convert
from node.models import gguf as gguf_module
from tests.test_gguf_import import Q, TinyModel, write_tiny_gguf


def _no_import_here(*args: object) -> str:
    raise AssertionError("imported in the calling process")


@pytest.fixture
def tiny_q4(tmp_path: Path) -> Path:
    write_tiny_gguf(TinyModel("llama", default=Q.Q4_0), tmp_path / "tiny.gguf")
    return tmp_path / "tiny.gguf"


def test_the_import_runs_in_a_child_process(
    tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_convert, "convert", _no_import_here)
    monkeypatch.setattr(gguf_module, "import_gguf", _no_import_here)
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    out = ensure_gguf_model(tiny_q4, tmp_path / "out")
    assert mx.get_peak_memory() <= active + (1 << 20)  # no MLX buffers made here for the weights
    assert gguf_module.is_current_import(out, tiny_q4)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("a current import is reused, no child started")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert ensure_gguf_model(tiny_q4, tmp_path / "out") == out


def test_a_child_import_error_comes_back_with_its_message(tmp_path: Path) -> None:
    write_tiny_gguf(TinyModel("llama", types={"attn_v": Q.Q3_K}, default=Q.F32), tmp_path / "bad.gguf")
    with pytest.raises(GGUFImportError, match=r"tensor 'blk\.\d\.attn_v\.weight' has type Q3_K"):
        ensure_gguf_model(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hung_child_is_bounded(tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_module, "import_timeout_s", lambda size: 0.01)
    (tmp_path / ".out.partial-killed").mkdir()  # what a child killed mid-import leaves
    with pytest.raises(GGUFImportError, match=r"did not finish within 0 s"):
        ensure_gguf_model(tiny_q4, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "tiny.gguf"]


def test_a_crashed_child_is_reported(tiny_q4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_module, "CHILD_MODULE", "node.models.no_such_module")
    with pytest.raises(GGUFImportError, match=r"failed in its child process \(exit 1\).*No module named"):
        ensure_gguf_model(tiny_q4, tmp_path / "out")


def test_the_timeout_grows_with_the_file() -> None:
    assert gguf_module.import_timeout_s(0) == gguf_module.IMPORT_TIMEOUT_BASE_S
    assert gguf_module.import_timeout_s(4 * 10**9) == pytest.approx(gguf_module.IMPORT_TIMEOUT_BASE_S + 400)


def test_importing_smollm2_does_not_grow_the_callers_memory(tmp_path: Path) -> None:
    """The 98 MB file passes through the child: the caller's resident set stays where it was."""
    process = psutil.Process()
    before = process.memory_info().rss
    out = ensure_gguf_model(builtin_gguf_path(), tmp_path / "smollm2")
    grown = process.memory_info().rss - before
    assert grown < 20 * 2**20, f"the caller grew by {grown / 2**20:.0f} MiB"
    assert (out / "model.safetensors").stat().st_size > 90 * 2**20


def test_the_node_side_of_models_loads_no_import_libraries() -> None:
    """numpy, gguf-py and tokenizers stay in the child: the node process never pays their memory."""
    code = "import sys, node.models; print(sorted({'numpy', 'gguf', 'tokenizers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
