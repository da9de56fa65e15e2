"""The GGUF import's conversion, run in the child process (`gguf_child`) or by `import_gguf`.

It reads the file with numpy and gguf-py and writes the mlx-lm folder; see `node.models.gguf` for
what the import keeps and why it runs out of the node's process. Importing this module loads
numpy, gguf and tokenizers, so the node process never does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from node.models.generation_config import GENERATION_CONFIG
from node.models.gguf import MARKER_FILE, WEIGHTS_FILE, GGUFImportError, source_stamp
from node.models.gguf_arch import (
    PERMUTED_QK,
    build_config,
    check_tensor_names,
    hf_tensor_name,
    is_quantizable,
    unpermute_order,
    weight_rank,
)
from node.models.gguf_quants import (
    GROUP_SIZE,
    PLAIN_DTYPES,
    QUANTIZED_BITS,
    REQUANTIZED,
    UnsupportedQuantError,
    convert_mxfp4_rows,
    convert_rows,
    quant_mode,
    row_chunks,
)
from node.models.gguf_reader import FastGGUFReader
from node.models.gguf_safetensors import SafetensorsWriter
from node.models.gguf_sampling import gguf_generation_config
from node.models.gguf_tokenizer import GGUFTokenizerError, build_tokenizer, tokenizer_config
from node.models.store import publish_dir, staging_dir


def read_gguf(gguf_path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The memory-mapped reader of a GGUF file and its metadata as plain Python values."""
    try:
        reader = FastGGUFReader(gguf_path)
        meta = {key: field.contents() for key, field in reader.fields.items()}
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise GGUFImportError(f"cannot read {gguf_path} as GGUF: {exc}") from exc
    return reader, meta


def header_config(
    reader: GGUFReader, meta: dict[str, Any]
) -> tuple[str, dict[str, ReaderTensor], dict[str, Any]]:
    """The architecture, the tensors by name (less rope_freqs, which goes into the config) and the
    config.json the header gives; raises `GGUFImportError` (shared by the import and its check)."""
    by_name = {str(t.name): t for t in reader.tensors}
    rope = by_name.pop("rope_freqs.weight", None)
    rope_freqs = None if rope is None else np.asarray(rope.data, dtype=np.float32)
    config = build_config(meta, has_output="output.weight" in by_name, rope_freqs=rope_freqs)
    return str(meta.get("general.architecture")), by_name, config


def check_type(name: str, qtype: GGMLQuantizationType) -> None:
    """Refuse a tensor type the import has no rule for."""
    if qtype not in PLAIN_DTYPES and qtype not in QUANTIZED_BITS:
        raise GGUFImportError(f"tensor {name!r} has type {qtype.name}: not supported")


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
        check_type(self.gguf_name, self.qtype)
        if self.qtype in PLAIN_DTYPES:
            self.bits: int | None = None
        elif not is_quantizable(self.hf_name) or len(self.shape) != weight_rank(self.hf_name):
            raise GGUFImportError(
                f"tensor {self.gguf_name!r} is {self.qtype.name}, but only Linear/Embedding/SwitchLinear"
                " weights can stay quantized in MLX"
            )
        else:
            self.bits = QUANTIZED_BITS[self.qtype]
        self.mode = quant_mode(self.qtype)

    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        if self.bits is None:
            return {self.hf_name: (PLAIN_DTYPES[self.qtype], self.shape)}
        base = self.hf_name.removesuffix(".weight")
        groups = (*self.shape[:-1], self.cols // GROUP_SIZE)  # experts: (experts, rows, groups)
        weight = {self.hf_name: ("U32", (*self.shape[:-1], self.cols * self.bits // 32))}
        if self.mode == "mxfp4":  # E8M0 scale bytes, no biases
            return weight | {f"{base}.scales": ("U8", groups)}
        return weight | {f"{base}.scales": ("F16", groups), f"{base}.biases": ("F16", groups)}

    def write(self, out: SafetensorsWriter) -> None:
        """Convert and write row chunk by row chunk, in HF row order."""
        names = list(self.specs())
        for start, stop in row_chunks(self.rows, self.cols):
            rows = self.raw[start:stop] if self.order is None else self.raw[self.order[start:stop]]
            if self.bits is None:
                out.write_at(names[0], start * rows.shape[1], rows)
                continue
            try:
                if self.mode == "mxfp4":
                    arrays: tuple[np.ndarray[Any, Any], ...] = convert_mxfp4_rows(rows, self.cols)
                else:
                    arrays = convert_rows(self.qtype, rows, self.cols)
            except UnsupportedQuantError as exc:
                raise GGUFImportError(f"tensor {self.gguf_name!r}: {exc}") from exc
            for name, part in zip(names, arrays, strict=True):
                out.write_at(name, start * part[0].nbytes, part)


def quantization_config(tensors: list[_Tensor]) -> dict[str, Any] | None:
    """mlx-lm's `quantization`: the most common bits and mode, plus an entry per module that differs."""
    forms = {t.hf_name.removesuffix(".weight"): (t.bits, t.mode) for t in tensors if t.bits is not None}
    if not forms:
        return None
    default = min(Counter(forms.values()).most_common(), key=lambda kv: (-kv[1], kv[0]))[0]
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default[0], "mode": default[1]}
    for module, (bits, mode) in sorted(forms.items()):
        if (bits, mode) != default:
            config[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": mode}
    return config


def _summary(gguf_path: Path, tensors: list[_Tensor]) -> str:
    kinds = Counter(t.qtype.name for t in tensors)
    text = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    requantized = sum(1 for t in tensors if t.qtype in REQUANTIZED)
    if requantized:
        text += f"; {requantized} Q6_K tensors requantized to 8-bit affine (no exact group-32 form)"
    return f"imported {gguf_path.name}: {text} tensors kept as stored"


def convert(gguf_path: Path, out_dir: Path) -> str:
    """The import itself; returns a one-line summary of what was kept and what was requantized."""
    reader, meta = read_gguf(gguf_path)
    try:
        arch, by_name, config = header_config(reader, meta)
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
    generation = gguf_generation_config(meta)

    specs = {name: spec for t in tensors for name, spec in t.specs().items()}
    with staging_dir(out_dir) as staging:
        with SafetensorsWriter(staging / WEIGHTS_FILE, specs, metadata={"format": "mlx"}) as out:
            for tensor in tensors:
                tensor.write(out)
        _write_json(staging / "config.json", config)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tok_config)
        if generation is not None:
            _write_json(staging / GENERATION_CONFIG, generation)
        _write_json(staging / MARKER_FILE, source_stamp(gguf_path))  # last: the import is complete
        publish_dir(staging, out_dir)
    return _summary(gguf_path, tensors)


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
