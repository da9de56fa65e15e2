"""What a model card says beyond the instance record: facts read off the model's folder (size,
family, format, parameters, quantization) and its sampling defaults (`model_sampling`).

Both read the disk, so `ModelCards.refresh` reads them in a worker thread whenever what this node
hosts changes (`NodeBackend.keep_cards`), and `NodeBackend.models()`, which every request calls,
only looks them up: no disk access on the event loop. A card asked for before its folder was read
says None for these fields, as it does for a folder it cannot read.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from node.models.shape import FLOAT_DTYPES, read_safetensors_header
from node.models.store import dir_size
from node.serving.model_sampling import ModelSampling
from protocol.manifest import Manifest
from protocol.sampling import SamplingDefaults

CardSource = tuple[Manifest | None, Path | None]
"""An instance's manifest, and the folder this node's runner loaded it from (None: not here)."""


class ModelCards:
    """The folder facts and sampling defaults of the models this node serves, as last read."""

    def __init__(self, data_dir: Path) -> None:
        self._sampling = ModelSampling(data_dir)
        self._facts: dict[Path, ModelFacts] = {}
        self._defaults: dict[tuple[str | None, Path | None], SamplingDefaults | None] = {}

    def facts(self, folder: Path | None) -> ModelFacts:
        return self._facts.get(folder, ModelFacts()) if folder is not None else ModelFacts()

    def defaults(self, manifest: Manifest | None, folder: Path | None) -> SamplingDefaults | None:
        return self._defaults.get((manifest.id if manifest else None, folder))

    async def refresh(self, sources: Sequence[CardSource]) -> None:
        """Read what `sources` need, in a worker thread (one refresh at a time: the caller's loop)."""
        await trio.to_thread.run_sync(self._read, list(sources))

    def _read(self, sources: list[CardSource]) -> None:
        for manifest, folder in sources:
            if folder is not None and folder not in self._facts:
                self._facts[folder] = folder_facts(folder)
            self._defaults[manifest.id if manifest else None, folder] = self._sampling.defaults(
                manifest, folder
            )


@dataclass(frozen=True)
class ModelFacts:
    """What a model card says of the model's folder (see `ModelCard`); None where unreadable."""

    size_bytes: int | None = None
    family: str | None = None
    format: str | None = None
    parameter_count: int | None = None
    quantization: str | None = None


@functools.lru_cache(maxsize=64)
def folder_facts(folder: Path) -> ModelFacts:
    """Read once per folder (config.json and the safetensors headers, never a tensor: a few ms), so
    that `models()`, which every request calls, stays a dictionary lookup afterwards."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        tensors: dict[str, dict[str, Any]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            tensors.update(read_safetensors_header(path))
    except (OSError, ValueError):  # ModelShapeError is a ValueError
        return ModelFacts()
    if not isinstance(config, dict):
        return ModelFacts()
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    params = 0
    floats: Counter[str] = Counter()
    for name, info in tensors.items():
        module, _, kind = name.rpartition(".")
        elements = 1
        for dim in info["shape"]:
            elements *= int(dim)
        if f"{module}.scales" in tensors and kind in ("scales", "biases"):
            continue  # a quantized matrix's scales and biases are not weights of their own
        own = quant.get(module) if isinstance(quant, dict) else None
        module_bits = own.get("bits") if isinstance(own, dict) else bits
        if f"{module}.scales" in tensors and isinstance(module_bits, int) and module_bits > 0:
            elements = elements * 32 // module_bits  # uint32 words packing 32/bits weights each
        elif info["dtype"] in FLOAT_DTYPES:
            floats[info["dtype"]] += elements
        params += elements
    quantization: str | None
    if isinstance(bits, int):
        quantization = "MXFP4" if isinstance(quant, dict) and quant.get("mode") == "mxfp4" else f"Q{bits}"
    else:
        quantization = floats.most_common(1)[0][0] if floats else None
    model_type = config.get("model_type")
    return ModelFacts(
        size_bytes=dir_size(folder),
        family=model_type if isinstance(model_type, str) else None,
        format="safetensors" if tensors else None,
        parameter_count=params or None,
        quantization=quantization,
    )
