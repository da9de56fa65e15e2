"""One pipeline stage's share of a model: layers [start, end), plus the ends it owns.

    shard = load_shard(path, start=0, end=15)     # first stage: embedding + layers 0..14
    h = shard.forward(mx.array([tokens]), cache)  # hidden states after layer 14

The first stage holds the token embedding, the last the final norm and the output head (for a
model with tied embeddings that head *is* the embedding table, so the last stage keeps
`embed_tokens` and uses it through `as_linear`). Middle stages hold only their layers.

Memory follows the share: the model is built by mlx-lm with lazy weights (nothing is read from
the safetensors files yet), the parts this stage does not run are dropped, and only then is what
remains evaluated. The other layers' weights are never read into memory, and need not be on disk:
a stage fetched from peers holds only the shards of its own layers (`node.files`), so the folder
may lack the others. Every tensor the stage runs must be there, checked against the shards'
headers before anything is evaluated (`ShardError` names the first one missing).

The forward pass is spelled out here rather than borrowed from the model's `__call__`, because a
stage must stop after its last layer and start from a received hidden state. It is the same
sequence of operations mlx-lm's llama/qwen2/qwen3 run (embedding, attention mask from the cache,
each layer, norm, head), so greedy tokens match a single process exactly, and the fused decode
paths (`node.cpu`) see the same layers as in a runner. Every other family (scaled embeddings,
per-layer masks, experts) runs its own mlx-lm forward with the other stages' layers replaced by
stand-ins: `node.pipeline.generic.GenericShard`, which `load_shard` returns for them.
"""

from __future__ import annotations

import json
import logging
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from protocol.sampling import REPETITION_CONTEXT, Sampling

log = logging.getLogger("shoal.pipeline")

SUPPORTED_MODULES = frozenset({"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"})
"""mlx-lm model files whose forward is exactly: embed, mask, layer(h, mask, cache) each, norm, head,
run by `Shard.forward` (mlx-lm maps mistral and other llama-shaped families onto `llama`); the rest
run as `GenericShard`s."""

MAX_HEADER_BYTES = 100 * 1024**2
"""A safetensors header larger than this is refused (the safetensors library's own limit)."""

Prepare = Callable[[nn.Module], object]
"""Called once on the pruned, still lazy shard, e.g. the runner's dtype policy; must evaluate it."""


class ShardError(ValueError):
    """The model or the layer range cannot be run as a pipeline stage."""


@dataclass(frozen=True)
class ShardSpec:
    """Which layers a stage runs, out of how many."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ShardError(
                f"layer range [{self.start}, {self.end}) is not a non-empty part of {self.num_layers} layers"
            )

    @property
    def is_first(self) -> bool:
        """Runs the embedding: its input is token ids."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """Runs the final norm and head, and samples."""
        return self.end == self.num_layers


Sampler = Callable[[mx.array], mx.array]


def request_sampler(sampling: Sampling) -> Sampler:
    """One request's sampler, the same in a runner and on a pipeline's last stage.

    Greedy at temperature 0 (mlx-lm's one `greedy_sampler` object, so greedy rows of a batch are
    sampled in one call). Otherwise top-p, then min-p, then top-k (mlx-lm's `make_sampler` order,
    using its filters), then a draw at the temperature. With a seed, the request draws from its own
    PRNG key, split once per token: its tokens depend only on the seed and the log-probs, never on
    the batch it shares or on which process samples. Without one, it draws from MLX's global
    generator. The repetition penalty is not a sampler's: see `logits_processors`.
    """
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

    if sampling.temperature == 0:
        greedy: Sampler = make_sampler(temp=0.0)
        return greedy
    # Any integer seeds (clients send negative ones); MLX keys take 0 <= seed < 2**64.
    key = None if sampling.seed is None else mx.random.key(sampling.seed % 2**64)
    scale, top_p, min_p, top_k = 1.0 / sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:  # mlx-lm rejects k >= vocab; that k keeps every token
            logprobs = apply_top_k(logprobs, top_k)
        if key is None:
            return mx.random.categorical(logprobs * scale)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * scale, key=sub)

    return sample


LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
"""mlx-lm's: (the tokens so far, logits [1, vocab]) -> logits, applied before the sampler."""


def logits_processors(sampling: Sampling) -> list[LogitsProcessor]:
    """The repetition penalty as mlx-lm's logits processor (none when it is 1): it needs the tokens
    generated so far, which a runner's generator keeps (`BatchGenerator`, `generate_step`); a
    pipeline's last stage sees only hidden states, so a split instance runs without it."""
    from mlx_lm.sample_utils import make_logits_processors

    if sampling.repetition_penalty == 1.0:
        return []
    processors: list[LogitsProcessor] = make_logits_processors(
        repetition_penalty=sampling.repetition_penalty, repetition_context_size=REPETITION_CONTEXT
    )
    return processors


def forcing(sampler: Sampler, tokens: Sequence[int]) -> Sampler:
    """`sampler`, except that its first `len(tokens)` draws give `tokens` (a seeded request resumed
    by failover, whose earlier tokens are decoded again one by one). It still draws each time, so a
    seeded key advances exactly as it did when those tokens were sampled."""
    pending = deque(tokens)

    def sample(logprobs: mx.array) -> mx.array:
        drawn = sampler(logprobs)
        if not pending:
            return drawn
        return mx.full(drawn.shape, pending.popleft(), dtype=drawn.dtype)

    return sample


class Shard(nn.Module):
    """The modules one stage runs; `parameters()` is exactly what it holds in memory."""

    def __init__(
        self,
        spec: ShardSpec,
        *,
        layers: list[nn.Module],
        embed_tokens: nn.Module | None,
        norm: nn.Module | None,
        lm_head: nn.Module | None,
        sliding_window: int | None,
        config: dict[str, Any],
    ) -> None:
        super().__init__()
        self.spec = spec
        object.__setattr__(self, "config", config)  # plain data, not part of the module tree
        self.sliding_window = sliding_window
        self.layers = layers
        # Only what the stage holds becomes a child: an absent part has no parameters at all.
        if embed_tokens is not None:
            self.embed_tokens = embed_tokens
        if norm is not None:
            self.norm = norm
        if lm_head is not None:
            self.lm_head = lm_head

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    def parameter_bytes(self) -> int:
        """Bytes of every parameter this shard holds (what loading it costs in memory)."""
        return sum(v.nbytes for _, v in cast(list[tuple[str, mx.array]], tree_flatten(self.parameters())))

    def make_cache(self) -> list[Any]:
        """A fresh KV cache for this stage's layers only, as the model's `make_cache` would build."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return [
            RotatingKVCache(max_size=self.sliding_window)
            if getattr(layer, "use_sliding", False)
            else KVCache()
            for layer in self.layers
        ]

    def forward(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids (first stage, shape [1, L]) or hidden states ([1, L, D]) -> hidden states.

        Updates `cache` in place (lazily: evaluate the result or the cache to run it).
        """
        h = self["embed_tokens"](x) if self.spec.is_first else x
        from mlx_lm.models.base import create_attention_mask

        full_mask: Any = None
        sliding_mask: Any = None
        made_full = made_sliding = False
        # One mask per kind, from the first cache of that kind, as mlx-lm's llama does: all caches
        # of one kind in a stage have the same offset, so any of them gives the same mask.
        for layer, c in zip(self.layers, cache, strict=True):
            if getattr(layer, "use_sliding", False):
                if not made_sliding:
                    sliding_mask = create_attention_mask(h, c, window_size=self.sliding_window)
                    made_sliding = True
                h = layer(h, sliding_mask, cache=c)
            else:
                if not made_full:
                    full_mask = create_attention_mask(h, c)
                    made_full = True
                h = layer(h, full_mask, cache=c)
        return h

    def prefill(self, x: mx.array, cache: list[Any]) -> None:
        """A prompt chunk into `cache` (evaluated), when no token is sampled after it."""
        self.forward(x, cache)
        mx.eval([c.state for c in cache])

    def logits(self, h: mx.array) -> mx.array:
        """Last stage: final norm and head over the last position, shape [1, vocab]."""
        if not self.spec.is_last:
            raise ShardError("only the last stage has the final norm and head")
        out = self["norm"](h)
        out = self["lm_head"](out) if "lm_head" in self else self["embed_tokens"].as_linear(out)
        return out[:, -1, :]

    def next_token(self, h: mx.array, sampler: Sampler) -> mx.array:
        """Last stage: the next token after hidden states `h` (lazy, shape [1]), picked exactly as
        mlx-lm's `generate_step` picks it."""
        return pick_token(self.logits(h), sampler)


def pick_token(logits: mx.array, sampler: Sampler) -> mx.array:
    """The token `sampler` picks from the last position's `logits`, as mlx-lm's `generate_step`
    does (on log-probabilities)."""
    return sampler(logits - mx.logsumexp(logits, keepdims=True))


def _kept_prefixes(spec: ShardSpec, *, keep_embedding: bool, head: bool) -> tuple[str, ...]:
    """The parameter name prefixes (mlx-lm's llama/qwen naming) of what a stage runs."""
    prefixes = [f"model.layers.{i}." for i in range(spec.start, spec.end)]
    if keep_embedding:
        prefixes.append("model.embed_tokens.")
    if spec.is_last:
        prefixes.append("model.norm.")
    if head:
        prefixes.append("lm_head.")
    return tuple(prefixes)


def stored_tensor_names(folder: Path) -> set[str]:
    """The tensor names in the folder's `model*.safetensors` files (what mlx-lm loads), read from
    their headers (8-byte little-endian length, then that much JSON); no tensor is read."""
    names: set[str] = set()
    for path in sorted(folder.glob("model*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_HEADER_BYTES:
                raise ShardError(f"{path.name}: a header of {length} bytes is not a safetensors header")
            header = json.loads(handle.read(length))
        names.update(name for name in header if name != "__metadata__")
    return names


def _check_stored(
    model_path: Path | str,
    spec: ShardSpec,
    holder: nn.Module,
    *,
    keep: tuple[str, ...] = (),
    prefix: str = "",
) -> None:
    """Raise `ShardError` unless the folder stores every parameter of `holder` this stage runs:
    those under the `keep` prefixes (all when none are given), named without `prefix`."""
    params = cast(list[tuple[str, mx.array]], tree_flatten(holder.parameters()))
    needed = {name.removeprefix(prefix) for name, _ in params if not keep or name.startswith(keep)}
    if missing := sorted(needed - stored_tensor_names(Path(model_path))):
        raise ShardError(
            f"{model_path} lacks {len(missing)} tensor(s) that layers [{spec.start}, {spec.end}) need, "
            f"e.g. {missing[0]!r}: a shard of this stage is missing"
        )


def load_shard(
    model_path: Path | str, *, start: int, end: int | None = None, prepare: Prepare | None = None
) -> Shard:
    """Load layers [start, end) of the mlx-lm model folder `model_path` (end None: to the last).

    Reads config.json and the safetensors headers, then only the weights this stage runs.
    Raises `ShardError` for an unsupported family or a bad range; loading errors propagate.
    """
    from mlx_lm.utils import load_model

    # strict=False: shards of other stages may be absent; what this stage runs is checked below.
    model, config = load_model(Path(model_path), lazy=True, strict=False)
    family = type(model).__module__
    inner = getattr(model, "model", None)
    shard: Shard
    if family not in SUPPORTED_MODULES or inner is None:
        from node.pipeline.generic import generic_shard

        shard = generic_shard(model, config, start=start, end=end)
        _check_stored(model_path, shard.spec, shard, prefix="net.")
        del model, inner
    else:
        all_layers = list(inner.layers)
        spec = ShardSpec(start, len(all_layers) if end is None else end, len(all_layers))
        tied = bool(getattr(model.args, "tie_word_embeddings", "lm_head" not in model))
        keep_embedding = spec.is_first or (spec.is_last and tied)
        kept = _kept_prefixes(spec, keep_embedding=keep_embedding, head=spec.is_last and not tied)
        _check_stored(model_path, spec, model, keep=kept)
        shard = Shard(
            spec,
            layers=all_layers[spec.start : spec.end],
            embed_tokens=inner.embed_tokens if keep_embedding else None,
            norm=inner.norm if spec.is_last else None,
            lm_head=model["lm_head"] if spec.is_last and not tied else None,
            sliding_window=getattr(inner, "sliding_window", None),
            config=config,
        )
        # Drop every reference to the full model before anything is evaluated: the layers we did
        # not keep are lazy arrays that were never read, and now never will be.
        del model, inner, all_layers
    if prepare is not None:
        prepare(shard)
    mx.eval(shard.parameters())
    spec = shard.spec
    log.info(
        "stage layers [%d, %d) of %d%s%s: %.1f MB of weights",
        spec.start,
        spec.end,
        spec.num_layers,
        " + embedding" if spec.is_first else "",
        " + norm/head" if spec.is_last else "",
        shard.parameter_bytes() / 1e6,
    )
    return shard
