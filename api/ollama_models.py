"""The models the backend serves, in Ollama's shapes: `/api/tags`, `/api/show`, `/api/ps`, `/api/version`.

Pure functions of `ModelCard`s. What Shoal does not have it does not invent: `digest` is a SHA-256 of
the model's id and size (a stable identifier, not the hash of an Ollama manifest), `modified_at` is
when this node started serving, `template` and `parameters` are empty (the chat template lives in
the model folder and Shoal applies it itself). A placed model stays loaded, so `/api/ps` lists every
served model with an `expires_at` that never comes, and `size_vram` is 0 (weights are in RAM).
"""

from __future__ import annotations

import hashlib
from typing import Any

from api.backend import ModelCard
from api.ollama_encode import rfc3339

OLLAMA_VERSION = "0.12.0"
"""The Ollama API version `/api/version` reports: one whose clients know `think`, `tools` with
tool-call ids and `thinking` output, all of which this surface speaks."""
NEVER = "9999-12-31T23:59:59Z"
"""`expires_at` of a model that is never unloaded."""
REASONING_FAMILIES = frozenset({"gpt_oss", "qwen3", "qwen3_moe"})
"""Architectures whose chat formats reason first; `/api/show` gives them the "thinking" capability."""


_SIZE_UNITS = ((10**9, "B", 1), (10**6, "M", 2), (10**3, "K", 0))
"""(scale, unit, decimals unless whole) of Ollama's parameter sizes: "8B", "3.2B", "134.52M"."""


def parameter_size(count: int | None) -> str:
    """A parameter count as Ollama writes it; "" when unknown."""
    if not count:
        return ""
    for scale, unit, decimals in _SIZE_UNITS:
        if count >= scale:
            value = count / scale
            return f"{value:.{0 if value.is_integer() else decimals}f}{unit}"
    return str(count)


def details(card: ModelCard) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": card.format or "",
        "family": card.family or "",
        "families": [card.family] if card.family else None,
        "parameter_size": parameter_size(card.parameter_count),
        "quantization_level": card.quantization or "",
    }


def _digest(card: ModelCard) -> str:
    return hashlib.sha256(f"{card.id}\0{card.size_bytes}".encode()).hexdigest()


def _listed(card: ModelCard) -> dict[str, Any]:
    return {
        "name": card.id,
        "model": card.id,
        "size": card.size_bytes or 0,
        "digest": _digest(card),
        "details": details(card),
    }


def tags(cards: list[ModelCard]) -> dict[str, Any]:
    """`GET /api/tags`: the models requests may name."""
    return {"models": [{**_listed(card), "modified_at": rfc3339(card.created)} for card in cards]}


def running(cards: list[ModelCard]) -> dict[str, Any]:
    """`GET /api/ps`: every served model is loaded, for good."""
    models = []
    for card in cards:
        entry = {**_listed(card), "expires_at": NEVER, "size_vram": 0}
        if card.context_length is not None:
            entry["context_length"] = card.context_length
        models.append(entry)
    return {"models": models}


def capabilities(card: ModelCard) -> list[str]:
    """Every model completes and may be given tools (its chat template decides how they read)."""
    found = ["completion", "tools"]
    if card.family in REASONING_FAMILIES:
        found.append("thinking")
    return found


def show(card: ModelCard) -> dict[str, Any]:
    """`POST /api/show`: the card, with `model_info` in Ollama's `general.*` / `<arch>.*` keys."""
    info: dict[str, Any] = {}
    if card.family:
        info["general.architecture"] = card.family
    if card.parameter_count:
        info["general.parameter_count"] = card.parameter_count
    if card.family and card.context_length is not None:
        info[f"{card.family}.context_length"] = card.context_length
    return {
        "modelfile": f"# Served by Shoal\nFROM {card.id}\n",
        "parameters": "",
        "template": "",
        "details": details(card),
        "model_info": info,
        "capabilities": capabilities(card),
        "modified_at": rfc3339(card.created),
    }


def version() -> dict[str, Any]:
    return {"version": OLLAMA_VERSION}
