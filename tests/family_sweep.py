"""Split every mlx-lm family we can build tiny in 2 and 3 stages, in process, against the whole model.

    .venv/bin/python -m tests.family_sweep [family ...]

Not part of the suite (83 families, ~1 min): run it when mlx-lm changes. Each family's tiny random
model (hidden 64, 6 layers, vocabulary 512, float32) is cut at [3], [2, 4] and [1, 5] with
`node.pipeline.generic.generic_shard`; a 23-token prompt is prefilled in chunks of 5, then 10
tokens are decoded one at a time (the same random tokens fed to both), and every decode step's
logits must equal the whole model's (max |diff| < 1e-4; all were exactly 0 on mlx-lm 0.32.2).
`sens` is how far the logits move when the middle layer is skipped, so a cut that lost a layer
would show. Families in `node.models.shape.UNSPLITTABLE` are left out (they fail here, which is
why they are listed).
"""

from __future__ import annotations

import importlib
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from node.cpu.mlx_lm_quirks import decoder_owner, full_cache, hidden_state_parameter
from node.pipeline.generic import generic_shard
from tests.model_factory import _random_parameters

VOCAB = 512
BASE: dict[str, Any] = {
    **dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4),
    **dict(num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-5, layer_norm_eps=1e-5),
    **dict(norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False),
    **dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2),
    **dict(moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    **dict(routed_scaling_factor=1.0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    **dict(shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8),
    **dict(qk_nope_head_dim=16, v_head_dim=16, sliding_window=4, rope_scaling=None, attention_bias=False),
    "partial_rotary_factor": 1.0,
}
"""Keys most families read; each family's entry below adds or overrides its own."""
FAMILIES: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).with_name("family_sweep.json")).read_text(encoding="utf-8")
)
"""Each family's own config keys (mlx-lm 0.32.2 `ModelArgs`): 6 layers, windows of 4, hybrids' patterns."""


def _model(family: str, weights: dict[str, mx.array] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    from mlx_lm.utils import MODEL_REMAPPING

    config = {**BASE, "model_type": family, **FAMILIES[family]}
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if weights is not None:
        model.update(tree_unflatten(list(weights.items())))
    model.eval()
    return model, config


def _logits(step: Any, prompt: list[int], feed: list[int], chunk: int = 5) -> mx.array:
    """Prefill all but the last prompt token in chunks, then one token at a time: the last prompt
    token and then `feed` (logits of every one-token step, stacked)."""
    pos, out = 0, []
    while len(prompt) - pos > 1:
        n = min(chunk, len(prompt) - 1 - pos)
        mx.eval(step(mx.array([prompt[pos : pos + n]])))
        pos += n
    for token in [prompt[-1], *feed[:-1]]:
        out.append(step(mx.array([[token]]))[:, -1, :])
    return mx.concatenate(out)


def check(family: str, decode: int = 10) -> dict[str, str]:
    """Max |logit difference| of each split against the whole model, and `sens` (see the module)."""
    whole, config = _model(family)
    weights = _random_parameters(dict(tree_flatten(whole.parameters())), 0, mx.float32)
    whole, _ = _model(family, weights)
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(23)]
    feed = [random.Random(2).randrange(VOCAB) for _ in range(decode)]
    cache = full_cache(whole)
    want = _logits(lambda x: whole(x, cache=cache), prompt, feed)
    result = {}
    n = len(whole.layers)
    for cuts in ([n // 2], [n // 3, 2 * n // 3], [1, n - 1]):
        bounds = [0, *cuts, n]
        stages = [
            generic_shard(_model(family, weights)[0], config, start=a, end=b)
            for a, b in itertools.pairwise(bounds)
        ]
        caches = [s.make_cache() for s in stages]

        def step(x: mx.array, stages: list[Any] = stages, caches: list[Any] = caches) -> mx.array:
            for s, c in zip(stages, caches, strict=True):
                x = s.forward(x, c)
            return x

        result[str(cuts)] = f"{float(mx.max(mx.abs(_logits(step, prompt, feed) - want))):.1e}"
    skipped, _ = _model(family, weights)
    owner, key, _ = decoder_owner(skipped)
    assert owner is not None
    layer = owner[key][n // 2]
    hidden = hidden_state_parameter(layer)
    layer.__class__ = type(
        "Skipped", (type(layer),), {"__call__": lambda self, *a, **k: a[0] if a else k[hidden]}
    )
    cache = full_cache(skipped)
    result["sens"] = (
        f"{float(mx.max(mx.abs(_logits(lambda x: skipped(x, cache=cache), prompt, feed) - want))):.1e}"
    )
    return result


def main(names: list[str]) -> int:
    failed = 0
    for family in names or list(FAMILIES):
        try:
            result = check(family)
            ok = all(float(v) < 1e-4 for k, v in result.items() if k != "sens")
        except Exception as exc:  # a family that cannot be built or split: report and go on
            result, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
        failed += not ok
        print(f"{family}: {'OK' if ok else 'FAILED'} {result}", flush=True)
    print(
        f"{len(names or FAMILIES) - failed} of {len(names or FAMILIES)} families split like the whole model"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
