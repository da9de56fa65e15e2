"""A pipeline stage of any mlx-lm model with a list of decoder layers, run by the model's own forward.

`shard.Shard` spells out the forward of llama, qwen2 and qwen3 (the families the fused decode
paths serve). Every other family runs here: the whole mlx-lm `Model.__call__`, with the decoder
layers outside the stage replaced by stand-ins that hold no weights and pass the hidden state on:

- the stand-ins keep the plain flags of the layers they replace and of their submodules
  (`use_sliding`, `is_linear`, `self_attn.is_local`), which the model's loop and `make_cache`
  read to pick each layer's mask and cache;
- a later stage feeds the model dummy token ids; the embedding, when this stage does not hold
  it, yields zeros of the received hidden state's shape, and the stand-in of layer `start - 1`
  replaces whatever reaches it (scaled embeddings included) by the received hidden state;
- a stage before the last takes the hidden state that reaches the stand-in of layer `end` and
  returns it; its final norm and head are stand-ins, never evaluated;
- the last stage returns the model's own logits, so norms, softcaps and tied heads are its own.

Masks come out right because the model builds them from the caches it is given: a skipped layer
is handed a cache of this stage of the same kind (full or sliding window of that size), which at
mask time has the offset every cache of that kind here has. A kind the stage lacks gets a fresh
cache; only skipped layers use its mask, and they ignore it. Each stage keeps caches only for its
own layers. Recurrent state (`ArraysCache`: qwen3_next, lfm2, falcon_h1, mamba ...) is per layer
too, so hybrid families split the same way. The mlx-lm internals this relies on are in
`node.cpu.mlx_lm_quirks`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from node.cpu.mlx_lm_quirks import (
    cache_kind,
    decoder_owner,
    full_cache,
    hidden_state_parameter,
    is_embedding,
    plain_attributes,
)
from node.models.shape import UNSPLITTABLE
from node.pipeline.shard import Shard, ShardError, ShardSpec

HEAD_NAMES = ("lm_head", "output", "embed_out")
"""The output head's attribute on the outer model or the module owning the layers (gpt_neox's
`embed_out`), dropped by stages before the last."""
NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "final_norm", "norm_f", "embedding_norm")
"""The final norm's attribute on the module owning the layers (dropped likewise; lfm2's final norm
is its `embedding_norm`)."""


class _Cut:
    """What one forward call passes between the stand-ins: the hidden state in and out."""

    def __init__(self) -> None:
        self.received: mx.array | None = None
        self.sent: mx.array | None = None


class _Flags(nn.Module):
    """The plain flags of a module of another stage and of its submodules, without weights: the
    model's own loop and `make_cache` read them (`use_sliding`, `is_linear`, `self_attn.is_local`)."""

    def __init__(self, replaced: nn.Module) -> None:
        super().__init__()
        for name, value in plain_attributes(replaced).items():
            object.__setattr__(self, name, value)
        for name, child in replaced.children().items():
            if isinstance(child, nn.Module):
                self[name] = _Flags(child)


class _SkippedLayer(_Flags):
    """A layer of another stage: passes `x` on, or at the cut swaps in or records the hidden state."""

    def __init__(self, cut: _Cut, role: str, replaced: nn.Module) -> None:
        super().__init__(replaced)
        object.__setattr__(self, "_cut", cut)
        self._role = role  # "inject" (layer start - 1), "capture" (layer end) or "pass"
        self._hidden = hidden_state_parameter(replaced)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        x: mx.array = args[0] if args else kwargs[self._hidden]  # gptj: `block(inputs=h, ...)`
        cut: _Cut = object.__getattribute__(self, "_cut")
        if self._role == "inject":
            assert cut.received is not None
            return cut.received
        if self._role == "capture":
            cut.sent = x
        return x


class _AbsentEmbedding(nn.Module):
    """The embedding of a stage that does not hold it: zeros shaped like the received hidden state
    (the stand-in of layer `start - 1` replaces them, so they are never computed)."""

    def __init__(self, cut: _Cut) -> None:
        super().__init__()
        object.__setattr__(self, "_cut", cut)

    def __call__(self, ids: mx.array) -> mx.array:
        received = object.__getattribute__(self, "_cut").received
        assert received is not None
        return mx.zeros(received.shape, received.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return x


class _Passthrough(nn.Module):
    """A final norm or head of a stage before the last: its output is never used."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x


class GenericShard(Shard):
    """A stage of any decoder-layer model; the same interface as `Shard` (which see)."""

    def __init__(
        self,
        spec: ShardSpec,
        *,
        net: nn.Module,
        owner: nn.Module,
        key: str,
        cut: Any,
        config: dict[str, Any],
    ):
        nn.Module.__init__(self)
        self.spec = spec
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_cut", cut)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_key", key)
        self.net = net  # the whole pruned model: the only child, so parameters are named once
        template = full_cache(net)
        kinds = [cache_kind(c) for c in template]
        object.__setattr__(self, "_kinds", kinds)
        # For a kind this stage has no layer of: a cache never written (only skipped layers,
        # which ignore it, use its mask), so one per kind serves every call.
        spares = {
            kind: c
            for kind, c in zip(kinds, template, strict=True)
            if kind not in kinds[spec.start : spec.end]
        }
        object.__setattr__(self, "_spares", spares)

    @property
    def layers(self) -> list[nn.Module]:  # type: ignore[override]
        """This stage's own layers (what `node.cpu` wraps for prefill and decode)."""
        owner: nn.Module = object.__getattribute__(self, "_owner")
        return list(owner[object.__getattribute__(self, "_key")][self.spec.start : self.spec.end])

    def make_cache(self) -> list[Any]:
        return full_cache(self.net)[self.spec.start : self.spec.end]

    def forward(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids or received hidden states -> hidden states to send, or on the last stage the
        model's logits for every position."""
        spec = self.spec
        cut: _Cut = object.__getattribute__(self, "_cut")
        kinds: list[Hashable] = object.__getattribute__(self, "_kinds")
        own = {kinds[spec.start + i]: c for i, c in enumerate(cache)}
        spares: dict[Hashable, Any] = object.__getattribute__(self, "_spares")
        full = [
            cache[i - spec.start] if spec.start <= i < spec.end else own.get(kind, spares.get(kind))
            for i, kind in enumerate(kinds)
        ]
        cut.received, cut.sent = (None, None) if spec.is_first else (x, None)
        ids = x if spec.is_first else mx.zeros(x.shape[:2], mx.int32)
        try:
            out: mx.array = self.net(ids, cache=full)
            if not spec.is_last:
                assert cut.sent is not None, "the model never reached the layer after this stage"
                out = cut.sent
        finally:
            cut.received = cut.sent = None
        return out

    def logits(self, h: mx.array) -> mx.array:
        if not self.spec.is_last:
            raise ShardError("only the last stage has the final norm and head")
        return h[:, -1, :]


def generic_shard(model: nn.Module, config: dict[str, Any], *, start: int, end: int | None) -> GenericShard:
    """Prune the lazily loaded `model` to layers [start, end) and the ends this stage owns."""
    family = str(config.get("model_type"))
    if family in UNSPLITTABLE:
        raise ShardError(f"model type {family!r} cannot be split into stages: {UNSPLITTABLE[family]}")
    owner, key, outer = decoder_owner(model)
    if owner is None:
        raise ShardError(f"model type {family!r} ({type(model).__module__}) has no list of decoder layers")
    layers = list(owner[key])
    spec = ShardSpec(start, len(layers) if end is None else end, len(layers))
    cut = _Cut()
    for i in range(len(layers)):
        if not spec.start <= i < spec.end:
            role = "inject" if i == spec.start - 1 else "capture" if i == spec.end else "pass"
            layers[i] = _SkippedLayer(cut, role, layers[i])
    owner[key] = layers
    tied = not any(name in module for name in HEAD_NAMES for module in (outer, owner))
    if not (spec.is_first or (spec.is_last and tied)):
        for name, child in list(owner.children().items()):
            if is_embedding(child):
                owner[name] = _AbsentEmbedding(cut)
    if not spec.is_last:
        for name in NORM_NAMES:
            if name in owner:
                owner[name] = _Passthrough()
        for name in HEAD_NAMES:
            for module in (outer, owner):
                if name in module:
                    module[name] = _Passthrough()
    return GenericShard(spec, net=model, owner=owner, key=key, cut=cut, config=config)
