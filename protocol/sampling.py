"""Which sampling settings a request runs with: its own, else the model's, else the server's. Pure.

A request names only what it wants (`protocol.chat.SamplingParams`, None = "not given"). The model
may recommend defaults: Hugging Face's `generation_config.json` (the GGUF import writes one from
`general.sampling.*`), parsed by `model_defaults`. `resolve_sampling` decides each field on its own:

    request field given?  -> the request's value
    model recommends it?  -> the model's value
    otherwise             -> SERVER_DEFAULTS

as vLLM applies `generation_config.json` and llama.cpp its GGUF metadata, field by field, under a
request. The result (`Sampling`) has every field decided; it is what the sampler runs
(`node.pipeline.shard.request_sampler`) and what travels to a pipeline's last stage, so that every
process samples the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.chat import SamplingParams

REPETITION_CONTEXT = 20
"""Tokens the repetition penalty looks back over: mlx-lm's default (`make_logits_processors`)."""


class SamplingDefaults(BaseModel):
    """What a model recommends; None: it says nothing about that field."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)

    def given(self) -> tuple[str, ...]:
        """The fields the model sets, in declaration order."""
        return tuple(name for name in type(self).model_fields if getattr(self, name) is not None)


class Sampling(BaseModel):
    """The settings a request samples with, every one decided (see `resolve_sampling`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float = Field(ge=0, allow_inf_nan=False)
    """0: greedy (argmax); the filters below then do nothing."""
    top_p: float = Field(gt=0, le=1)
    """1: no nucleus cut."""
    top_k: int = Field(ge=0)
    """0: no limit."""
    min_p: float = Field(ge=0, le=1)
    """0: no cut. Else drop tokens below `min_p` times the most likely token's probability."""
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    """1: off. Else the logits of the last `REPETITION_CONTEXT` tokens are divided by it (multiplied
    when negative), as mlx-lm's and Hugging Face's penalty does."""
    seed: int | None = None
    """Set: the request draws from its own PRNG key (see `SamplingParams.seed`)."""


SERVER_DEFAULTS = Sampling(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0)
"""For a field neither the request nor the model sets: llama.cpp server's defaults (its
`common_params_sampling`, unchanged since 2024), chosen because they are the most widely run defaults
for local models of every size and keep a small model on topic: top-k 40 and min-p 0.05 drop the long
tail that temperature 1.0 samples from (SmolLM2-135M at 1.0 with no cut answered "What is the capital
of France?" with "Ze capital is Brumaunthrop."), while 0.8 still varies the text. No repetition
penalty: llama.cpp's default is 1.0 (off) too."""

GREEDY = Sampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
"""Argmax decoding: what the pipeline driver does when it is given no sampling settings."""

_DEFAULTED = tuple(SamplingDefaults.model_fields)
"""The fields a model or the server may default, in `Sampling`'s order."""


def resolve_sampling(request: SamplingParams, model: SamplingDefaults) -> Sampling:
    """Each field: the request's if given, else the model's if it recommends one, else the server's."""
    decided: dict[str, Any] = {"seed": request.seed}
    for name in _DEFAULTED:
        asked = getattr(request, name)
        recommended = getattr(model, name)
        if asked is not None:
            decided[name] = asked
        elif recommended is not None:
            decided[name] = recommended
        else:
            decided[name] = getattr(SERVER_DEFAULTS, name)
    return Sampling(**decided)


def model_defaults(generation_config: Mapping[str, Any]) -> SamplingDefaults:
    """The sampling defaults in a parsed `generation_config.json`; fields it lacks or that are not
    valid values (a string, a negative temperature, `top_k: -1`...) say nothing.

    `do_sample: false` means greedy, as in Hugging Face's `generate`: temperature 0 whatever
    `temperature` says. A missing `do_sample` says nothing (vLLM reads it the same way: many
    configs list sampling values without it)."""
    fields: dict[str, Any] = {}
    for name in _DEFAULTED:
        value = generation_config.get(name)
        if name == "top_k":
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                fields[name] = value
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            fields[name] = float(value)
    if generation_config.get("do_sample") is False:
        fields["temperature"] = 0.0
    valid: dict[str, Any] = {}
    for name, value in fields.items():
        try:
            SamplingDefaults(**{name: value})
        except ValueError:
            continue
        valid[name] = value
    return SamplingDefaults(**valid)
