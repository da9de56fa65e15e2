"""Families without a hand-written stage forward (`node.pipeline.generic`) split like one process.

Each family's tiny random model, split in 2 and 3 stages over real stage processes (later
families: 3), gives the greedy tokens of `mlx_lm.stream_generate` on the whole model, prefilled in
chunks (so sliding windows and their masks cross chunk and stage boundaries) and in one piece. A
tied gemma3 (the head is the embedding, so the last stage holds it too) as well. Hybrid families
(qwen3_next, lfm2: recurrent or convolution state in `ArraysCache`s) split the same way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast, get_args

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from node.pipeline.generic import GenericShard, generic_shard
from node.pipeline.shard import ShardError, load_shard
from tests.family_models import Family, make_family_model
from tests.test_pipeline import _prompt, ring, run, single_process

IN_PROCESS = ("nanochat", "baichuan_m1", "gpt_neox", "gptj")
STAGE_FAMILIES = [f for f in get_args(Family) if f not in IN_PROCESS]
"""Run on real stage processes; the other families are split in process only (`test_in_process`)."""


@pytest.fixture(scope="module", params=[*STAGE_FAMILIES, "gemma3_text-tied"])
def family_dir(
    request: pytest.FixtureRequest, builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    family = cast(Family, request.param.removesuffix("-tied"))
    tied = request.param.endswith("-tied")
    return make_family_model(
        tmp_path_factory.mktemp(family) / request.param, family, tokenizer_from=builtin_model_dir, tied=tied
    )


SPLITS = [
    *[
        (family, stages)
        for family in ("gemma3_text", "gemma3_text-tied", "phi3", "qwen3_moe", "gpt_oss")
        for stages in (2, 3)
    ],
    *[(family, 3) for family in ("mixtral", "deepseek_v3", "qwen3_next", "lfm2")],
]
"""Later families only in 3 stages (a first, a middle and a last stage: every role), to keep the time down."""


@pytest.mark.parametrize(("family_dir", "stages"), SPLITS, indirect=["family_dir"])
def test_greedy_tokens_match_one_process(family_dir: Path, stages: int) -> None:
    prompt = _prompt(family_dir)
    chunked = single_process(family_dir, prompt, max_tokens=8, prefill_step_size=8)
    whole, _ = single_process(family_dir, prompt, max_tokens=4)
    with ring(family_dir, stages) as (driver, _):
        assert isinstance(driver.shard, GenericShard)
        assert run(driver, family_dir, prompt, max_tokens=8, prefill_step_size=8) == chunked
        assert run(driver, family_dir, prompt, max_tokens=4)[0] == whole


def test_a_family_a_stage_cannot_run_is_refused_with_why() -> None:
    with pytest.raises(ShardError, match="'gemma3n' cannot be split into stages: its layers take per-layer"):
        generic_shard(nn.Module(), {"model_type": "gemma3n"}, start=0, end=1)
    with pytest.raises(ShardError, match=r"'hunyuan' cannot be split .* on to the next layer"):
        generic_shard(nn.Module(), {"model_type": "hunyuan"}, start=0, end=1)
    with pytest.raises(ShardError, match="has no list of decoder layers"):
        generic_shard(nn.Module(), {"model_type": "unknown"}, start=0, end=1)


def test_a_middle_stage_holds_only_its_layers(family_dir: Path) -> None:
    """Memory follows the share: no embedding, norm or head, no other stage's layers."""
    middle = load_shard(family_dir, start=2, end=4)
    names = {name for name, _ in cast(list[tuple[str, mx.array]], tree_flatten(middle.parameters()))}
    assert names and all(name.startswith(("net.model.layers.2.", "net.model.layers.3.")) for name in names)
    assert len(middle.make_cache()) == 2


@pytest.mark.parametrize("family", IN_PROCESS)
def test_in_process_stages_give_the_whole_models_logits(
    family: Family, builtin_model_dir: Path, tmp_path: Path
) -> None:
    """Layers under another name (`transformer.h`, `model.h`), caches that are `CacheList`s, a head
    beside the layers (`embed_out`, which a middle stage does not hold), the hidden state passed by
    name (gptj): three stages loaded by `load_shard` give the whole model's logits, in chunks of 5
    then token by token."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    folder = make_family_model(tmp_path / family, family, tokenizer_from=builtin_model_dir)
    whole = load_model(folder)[0]
    stages = [load_shard(folder, start=a, end=b) for a, b in ((0, 2), (2, 4), (4, 6))]
    middle = cast(list[tuple[str, mx.array]], tree_flatten(stages[1].parameters()))
    assert all(re.search(r"\.[23]\.", name) for name, _ in middle)  # no embedding, norm or head
    whole_cache, caches = make_prompt_cache(whole), [stage.make_cache() for stage in stages]
    ids = mx.random.randint(0, 1000, (1, 17), key=mx.random.key(1))
    for chunk in [ids[:, i : i + 5] for i in range(0, 17, 5)] + [ids[:, i : i + 1] for i in range(3)]:
        h = chunk
        for stage, cache in zip(stages, caches, strict=True):
            h = stage.forward(h, cache)
        expected = whole(chunk, cache=whole_cache)
        assert mx.allclose(h, expected, atol=1e-5).item(), family
