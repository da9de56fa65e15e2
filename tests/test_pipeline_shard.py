"""Shards: layer ranges, and a stage process holding only its share of a model's weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from node.files import HashCache, folder_manifest
from node.pipeline.shard import Shard, ShardError, ShardSpec, load_shard
from protocol.manifest import INDEX_FILE, stage_paths
from tests.model_factory import make_random_model, sharded_copy
from tests.stage_process import even_split


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


def test_a_stage_loads_from_a_folder_holding_only_its_shards(random_model_dir: Path, tmp_path: Path) -> None:
    """What a stage node fetched from peers: metadata and the shards of its layers, picked by the
    transfer layer's `stage_paths` from the weight index; the layers run as from the whole model."""
    full = sharded_copy(four_layers(random_model_dir, tmp_path), tmp_path / "sharded")
    manifest = folder_manifest(full, HashCache(None))
    index = json.loads((full / INDEX_FILE).read_text())
    config = json.loads((full / "config.json").read_text())
    wanted = stage_paths(manifest, index, config, start=1, end=3)
    assert sorted(p for p in wanted if p.endswith(".safetensors")) == [
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
    ]
    partial = tmp_path / "partial"
    partial.mkdir()
    for path in wanted:
        shutil.copyfile(full / path, partial / path)

    from_partial, from_full = load_shard(partial, start=1, end=3), load_shard(full, start=1, end=3)
    hidden = mx.random.normal((1, 5, config["hidden_size"]), key=mx.random.key(1))
    a = from_partial.forward(hidden, from_partial.make_cache())
    b = from_full.forward(hidden, from_full.make_cache())
    assert mx.array_equal(a, b).item()
    with pytest.raises(ShardError, match=r"lacks .* layers \[0, 2\) need"):
        load_shard(partial, start=0, end=2)  # the embedding and layer 0 are not here


def four_layers(tokenizer_from: Path, tmp_path: Path) -> Path:
    return make_random_model(tmp_path / "four", num_layers=4, tokenizer_from=tokenizer_from)


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
