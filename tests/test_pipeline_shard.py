"""Shards: layer ranges, and a stage process holding only its share of a model's weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from node.pipeline.shard import Shard, ShardError, ShardSpec, even_split, load_shard
from tests.model_factory import make_random_model


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (6, 1, [(0, 6)]),
        (6, 2, [(0, 3), (3, 6)]),
        (6, 4, [(0, 2), (2, 4), (4, 5), (5, 6)]),
        (30, 3, [(0, 10), (10, 20), (20, 30)]),
    ],
)
def test_even_split(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    assert even_split(layers, stages) == expected


def test_bad_ranges_are_refused() -> None:
    for start, end in [(3, 3), (-1, 2), (2, 7)]:
        with pytest.raises(ShardError):
            ShardSpec(start, end, 6)
    with pytest.raises(ShardError):
        even_split(2, 3)


# --- memory follows the share ---------------------------------------------------------------


def _group_bytes(model_dir: Path) -> dict[str, int]:
    """Stored bytes per part: "embed", "layers.<i>", "norm", "head"."""
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    groups: dict[str, int] = {}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            key = "layers." + name.split(".")[2]
        else:
            key = {
                "model.embed_tokens.weight": "embed",
                "model.norm.weight": "norm",
                "lm_head.weight": "head",
            }[name]
        groups[key] = groups.get(key, 0) + value.nbytes
    return groups


def _names(shard: Shard) -> set[str]:
    return {name for name, _ in cast(list[tuple[str, mx.array]], tree_flatten(shard.parameters()))}


@pytest.fixture(scope="module")
def eight_wide(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers of ~4 MB each, so that layer bytes are easy to tell from the embedding and head."""
    return make_random_model(
        tmp_path_factory.mktemp("pipeline") / "eight",
        num_layers=8,
        hidden_size=256,
        intermediate_size=1024,
        tokenizer_from=builtin_model_dir,
    )


def test_a_stage_holds_only_its_share(eight_wide: Path) -> None:
    groups = _group_bytes(eight_wide)
    layers = [groups[f"layers.{i}"] for i in range(8)]
    cases = {
        (0, 4): groups["embed"] + sum(layers[:4]),
        (2, 6): sum(layers[2:6]),
        (4, 8): sum(layers[4:]) + groups["norm"] + groups["head"],
    }
    for (start, end), expected in cases.items():
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        shard = load_shard(eight_wide, start=start, end=end)
        assert shard.parameter_bytes() == expected
        # MLX never allocated more than the share: the other layers' weights were never read.
        assert mx.get_peak_memory() - before <= expected * 1.02 + 1_000_000
        names = _names(shard)
        assert any(name.startswith("embed_tokens") for name in names) == (start == 0)
        assert any(name.startswith("lm_head") for name in names) == (end == 8)
        del shard
    # Half the layers of the first stage is half of all layer bytes.
    first = load_shard(eight_wide, start=0, end=4)
    assert first.parameter_bytes() - groups["embed"] == sum(layers) // 2


def test_tied_embedding_stays_with_the_last_stage(builtin_model_dir: Path) -> None:
    last = load_shard(builtin_model_dir, start=28)
    # SmolLM2 ties its head to the embedding: the last stage keeps the table to use as its head.
    assert {name.split(".")[0] for name in _names(last)} == {"layers", "embed_tokens", "norm"}
    middle = load_shard(builtin_model_dir, start=10, end=12)
    assert {name.split(".")[0] for name in _names(middle)} == {"layers"}


def test_process_memory_follows_the_share(eight_wide: Path) -> None:
    """Resident memory of a process loading the middle half vs then loading the whole model."""
    script = textwrap.dedent(
        f"""
        import json, psutil
        import mlx_lm.models.base, mlx_lm.models.cache, mlx_lm.models.llama, mlx_lm.utils
        from node.pipeline.shard import load_shard
        rss = psutil.Process().memory_info
        base = rss().rss
        middle = load_shard({str(eight_wide)!r}, start=2, end=6)
        after_middle = rss().rss
        whole = load_shard({str(eight_wide)!r}, start=0, end=8)
        print(json.dumps([after_middle - base, rss().rss - after_middle, middle.parameter_bytes(),
                          whole.parameter_bytes()]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    middle_rss, whole_rss, middle_bytes, whole_bytes = json.loads(out.stdout.strip().splitlines()[-1])
    assert middle_bytes < whole_bytes / 4
    assert middle_rss < middle_bytes + 16_000_000
    assert whole_rss > whole_bytes * 0.9
    assert middle_rss < whole_rss / 3
