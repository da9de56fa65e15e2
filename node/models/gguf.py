"""Import a `.gguf` file (llama, qwen2, qwen3, qwen3moe, gpt-oss) into an mlx-lm folder, weights as stored.

`mlx_lm.load` cannot read a GGUF. The import:

1. reads the file with `gguf.GGUFReader` (memory-mapped raw blocks, every tensor type; `mx.load`
   reads only some types, fails on the whole file for others such as Q5_K, and turns BF16 and
   Q4_K/Q6_K into float16), its metadata arrays in one pass (`gguf_reader`);
2. keeps each weight in its stored form: F32/F16/BF16 as they are, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K as
   MLX affine `weight`/`scales`/`biases` triples (group 32; exact but for fp16 scales of the
   K-quants), Q6_K requantized to 8 bits, MXFP4 as MLX `mxfp4` (exact); see `gguf_quants`.
   Expert tensors (experts, rows, cols) are converted row by row alike and become mlx-lm's
   SwitchLinear weights. config.json gets mlx-lm's `quantization` section, with a per-module entry
   wherever the bits or mode differ from the default;
3. renames tensors to Hugging Face names and, for llama, undoes llama.cpp's q/k row permutation
   on the rows of all three parts alike (rows are output features); see `gguf_arch`;
4. writes config.json, the tokenizer files (see `gguf_tokenizer`) and, when the file or its family
   recommends sampling settings, generation_config.json (see `gguf_sampling`), all in a hidden staging
   folder renamed into place, so an interrupted import never leaves a folder that looks complete.

`ensure_gguf_model` (what the node calls) runs the import in a child process: the weights pass
through its memory, never the node's, whose allocators would keep the freed pages. `import_gguf`
does the same work in the calling process (tests). Whatever cannot be imported faithfully raises
`GGUFImportError` naming the tensor, type or setting.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

from node.models.json_child import GGUFImportError, run_child
from node.models.store import folder_lock

__all__ = ["GGUFImportError", "ensure_gguf_model", "import_gguf"]

log = logging.getLogger("shoal.models")

IMPORTER_VERSION = 3
"""Bump when the import's output changes: cached imports with an older version are redone.
2: weights kept quantized (MLX affine), qwen2/qwen3, llama3 rope factors.
3: generation_config.json with the sampling defaults (`gguf_sampling`)."""
MARKER_FILE = "shoal_import.json"
"""Written last into an imported folder: which file (path, size, mtime) it was made from, and how."""
WEIGHTS_FILE = "model.safetensors"
CHILD_MODULE = "node.models.gguf_child"
"""Run as `python -m CHILD_MODULE SRC DST` (`node.models.json_child`'s protocol)."""
IMPORT_TIMEOUT_BASE_S = 300.0
IMPORT_TIMEOUT_BYTES_PER_S = 10e6
"""A child import may take BASE + size / BYTES_PER_S seconds (a 4 GB file: ~12 min). Converting
ran at 100-480 MB/s of GGUF on this 2-core host (Q6_K's requantization: 37 MB/s), so only a hung
or thrashing child hits it; the limit exists because the node holds the folder lock meanwhile
and would otherwise wait forever."""


def import_timeout_s(size_bytes: int) -> float:
    """How long a child import of a file of `size_bytes` may take before it is killed."""
    return IMPORT_TIMEOUT_BASE_S + size_bytes / IMPORT_TIMEOUT_BYTES_PER_S


def source_stamp(gguf_path: Path) -> dict[str, Any]:
    """What identifies the file an import came from (cheap: no hashing of 100s of MB)."""
    st = gguf_path.stat()
    return {
        "source": str(gguf_path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "importer_version": IMPORTER_VERSION,
    }


def is_current_import(out_dir: Path, gguf_path: Path) -> bool:
    """Whether `out_dir` is a complete import of this very file by this importer version."""
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(marker == source_stamp(gguf_path) and (out_dir / WEIGHTS_FILE).is_file())


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Import `gguf_path` into the mlx-lm folder `out_dir` (replacing it), in this process.

    Always does the work; `ensure_gguf_model` is the cached, out-of-process form.
    Raises `GGUFImportError` (a `ModelResolveError`) for files it cannot import faithfully.
    """
    from node.models.gguf_convert import convert  # numpy, gguf, tokenizers: only when importing

    log.info("%s", convert(Path(gguf_path), out_dir))
    return out_dir


def import_in_child(gguf_path: Path, out_dir: Path) -> str:
    """Run the import in a child Python process; its summary line, or its `GGUFImportError`."""
    timeout = import_timeout_s(gguf_path.stat().st_size)
    try:
        done = run_child(CHILD_MODULE, [str(gguf_path), str(out_dir)], timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise GGUFImportError(f"importing {gguf_path} did not finish within {timeout:.0f} s") from exc
    done.raise_refusal()
    if done.returncode != 0 or "summary" not in done.answer:
        rc, tail = done.returncode, done.tail
        raise GGUFImportError(f"importing {gguf_path} failed in its child process (exit {rc}): {tail}")
    return str(done.answer["summary"])


def _remove_partials(out_dir: Path) -> None:
    """Staging folders of `out_dir` a killed child left behind (ours alone: we hold its lock)."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def ensure_gguf_model(gguf_path: Path, out_dir: Path) -> Path:
    """`out_dir`, imported from `gguf_path` (in a child process) unless a current import is there.

    Safe to call from several processes at once: one imports while the others wait, then reuse it.
    """
    gguf_path = Path(gguf_path)
    if is_current_import(out_dir, gguf_path):
        return out_dir
    with folder_lock(out_dir):
        if is_current_import(out_dir, gguf_path):
            return out_dir
        log.info("importing %s into %s (once; in a child process)", gguf_path, out_dir)
        try:
            log.info("%s", import_in_child(gguf_path, out_dir))
        except GGUFImportError:
            _remove_partials(out_dir)
            raise
        if not is_current_import(out_dir, gguf_path):
            raise GGUFImportError(f"importing {gguf_path} left no complete folder at {out_dir}")
        return out_dir
