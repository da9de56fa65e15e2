"""One rank's slice of a model, run as a member of a tensor-parallel group.

    shard = load_tensor_shard(path, rank=0, size=n, prepare=apply_dtype_policy)
    generator = TensorGenerator(shard, followers=["10.0.0.7:47200"])  # forms the group (mesh)
    h = shard.forward(mx.array([tokens]), cache)         # rank 0 also tells the others to run it
    token = shard.next_token(h, sampler)                 # the head's slices gathered on rank 0

The model is mlx-lm's own (llama, qwen2, qwen3, qwen3_moe), built with lazy weights;
`slice_model` cuts each projection to this rank's part (`split`) before anything is read, each
layer evaluated on its own so that loading never holds more than one full tensor beside the slices:
- q, k, v: the rows of this rank's KV heads and their query heads; attention runs on them alone.
- o: the matching input columns; its output is a partial sum, summed over the ranks (`link_sum`).
- gate, up: a range of the MLP's rows; down: the same columns, summed likewise. A MoE block's
  experts are each cut so, its router kept whole (every rank routes alike); the block's output
  is summed.
- embedding and head: a range of the vocabulary. A token's embedding comes from the rank holding
  its row (the others add exact zeros, so the sum is that row's bits); the head's slices are
  gathered on rank 0, which samples.
The fused layers and the decode stack (`node.cpu`) sum inside their native operations; the plain
mlx-lm path sums through the `_Summed` mixin on o and down. Partial sums change the order of the
additions, so logits match one process to float32 rounding, not bit for bit.

`TensorShard` has the interface of `node.pipeline.shard.Shard` (`forward`, `next_token`,
`make_cache`, a whole-model `spec`), so `PipelineGenerator` drives it as a one-stage pipeline. On
rank 0 every `forward` first sends the step (the cache it extends and the token ids) to the other
ranks (`TensorShard.run_command` runs it there).
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import cbor2
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from node.cpu.fused_stack import restack
from node.cpu.mlx_lm_quirks import put_mixin
from node.pipeline.driver import PipelineError, PipelineGenerator
from node.pipeline.hop import CONNECT_TIMEOUT
from node.pipeline.link_auth import OPEN, LinkSecurity
from node.pipeline.shard import Prepare, Sampler, ShardError, ShardSpec, pick_token
from node.tensor.mesh import LINK_TIMEOUT, dial_group, native
from protocol.tensor_split import Slice, split, tensor_shape

log = logging.getLogger("shoal.tensor")


class TensorLinkError(PipelineError):
    """The group's link failed (a rank closed it, froze past the timeout, or ran another step)."""


def _rows(module: nn.Module, start: int, end: int) -> None:
    """Keep output rows [start, end) of a Linear, QuantizedLinear or (Quantized)Embedding, or of
    every expert of a (Quantized)SwitchLinear (its arrays [experts, rows, ...])."""
    for key in ("weight", "scales", "biases"):
        if key in module and module[key] is not None:
            module[key] = mx.contiguous(module[key][..., start:end, :])
    if "bias" in module:
        module["bias"] = mx.contiguous(module["bias"][..., start:end])


def _columns(module: nn.Module, start: int, end: int, *, keep_bias: bool) -> None:
    """Keep input columns [start, end) of a Linear or QuantizedLinear (cuts on whole groups)."""
    bits = getattr(module, "bits", None)
    if bits is None:
        module["weight"] = mx.contiguous(module["weight"][..., start:end])
    else:
        per_word, group = 32 // bits, module.group_size
        module["weight"] = mx.contiguous(module["weight"][..., start // per_word : end // per_word])
        for key in ("scales", "biases"):
            if key in module and module[key] is not None:
                module[key] = mx.contiguous(module[key][..., start // group : end // group])
    if "bias" in module and not keep_bias:  # added once, by rank 0, after the sum
        del module["bias"]


class _Summed:
    """Mixed in before o's and down's classes: their partial outputs summed over the group."""

    _shoal_link: Any

    def __call__(self, x: mx.array) -> mx.array:
        return cast(mx.array, native().link_sum(super().__call__(x), self._shoal_link))  # type: ignore[misc]


def slice_model(model: Any, piece: Slice) -> None:
    """Cut `model`'s layers, embedding and head to `piece`, in place; evaluates layer by layer."""
    inner = model.model
    (q0, q1), (k0, k1) = piece.q_heads, piece.kv_heads
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dim = attn.q_proj.weight.shape[0] // attn.n_heads  # rows per query head
        _rows(attn.q_proj, q0 * dim, q1 * dim)
        _rows(attn.k_proj, k0 * dim, k1 * dim)
        _rows(attn.v_proj, k0 * dim, k1 * dim)
        _columns(attn.o_proj, q0 * dim, q1 * dim, keep_bias=piece.rank == 0)
        attn.n_heads, attn.n_kv_heads = q1 - q0, k1 - k0
        experts = mlp.get("switch_mlp")  # qwen3_moe: every expert cut like an MLP; the router whole
        mlp = mlp if experts is None else experts
        f0, f1 = piece.rows(mlp.gate_proj.weight.shape[-2])
        _rows(mlp.gate_proj, f0, f1)
        _rows(mlp.up_proj, f0, f1)
        _columns(mlp.down_proj, f0, f1, keep_bias=piece.rank == 0)
        mx.eval(layer.parameters())
    v0, v1 = piece.vocab
    _rows(inner.embed_tokens, v0, v1)
    if "lm_head" in model:
        _rows(model.lm_head, v0, v1)
    mx.eval(model.parameters())
    mx.clear_cache()  # the full tensors the slices were cut from


def install_sums(model: Any, link: Any) -> None:
    """Give every layer's o and MLP (down, or a MoE block as a whole) the group's sum (after the
    dtype policy swapped and fused them)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        for module in (layer.self_attn.o_proj, mlp if "switch_mlp" in mlp else mlp.down_proj):
            put_mixin(module, _Summed)
            object.__setattr__(module, "_shoal_link", link)
    restack(model)  # the decode stack's plan, built by the dtype policy, now sums too


class TensorShard(nn.Module):
    """One rank's slice of the whole model; `parameters()` is what it holds."""

    def __init__(self, model: Any, pieces: list[Slice], rank: int, config: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "piece", pieces[rank])
        object.__setattr__(self, "link", None)
        object.__setattr__(self, "vocab_widths", [p.vocab[1] - p.vocab[0] for p in pieces])
        layers = len(model.model.layers)
        object.__setattr__(self, "spec", ShardSpec(0, layers, layers))
        self._cache: weakref.ref[Any] | None = None  # rank 0: the cache the others extend
        self._cache_number = 0
        self._runs: tuple[int, list[Any]] | None = None  # another rank's (cache id, cache)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    def parameter_bytes(self) -> int:
        return sum(v.nbytes for _, v in cast(list[tuple[str, mx.array]], tree_flatten(self.parameters())))

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        cache: list[Any] = make_prompt_cache(self.model)
        return cache

    def attach(self, link: Any) -> None:
        """Run in the group of `link` (a `TensorLink` of this rank): o and down sum over it."""
        if (link.rank, link.size) != (self.piece.rank, self.piece.size):
            raise ValueError(f"this shard is rank {self.piece.rank} of {self.piece.size}, the link's is not")
        object.__setattr__(self, "link", link)
        install_sums(self.model, link)
        self._cache, self._runs = None, None  # the other ranks start from nothing too

    def check(self) -> None:
        """Raise `TensorLinkError` if the link broke (after evaluating what used it)."""
        if not self.link.ok:
            raise TensorLinkError(f"the tensor-parallel group's link failed: {self.link.error}")

    def forward(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids [1, L] -> the final norm's output [1, L, E], for `next_token`."""
        return self._step(x, cache, head=True)

    def prefill(self, x: mx.array, cache: list[Any]) -> None:
        """A prompt chunk into `cache` (evaluated); no head runs after it."""
        self._step(x, cache, head=False)
        mx.eval([c.state for c in cache])
        self.check()

    def _step(self, x: mx.array, cache: list[Any], *, head: bool) -> mx.array:
        """Rank 0 first sends the step: the cache it extends, the token ids, whether the head runs."""
        if self.piece.rank == 0:
            ids = x.reshape(-1).tolist()  # waits for the token a decode step feeds back
            self.check()
            if self._cache is None or self._cache() is not cache[0]:  # a new request's cache
                self._cache = weakref.ref(cache[0])  # (an id() could be a freed cache's)
                self._cache_number += 1
            command = {"cache": self._cache_number, "tokens": ids, "head": head}
            self.link.broadcast(cbor2.dumps(command))
            self.check()
        return cast(mx.array, self.model.model(x, cache=cache, input_embeddings=self._embed(x)))

    def _embed(self, ids: mx.array) -> mx.array:
        v0, v1 = self.piece.vocab
        local = ids - v0
        inside = (local >= 0) & (local < v1 - v0)
        rows = self.model.model.embed_tokens(mx.where(inside, local, 0)).astype(mx.float32)
        return cast(mx.array, native().link_sum(mx.where(inside[..., None], rows, 0.0), self.link))

    def logits(self, h: mx.array) -> mx.array:
        """The last position's logits [1, vocab] on rank 0 (zeros elsewhere)."""
        last = h[:, -1:, :]
        inner = self.model.model
        part = self.model.lm_head(last) if "lm_head" in self.model else inner.embed_tokens.as_linear(last)
        return cast(mx.array, native().link_gather(part, self.link, self.vocab_widths)[:, -1, :])

    def next_token(self, h: mx.array, sampler: Sampler) -> mx.array:
        return pick_token(self.logits(h), sampler)

    def run_command(self, payload: bytes) -> None:
        """Another rank: run the step rank 0 sent (its layers and head slice, in the group's sums)."""
        command = cbor2.loads(payload)
        cache_id, tokens = int(command["cache"]), list(command["tokens"])
        if self._runs is None or self._runs[0] != cache_id:
            self._runs = (cache_id, self.make_cache())
        cache = self._runs[1]
        x = mx.array(tokens, dtype=mx.int32)[None]
        if command["head"]:
            mx.eval(self.logits(self.forward(x, cache)), [c.state for c in cache])
            self.check()
        else:
            self.prefill(x, cache)
            mx.clear_cache()  # a chunk's activations, as rank 0's driver drops them


def load_tensor_shard(
    path: Path | str, *, rank: int, size: int, prepare: Prepare | None = None
) -> TensorShard:
    """Rank `rank` of `size`'s slice of the model folder at `path`; `attach` a link to run it.

    Raises `ShardError` for a family or shape that cannot be split (before reading any weight).
    """
    from mlx_lm.utils import load_model

    try:  # before any weight is read
        pieces = split(tensor_shape(json.loads((Path(path) / "config.json").read_text())), size)
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path} cannot run as {size} tensor-parallel ranks: {exc}") from exc
    model, config = load_model(Path(path), lazy=True)
    slice_model(model, pieces[rank])
    if prepare is not None:
        prepare(model)
    shard = TensorShard(model, pieces, rank, config)
    piece = shard.piece
    log.info(
        "tensor rank %d of %d: KV heads [%d, %d), MLP rows [%d, %d), vocabulary [%d, %d): %.1f MB of weights",
        piece.rank,
        piece.size,
        *piece.kv_heads,
        *piece.ffn,
        *piece.vocab,
        shard.parameter_bytes() / 1e6,
    )
    return shard


class TensorGenerator(PipelineGenerator):
    """`PipelineGenerator` over rank 0's `TensorShard`, which (re)forms the group before a request
    whenever its link is down: a rank that failed and came back (its node restarts it) serves again
    with no restart here. Every token it yields was computed over a whole link; a link that breaks
    ends the request with `TensorLinkError`, one that cannot form with `HopError`."""

    def __init__(
        self,
        shard: TensorShard,
        followers: Sequence[str],
        *,
        security: LinkSecurity = OPEN,
        connect_timeout: float = CONNECT_TIMEOUT,
        link_timeout: float = LINK_TIMEOUT,
    ) -> None:
        if shard.piece.rank != 0 or len(followers) != shard.piece.size - 1:
            raise ValueError("the generator runs on rank 0, with the address of every other rank")
        super().__init__(cast(Any, shard))
        self.tensor = shard
        self.followers = tuple(followers)
        self._dial = functools.partial(
            dial_group, followers, security=security, timeout=connect_timeout, link_timeout=link_timeout
        )

    def connect(self) -> None:
        link = self.tensor.link
        if link is None or not link.ok:
            if link is not None:
                link.close()
            log.info("forming the tensor-parallel group with %s", ", ".join(self.followers))
            self.tensor.attach(self._dial())
            log.info("tensor-parallel group formed")

    def disconnect(self) -> None:
        if self.tensor.link is not None:
            self.tensor.link.close()

    def close(self) -> None:
        self.disconnect()

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[int]:
        self.connect()
        for token in super().generate(*args, **kwargs):
            self.tensor.check()
            yield token
