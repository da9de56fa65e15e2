"""Decode runs whose outputs two loads of one model must agree on to the bit (the fused layers and
the layer stack against the ways they replace)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

BATCHED_TOKENS = 17
"""Tokens `batched` collects: 3 + 9 + 5."""


def logits_alone(model: Any, prompt: int = 9, steps: int = 3) -> list[mx.array]:
    """One sequence on mlx-lm's KVCache: the prompt's logits, then `steps` greedy decode steps'."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([list(range(300, 300 + prompt))]), cache=cache)]
    token = mx.array([[7]])
    for _ in range(steps):
        logits = model(token, cache=cache)
        out.append(logits)
        token = mx.argmax(logits[:, -1, :], axis=-1)[None]
    mx.eval(out)
    return out


def batched(model: Any) -> list[tuple[int, int, mx.array]]:
    """A padded batch on mlx-lm's `BatchGenerator`, as the runner runs it, where one sequence ends
    early (the batch is filtered) and one joins later (it is extended): every token and its
    logprobs, in order."""
    generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
    generator.insert([list(range(400, 405)), list(range(500, 512))], max_tokens=[3, 9])
    seen: list[tuple[int, int, mx.array]] = []
    for step in range(60):
        if step == 4:
            generator.insert([list(range(600, 607))], max_tokens=[5])
        _, responses = generator.next()
        seen += [(r.uid, r.token, r.logprobs) for r in responses]
        if len(seen) >= BATCHED_TOKENS:
            break
    generator.close()
    return seen
