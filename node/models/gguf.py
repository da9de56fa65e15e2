"""Import a `.gguf` file (llama, qwen2, qwen3) into an mlx-lm model folder, weights kept as stored.

`mlx_lm.load` cannot read a GGUF. The import:

1. reads the file with `gguf.GGUFReader` (memory-mapped raw blocks, every tensor type; `mx.load`
   reads only some types, fails on the whole file for others such as Q5_K, and turns BF16 and
   Q4_K/Q6_K into float16);
2. keeps each weight in its stored form: F32/F16/BF16 as they are, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K as
   MLX affine `weight`/`scales`/`biases` triples (group 32; exact but for fp16 scales of the
   K-quants), Q6_K requantized to 8 bits; see `gguf_quants`. config.json gets mlx-lm's
   `quantization` section, with a per-module entry wherever the bits differ from the default;
3. renames tensors to Hugging Face names and, for llama, undoes llama.cpp's q/k row permutation
   on the rows of all three parts alike (rows are output features); see `gguf_arch`;
4. writes config.json and the tokenizer files (see `gguf_tokenizer`), all in a hidden staging
   folder renamed into place, so an interrupted import never leaves a folder that looks complete.

`ensure_gguf_model` (what the node calls) runs the import in a child process: the weights pass
through its memory, never the node's, whose allocators would keep the freed pages. `import_gguf`
does the same work in the calling process (tests). Whatever cannot be imported faithfully raises
`GGUFImportError` naming the tensor, type or setting.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from node.models.gguf_arch import (
    PERMUTED_QK,
    GGUFImportError,
    build_config,
    check_tensor_names,
    hf_tensor_name,
    is_quantizable,
    unpermute_order,
)
from node.models.gguf_quants import (
    AFFINE_BITS,
    GROUP_SIZE,
    PLAIN_DTYPES,
    REQUANTIZED,
    UnsupportedQuantError,
    convert_rows,
    row_chunks,
)
from node.models.gguf_safetensors import SafetensorsWriter
from node.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, tokenizer_config
from node.models.store import folder_lock, publish_dir, staging_dir

__all__ = ["GGUFImportError", "ensure_gguf_model", "import_gguf", "read_gguf"]

log = logging.getLogger("shoal.models")

IMPORTER_VERSION = 2
"""Bump when the import's output changes: cached imports with an older version are redone.
2: weights kept quantized (MLX affine), qwen2/qwen3, llama3 rope factors."""
MARKER_FILE = "shoal_import.json"
"""Written last into an imported folder: which file (path, size, mtime) it was made from, and how."""
WEIGHTS_FILE = "model.safetensors"
CHILD_MODULE = "node.models.gguf_child"
"""Run as `python -m CHILD_MODULE SRC DST`: prints one JSON line, exits 2 on a `GGUFImportError`."""
CHILD_IMPORT_ERROR_RC = 2
IMPORT_TIMEOUT_BASE_S = 300.0
IMPORT_TIMEOUT_BYTES_PER_S = 10e6
"""A child import may take BASE + size / BYTES_PER_S seconds (a 4 GB file: ~12 min). Converting
ran at 100-480 MB/s of GGUF on this 2-core host (Q6_K's requantization: 37 MB/s), so only a hung
or thrashing child hits it; the limit exists because the node holds the folder lock meanwhile
and would otherwise wait forever."""


def import_timeout_s(size_bytes: int) -> float:
    """How long a child import of a file of `size_bytes` may take before it is killed."""
    return IMPORT_TIMEOUT_BASE_S + size_bytes / IMPORT_TIMEOUT_BYTES_PER_S


def read_gguf(gguf_path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The memory-mapped reader of a GGUF file and its metadata as plain Python values."""
    try:
        reader = GGUFReader(gguf_path)
        meta = {key: field.contents() for key, field in reader.fields.items()}
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise GGUFImportError(f"cannot read {gguf_path} as GGUF: {exc}") from exc
    return reader, meta


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


class _Tensor:
    """One GGUF tensor as raw rows, with where it goes: its HF name, row order and output form."""

    def __init__(self, tensor: Any, arch: str, config: Mapping[str, Any]) -> None:
        self.gguf_name = str(tensor.name)
        self.hf_name = hf_tensor_name(self.gguf_name, arch)
        self.qtype = GGMLQuantizationType(int(tensor.tensor_type))
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the row length first
        self.cols = self.shape[-1]
        self.rows = int(np.prod(self.shape[:-1]))
        self.raw = np.asarray(tensor.data).view(np.uint8).reshape(self.rows, -1)
        self.order: np.ndarray[Any, Any] | None = None
        if arch in PERMUTED_QK and self.hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in self.hf_name else "num_key_value_heads"]
            self.order = unpermute_order(self.rows, heads)
        if self.qtype in PLAIN_DTYPES:
            self.bits: int | None = None
        elif self.qtype not in AFFINE_BITS:
            raise GGUFImportError(f"tensor {self.gguf_name!r} has type {self.qtype.name}: not supported")
        elif not is_quantizable(self.hf_name) or len(self.shape) != 2:
            raise GGUFImportError(
                f"tensor {self.gguf_name!r} is {self.qtype.name}, but only Linear/Embedding weights"
                " can stay quantized in MLX"
            )
        else:
            self.bits = AFFINE_BITS[self.qtype]

    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        if self.bits is None:
            return {self.hf_name: (PLAIN_DTYPES[self.qtype], self.shape)}
        base = self.hf_name.removesuffix(".weight")
        groups = (self.rows, self.cols // GROUP_SIZE)
        return {
            self.hf_name: ("U32", (self.rows, self.cols * self.bits // 32)),
            f"{base}.scales": ("F16", groups),
            f"{base}.biases": ("F16", groups),
        }

    def write(self, out: SafetensorsWriter) -> None:
        """Convert and write row chunk by row chunk, in HF row order."""
        names = list(self.specs())
        for start, stop in row_chunks(self.rows, self.cols):
            rows = self.raw[start:stop] if self.order is None else self.raw[self.order[start:stop]]
            if self.bits is None:
                out.write_at(names[0], start * rows.shape[1], rows)
                continue
            try:
                parts = convert_rows(self.qtype, rows, self.cols)
            except UnsupportedQuantError as exc:
                raise GGUFImportError(f"tensor {self.gguf_name!r}: {exc}") from exc
            arrays: tuple[np.ndarray[Any, Any], ...] = parts
            for name, part in zip(names, arrays, strict=True):
                out.write_at(name, start * part[0].nbytes, part)


def quantization_config(tensors: list[_Tensor]) -> dict[str, Any] | None:
    """mlx-lm's `quantization`: the most common bits, plus an entry per module with other bits."""
    bits = {t.hf_name.removesuffix(".weight"): t.bits for t in tensors if t.bits is not None}
    if not bits:
        return None
    default = min(Counter(bits.values()).most_common(), key=lambda kv: (-kv[1], kv[0]))[0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != default:
            config[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def _summary(gguf_path: Path, tensors: list[_Tensor]) -> str:
    kinds = Counter(t.qtype.name for t in tensors)
    text = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    requantized = sum(1 for t in tensors if t.qtype in REQUANTIZED)
    if requantized:
        text += f"; {requantized} Q6_K tensors requantized to 8-bit affine (no exact group-32 form)"
    return f"imported {gguf_path.name}: {text} tensors kept as stored"


def _import(gguf_path: Path, out_dir: Path) -> str:
    """The import itself; returns a one-line summary of what was kept and what was requantized."""
    reader, meta = read_gguf(gguf_path)
    arch = str(meta.get("general.architecture"))
    by_name = {str(t.name): t for t in reader.tensors}
    rope = by_name.pop("rope_freqs.weight", None)
    rope_freqs = None if rope is None else np.asarray(rope.data, dtype=np.float32)
    try:
        config = build_config(meta, has_output="output.weight" in by_name, rope_freqs=rope_freqs)
    except GGUFImportError as exc:
        raise GGUFImportError(f"{gguf_path}: {exc}") from exc
    check_tensor_names(by_name, arch, config["num_hidden_layers"])
    tensors = [_Tensor(t, arch, config) for t in by_name.values()]
    embed_rows = next(t.rows for t in tensors if t.gguf_name == "token_embd.weight")
    if embed_rows != config["vocab_size"]:
        raise GGUFImportError(f"token_embd has {embed_rows} rows but the vocabulary {config['vocab_size']}")
    if quant := quantization_config(tensors):
        config["quantization"] = quant
        config["quantization_config"] = quant  # both, as mlx-lm's own quantized checkpoints have
    try:
        tokenizer = build_tokenizer(meta)
    except GGUFTokenizerError as exc:
        raise GGUFImportError(f"{gguf_path}: {exc}") from exc
    tok_config = tokenizer_config(meta, context_length=config["max_position_embeddings"])

    specs = {name: spec for t in tensors for name, spec in t.specs().items()}
    with staging_dir(out_dir) as staging:
        with SafetensorsWriter(staging / WEIGHTS_FILE, specs, metadata={"format": "mlx"}) as out:
            for tensor in tensors:
                tensor.write(out)
        _write_json(staging / "config.json", config)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tok_config)
        _write_json(staging / MARKER_FILE, source_stamp(gguf_path))  # last: the import is complete
        publish_dir(staging, out_dir)
    return _summary(gguf_path, tensors)


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Import `gguf_path` into the mlx-lm folder `out_dir` (replacing it), in this process.

    Always does the work; `ensure_gguf_model` is the cached, out-of-process form.
    Raises `GGUFImportError` (a `ModelResolveError`) for files it cannot import faithfully.
    """
    log.info("%s", _import(Path(gguf_path), out_dir))
    return out_dir


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def import_in_child(gguf_path: Path, out_dir: Path) -> str:
    """Run the import in a child Python process; its summary line, or its `GGUFImportError`."""
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds the `node` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    timeout = import_timeout_s(gguf_path.stat().st_size)
    try:
        done = subprocess.run(
            [sys.executable, "-m", CHILD_MODULE, str(gguf_path), str(out_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise GGUFImportError(f"importing {gguf_path} did not finish within {timeout:.0f} s") from exc
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    if done.returncode == CHILD_IMPORT_ERROR_RC and "error" in result:
        raise GGUFImportError(str(result["error"]))
    if done.returncode != 0 or "summary" not in result:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        rc = done.returncode
        raise GGUFImportError(f"importing {gguf_path} failed in its child process (exit {rc}): {tail}")
    return str(result["summary"])


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
