"""What placement knows of a model: the bytes each part takes at run time. Pure values.

A `ModelShape` travels in place requests and in instance records (so a leader re-places an instance
with the shape its requester read, never resolving the model itself); `protocol.placement` splits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.ids import ModelId


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What placement needs to know of a model: the bytes each part of it takes at run time."""

    model: ModelId
    layer_bytes: tuple[int, ...]
    """Weights of each transformer layer, in layer order; its length is the number of layers."""
    embedding_bytes: int
    """The token embedding, held by the first stage (and by the last one too when tied)."""
    head_bytes: int
    """The final norm and lm_head (none when tied), held by the last stage."""
    tied_embeddings: bool
    """lm_head is the embedding matrix: the last stage needs a copy of it."""
    kv_bytes_per_token: int
    """KV cache of one layer for one token (2 x kv heads x head dim x dtype bytes)."""
    context_length: int
    """Tokens of KV cache reserved per layer."""
    unsplittable: str = ""
    """Why the model cannot be split into pipeline stages (placement then uses one node); empty
    when it can."""
    tensor_ranks: int = 0
    """The most ranks a tensor-parallel instance of it may have (`protocol.tensor_split`); 0: none."""
    tensor_unsplittable: str = ""
    """Why it cannot run tensor-parallel (when `tensor_ranks` is 0); empty when it can."""
    token_bytes: int = 0
    """Weights one decoded token reads when that is fewer than all of them (a mixture of experts:
    only its routed experts'); 0: every layer's and the head's (`protocol.auto_sharding`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.layer_bytes, tuple) or not self.layer_bytes:
            raise ValueError("layer_bytes must be a non-empty tuple")
        for name, value in (
            *(("layer bytes", b) for b in self.layer_bytes),
            ("embedding_bytes", self.embedding_bytes),
            ("head_bytes", self.head_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("context_length", self.context_length),
            ("tensor_ranks", self.tensor_ranks),
            ("token_bytes", self.token_bytes),
        ):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")

    @classmethod
    def uniform(
        cls,
        model: ModelId,
        *,
        num_layers: int,
        bytes_per_layer: int,
        embedding_bytes: int,
        head_bytes: int,
        tied_embeddings: bool = False,
        kv_bytes_per_token: int = 0,
        context_length: int = 0,
    ) -> ModelShape:
        """A shape whose `num_layers` layers all weigh `bytes_per_layer`."""
        if num_layers < 1:
            raise ValueError("a model has at least one layer")
        return cls(
            model,
            (bytes_per_layer,) * num_layers,
            embedding_bytes,
            head_bytes,
            tied_embeddings,
            kv_bytes_per_token,
            context_length,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def kv_bytes_per_layer(self) -> int:
        """The KV cache one layer reserves for `context_length` tokens."""
        return self.kv_bytes_per_token * self.context_length

    @property
    def weight_bytes(self) -> int:
        """Every weight once: what a single node holds."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_layer * self.num_layers

    @property
    def total_bytes(self) -> int:
        """What the whole model needs on one node: weights and KV cache."""
        return self.weight_bytes + self.kv_bytes

    def rank_bytes(self, ranks: int) -> int:
        """Bytes one rank of a tensor-parallel instance of `ranks` needs: its share of every layer,
        of the KV cache, the embedding and the head, plus one layer's for a share that cannot be
        even (whole KV heads: 3 of them on 2 ranks give one rank two)."""
        if ranks < 1:
            raise ValueError("a tensor-parallel instance has at least one rank")
        return -(-self.total_bytes // ranks) + max(self.layer_bytes) + self.kv_bytes_per_layer

    def stage_bytes(self, start: int, end: int) -> int:
        """Bytes a stage running layers [start, end) needs: its layers, their KV cache, and the
        embedding when it is the first stage, the head (and the tied embedding) when it is the last."""
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"no stage [{start}, {end}) in {self.num_layers} layers")
        return self._stage_bytes(prefix_sums(self), start, end)

    def _stage_bytes(self, prefix: Sequence[int], start: int, end: int) -> int:
        total = prefix[end] - prefix[start]
        if start == 0:
            total += self.embedding_bytes
        if end == self.num_layers:
            total += self.head_bytes
            if self.tied_embeddings and start != 0:
                total += self.embedding_bytes
        return total


def prefix_sums(shape: ModelShape) -> list[int]:
    """prefix[j]: bytes of layers [0, j), KV cache included."""
    prefix = [0]
    for layer in shape.layer_bytes:
        prefix.append(prefix[-1] + layer + shape.kv_bytes_per_layer)
    return prefix
