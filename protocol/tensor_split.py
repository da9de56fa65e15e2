"""Which slice of every layer each rank of a tensor-parallel group holds; pure arithmetic.

A rank holds whole KV heads with their query heads (attention needs nothing from the others), a
contiguous range of the MLP's intermediate rows, and a contiguous range of the vocabulary (its rows
of the embedding and of the head). Ranges are as even as the quantization groups allow: a cut
inside a group would split the group's scale, so cuts fall on multiples of the group size (and of
32, a packed word of any bit width). Uneven head counts are fine (SmolLM2's 3 KV heads on 2
ranks: 2 + 1), which `shard()` in mlx-lm does not allow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SplitError(ValueError):
    """The model's shape cannot be cut into this many slices (the message says why)."""


@dataclass(frozen=True)
class Shape:
    """What the split needs of a llama-family model (config.json's names in the comments)."""

    q_heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    ffn: int  # intermediate_size (a MoE model's: moe_intermediate_size, each expert's)
    vocab: int  # vocab_size
    group: int = 32
    """The quantization group along a projection's inputs (32 for float weights: a packed word)."""
    extra_ffn: tuple[int, ...] = ()
    """Other MLP widths the model has (a MoE model's dense layers), cut the same way."""


@dataclass(frozen=True)
class Slice:
    """Rank `rank`'s ranges, each [start, end)."""

    rank: int
    size: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    unit: int = 32
    """Cuts of MLP rows fall on multiples of this (a quantization group, a packed word)."""

    def rows(self, width: int) -> tuple[int, int]:
        """This rank's rows of an MLP `width` rows wide (`ffn` for the shape's own)."""
        cuts = even_cuts(width, self.size, self.unit)
        return cuts[self.rank], cuts[self.rank + 1]

    @property
    def q_count(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def kv_count(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def even_cuts(total: int, parts: int, unit: int = 1) -> list[int]:
    """parts + 1 cut points of [0, total] (a multiple of `unit`), each a multiple of `unit`, as even
    as that allows; earlier parts get the smaller shares (rank 0 also samples)."""
    units = total // unit
    return [unit * (units * i // parts) for i in range(parts + 1)]


def split(shape: Shape, size: int) -> list[Slice]:
    """Every rank's slice; `SplitError` when some rank would get nothing or a cut splits a group."""
    if size < 2:
        raise SplitError("a tensor-parallel group needs at least 2 ranks")
    if shape.kv_heads <= 0 or shape.q_heads % shape.kv_heads:
        raise SplitError(f"{shape.q_heads} query heads do not share {shape.kv_heads} KV heads evenly")
    if shape.kv_heads < size:
        raise SplitError(f"{shape.kv_heads} KV heads cannot be spread over {size} ranks (each needs one)")
    unit = max(32, shape.group)
    if (shape.head_dim * shape.q_heads // shape.kv_heads) % unit:
        raise SplitError(
            f"a KV head's query heads ({shape.q_heads // shape.kv_heads} x {shape.head_dim} values) do not "
            f"fill whole quantization groups of {unit}: the o projection cannot be cut between them"
        )
    for width in (shape.ffn, *shape.extra_ffn):
        if width % unit:
            raise SplitError(f"the MLP's {width} rows are not whole groups of {unit}")
        if width < size * unit:
            raise SplitError(f"the MLP's {width} rows are too few for {size} ranks")
    group = shape.q_heads // shape.kv_heads
    kv = even_cuts(shape.kv_heads, size)
    ffn = even_cuts(shape.ffn, size, unit)
    vocab = even_cuts(shape.vocab, size)
    return [
        Slice(
            rank=r,
            size=size,
            kv_heads=(kv[r], kv[r + 1]),
            q_heads=(kv[r] * group, kv[r + 1] * group),
            ffn=(ffn[r], ffn[r + 1]),
            vocab=(vocab[r], vocab[r + 1]),
            unit=unit,
        )
        for r in range(size)
    ]


TENSOR_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""config.json model types whose mlx-lm forward `node.tensor.shard` cuts (mlx-lm runs mistral's
as llama's): the pipeline's whole-forward families, and qwen3_moe (each expert cut like an MLP)."""
MAX_RANKS = 8
"""Ranks a group has at most: every rank waits on the slowest twice a layer, and the home clusters
we build for have a few machines."""


def tensor_shape(config: Mapping[str, Any]) -> Shape:
    """What the split needs of a config.json; `SplitError` when it is not one of `TENSOR_FAMILIES`
    or lacks a size."""
    model_type = config.get("model_type")
    if model_type not in TENSOR_FAMILIES:
        families = ", ".join(TENSOR_FAMILIES)
        raise SplitError(
            f"model type {model_type!r} has no tensor-parallel forward yet (supported: {families})"
        )
    try:
        heads = int(config["num_attention_heads"])
        ffn, extra = int(config["intermediate_size"]), _moe_widths(config)
        if extra is not None:  # a MoE model: the shape's own width is an expert's
            ffn = int(config["moe_intermediate_size"])
        return Shape(
            q_heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            ffn=ffn,
            vocab=int(config["vocab_size"]),
            group=int((config.get("quantization") or {}).get("group_size", 32)),
            extra_ffn=extra or (),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise SplitError(f"config.json does not give the heads and sizes a split needs ({exc!r})") from exc


def _moe_widths(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    """A qwen3_moe model's dense MLP widths (its `mlp_only_layers` and the layers between sparse
    ones: `intermediate_size`), or None when it has no expert layer at all."""
    if config.get("model_type") != "qwen3_moe" or not int(config.get("num_experts") or 0):
        return None
    layers, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not sparse:
        return None
    return (int(config["intermediate_size"]),) if len(sparse) < layers else ()


def tensor_limit(config: Mapping[str, Any]) -> tuple[int, str]:
    """(the most ranks the model of this config.json splits into, or 0 and why it cannot)."""
    try:
        shape = tensor_shape(config)
    except SplitError as exc:
        return 0, str(exc)
    best, why = 0, ""
    for ranks in range(2, MAX_RANKS + 1):
        try:
            split(shape, ranks)
        except SplitError as exc:
            why = str(exc)
            break
        best = ranks
    return (best, "") if best else (0, why)
