"""Kernel sets chosen by measurement on this CPU, per layout and row class, not by instruction set alone.

The widest kernels are not the fastest everywhere: a CPU that runs 512-bit work as two halves, or
one whose cache holds a small model whole, can be faster on a narrower set. So when a runner has
loaded a model on the kernels, it times every set the CPU runs (`rows_candidates`: AVX-512 with
VBMI, AVX-512, AVX2; with int8 activations only the sets that have them) on the model's own
weights, for each layout its products use (affine 4-bit, 8-bit, MXFP4, 16-bit) and each row class
(one row: decode; four: a small batch). The sets take turns over `CALIBRATION_ROUNDS` rounds, so
a host's drift hits each alike, and the lowest median wins unless it beats the default (the
widest set) by less than `MARGIN`. Prefill (more than 8 rows) keeps the widest set's gemm.

Results are cached per CPU model and kernel build in `$SHOAL_CACHE_DIR` (default
`$XDG_CACHE_HOME/shoal`, else `~/.cache/shoal`): a later start reads them, and measures only a
layout not measured yet. `SHOAL_KERNEL_CALIBRATE`: `on` (default), `redo` (measure again and
overwrite the cache), `off` (the widest set everywhere, as before calibration existed).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from node.cpu.fused_layers import Projection, projection
from node.cpu.kernel_layers import KernelDenseEmbedding, KernelQuantizedEmbedding, KernelQuantizedLinear

ROW_CLASSES = (1, 4)
"""Rows timed per class: decode's one, and a small batch's (2-8 rows share a choice)."""
CALIBRATION_ROUNDS = 7
"""Turns each set takes per class: medians of 7 interleaved turns held still where single runs of
one path moved by up to 1.5x on a shared 2-core host."""
CALIBRATION_BYTES = 256 << 20
"""Weights timed per layout at most (the model's first layers): more than a 32 MB L3 holds, and a
round of them takes ~10 ms, so a whole calibration stays around a second or two."""
MARGIN = 0.03
"""How much faster than the default another set must be to replace it: less is within the noise."""
SETTINGS = ("on", "redo", "off")
_LAYERS = (KernelQuantizedLinear, KernelQuantizedEmbedding, KernelDenseEmbedding)
_DENSE = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32"}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), printed with every speed figure: hosts differ."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def layout(layer: Any) -> str:
    """The kernels' name for a layer's weight layout (`choose_rows_kernels`' format)."""
    if layer.bits == 16:
        return _DENSE.get(layer["weight"].dtype, "f32")
    if layer.bits == 8:
        return "affine8"
    return "mxfp4" if layer["scales"].dtype == mx.uint8 else "affine4"


def sample_weights(model: nn.Module, limit: int = CALIBRATION_BYTES) -> dict[str, list[Projection]]:
    """Per layout, the model's kernel layers in order until `limit` bytes of weights."""
    sampled: dict[str, list[Projection]] = {}
    held: dict[str, int] = {}
    for _, module in model.named_modules():
        if not isinstance(module, _LAYERS):
            continue
        name = layout(module)
        if held.get(name, 0) < limit:
            sampled.setdefault(name, []).append(projection(module))
            held[name] = held.get(name, 0) + module["weight"].nbytes
    return sampled


def decide(medians: Mapping[str, float], default: str, margin: float = MARGIN) -> str:
    """The set to run: the fastest, unless it beats `default` by less than `margin`."""
    fastest = min(medians, key=lambda name: medians[name])
    return fastest if medians[fastest] < (1.0 - margin) * medians[default] else default


def measure(kernels: ModuleType, weights: list[Projection], rows: int, rounds: int) -> dict[str, float]:
    """Median seconds of one pass over `weights` per candidate set, the sets taking turns."""
    names = list(kernels.rows_candidates())
    for name in names:  # a first touch of the weights and each set's buffers, not counted
        kernels.time_rows(weights, rows, name, 1)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            times[name].append(kernels.time_rows(weights, rows, name, 1))
    return {name: statistics.median(t) for name, t in times.items()}


def cache_file(kernels: ModuleType, environ: Mapping[str, str]) -> Path:
    """Where this CPU model's choices for this kernel build are kept."""
    root = environ.get("SHOAL_CACHE_DIR") or str(
        Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shoal"
    )
    build = hashlib.sha256(Path(str(kernels.__file__)).read_bytes()).hexdigest()[:16]
    key = hashlib.sha256(f"{cpu_model()}\n{build}".encode()).hexdigest()[:16]
    return Path(root).expanduser() / f"kernels-{key}.json"


def _read(path: Path, candidates: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Cached choices whose set this process runs (anything unreadable counts as not measured)."""
    try:
        choices = json.loads(path.read_text())["choices"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(choices, dict):
        return {}
    names = set(candidates)
    return {k: v for k, v in choices.items() if isinstance(v, dict) and v.get("kernel") in names}


def _write(path: Path, choices: Mapping[str, Mapping[str, Any]]) -> None:
    """Best effort: a cache that cannot be written only means measuring again next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps({"cpu": cpu_model(), "choices": choices}, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError:
        pass


def calibrate(model: nn.Module, kernels: ModuleType, environ: Mapping[str, str] | None = None) -> str:
    """Choose each layout's set for `model`'s products (measuring what the cache lacks); a log phrase."""
    environ = os.environ if environ is None else environ
    setting = environ.get("SHOAL_KERNEL_CALIBRATE", "on").strip().lower()
    if setting not in SETTINGS:
        raise ValueError(f"SHOAL_KERNEL_CALIBRATE={setting!r}: use one of {', '.join(SETTINGS)}")
    candidates = list(kernels.rows_candidates())
    if setting == "off" or len(candidates) < 2:
        return f"kernels: {kernels.kernel_name()} for every product (calibration {setting})"
    path = cache_file(kernels, environ)
    cached = {} if setting == "redo" else _read(path, candidates)
    choices, measured = dict(cached), 0
    for name, weights in sample_weights(model).items():
        for rows in ROW_CLASSES:
            key = f"{name}/{rows}"
            if key not in choices:
                medians = measure(kernels, weights, rows, CALIBRATION_ROUNDS)
                choice = decide(medians, candidates[0])
                choices[key] = {"kernel": choice, "ms": {k: round(v * 1e3, 4) for k, v in medians.items()}}
                measured += 1
            kernels.choose_rows_kernels(name, rows, choices[key]["kernel"])
    if measured:
        _write(path, choices)
    picked = ", ".join(f"{key} {value['kernel']}" for key, value in sorted(choices.items()))
    source = f"measured {measured} now" if measured else "cached"
    return f"kernels by measurement ({source}, {path}): {picked or 'no quantized products'}"
