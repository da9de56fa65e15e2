"""Whether a model on the kernels writes its reference's text (float32, or another route).

With int16 activations the kernels' products are within ~1e-5 of float32, so greedy text is the
same token for token. Where the rows kernel rounds quantized weights' activations to int8 (kernels.h,
Acts) the logits move by ~0.3% of their range (measured on these random models), and a random
model's near-ties can then fall the other way. So there both models decode the reference's own
greedy tokens (teacher-forced, a token a step: the rows kernel's path) and every step's logits
must stay within LOGIT_SHARE of the reference's range: the kernel model then picks the
reference's token wherever the reference's top two are further apart than twice that."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from node.cpu.dtype import rounds_to_int8

LOGIT_SHARE = 0.02
"""Largest logit difference allowed, as a share of the reference's logit range at that step
(int8 activations: 0.25-0.4% here; a wrong product or cache: tens of percent)."""


def greedy_tokens(model: Any, tokenizer: Any, prompt: list[int], n: int = 16) -> list[int]:
    from mlx_lm import stream_generate

    return [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n)]


def forced_logits(model: Any, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits after the prompt and after each of tokens[:-1], fed one at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = [model(mx.array(prompt)[None], cache=cache)[0, -1]]
    for token in tokens[:-1]:
        mx.eval(rows[-1])  # each step evaluated before the next: the fused ops update caches in place
        rows.append(model(mx.array([[token]]), cache=cache)[0, -1])
    return np.array(mx.stack(rows).astype(mx.float32), dtype=np.float64)


def assert_same_text(
    model: Any, tokenizer: Any, reference: Any, ref_tokenizer: Any, prompt: list[int]
) -> None:
    """The model writes the reference's greedy text: exactly, or where some of its products round
    activations to int8 (`rounds_to_int8`, as the runner asks), its logits stay close step by step."""
    want = greedy_tokens(reference, ref_tokenizer, prompt)
    if not rounds_to_int8(model):
        assert greedy_tokens(model, tokenizer, prompt) == want
        return
    got, expected = forced_logits(model, prompt, want), forced_logits(reference, prompt, want)
    for step, (row, ref) in enumerate(zip(got, expected, strict=True)):
        gap = float(np.abs(row - ref).max())
        assert gap <= LOGIT_SHARE * float(ref.max() - ref.min()), (step, gap)
