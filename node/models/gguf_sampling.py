"""A GGUF's sampling defaults as the imported folder's `generation_config.json`. Pure.

llama.cpp's converter stores a model's recommended sampling under `general.sampling.*` (from the
source's generation_config.json), and llama.cpp applies them under a request's own settings; the
import writes them back under Hugging Face's names, which the runner reads for any folder
(`protocol.sampling`). Not kept: the sampler order (`general.sampling.sequence`), mirostat and XTC
(Shoal has neither), and `penalty_last_n` (the penalty looks back `REPETITION_CONTEXT` tokens).

A GGUF without them (older converters wrote none) may still be a model whose settings we measured:
`KNOWN_DEFAULTS`, keyed by the GGUF's own `general.organization`, `general.basename` and
`general.size_label` (the built-in model is one). The output is a function of the metadata alone,
so an import is byte-identical each time (the files are hashed into manifests that nodes compare).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
"""llama.cpp's metadata keys (gguf-py's `Keys.General.SAMPLING_*`) -> generation_config.json's names."""

IDENTITY_KEYS = ("organization", "basename", "size_label")
"""The `general.*` keys that say which model a GGUF holds (llama.cpp's converter writes them)."""
KNOWN_DEFAULTS: dict[tuple[str, str, str], dict[str, float]] = {
    ("HuggingFaceTB", "smollm2", "135M"): {"temperature": 0.7, "top_p": 0.1},
}
"""(general.organization, general.basename, general.size_label) -> settings for a GGUF that carries
none. SmolLM2-135M (the built-in model, Q4_1): its card's generation example uses temperature 0.2,
top_p 0.9, but the model is unsure from its first token: "What is the capital of France?" starts
"The" (p = 0.152) or "L" (0.140, on to "L'Étoile ...") about as often, so those settings answer
Paris in 15 of 20 seeded tries (temperature 1.0 with no cut: 8). top_p 0.1 takes the most likely
token wherever it holds at least a tenth of the probability and samples (at 0.7) only where the
model spreads it thinner: 20 of 20 say Paris (`bench/default_sampling.py`), and 20 seeds of "Write
a one-sentence story about a cat." still gave 9 different stories (greedy: 1). Larger SmolLM2
models are surer: the card's settings would suit them, so only the 135M is listed."""

FLOAT_DIGITS = 6
"""GGUF stores float32 (0.95 reads back as 0.949999988...): rounded to this many decimals."""


def gguf_generation_config(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The generation_config.json for a GGUF's metadata, or None when it recommends nothing."""
    config: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        config[name] = int(value) if name == "top_k" else round(float(value), FLOAT_DIGITS)
    if not config:
        organization, basename, size = (str(meta.get(f"general.{key}", "")) for key in IDENTITY_KEYS)
        config = dict(KNOWN_DEFAULTS.get((organization, basename, size), {}))
    if not config:
        return None
    if config.get("temperature", 1.0) > 0:
        config["do_sample"] = True  # as Hugging Face writes it next to sampling settings
    return dict(sorted(config.items()))
