"""A model folder's sampling defaults: its `generation_config.json`, read where the folder is loaded.

The runner reads it when it loads the model (a pipeline's entry runner for the whole pipeline) and
fills every request's omitted sampling fields from it (`protocol.sampling.resolve_sampling`); the
node reads the same file to show the effective defaults (`/v1/models`). No MLX here: the node
imports this module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from protocol.sampling import SamplingDefaults, model_defaults

log = logging.getLogger("shoal.runner")

GENERATION_CONFIG = "generation_config.json"
"""Hugging Face's name; the GGUF import writes one from the file's `general.sampling.*` keys."""


def read_sampling_defaults(folder: Path) -> SamplingDefaults:
    """The defaults in `folder/generation_config.json`; none when the file is absent or unreadable
    (logged: the model then samples with the server's defaults)."""
    path = Path(folder) / GENERATION_CONFIG
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return SamplingDefaults()
    except OSError as exc:
        log.warning("ignoring %s: %s", path, exc)
        return SamplingDefaults()
    return parse_sampling_defaults(data, origin=path)


def parse_sampling_defaults(data: bytes, *, origin: Path | str) -> SamplingDefaults:
    """The defaults in the bytes of a generation_config.json; none (logged) when it is not JSON."""
    try:
        config = json.loads(data)
    except ValueError as exc:
        log.warning("ignoring %s: %s", origin, exc)
        return SamplingDefaults()
    if not isinstance(config, dict):
        log.warning("ignoring %s: not a JSON object", origin)
        return SamplingDefaults()
    return model_defaults(config)
