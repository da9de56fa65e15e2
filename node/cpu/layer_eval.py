"""Prefill on the CPU evaluates the model one transformer layer at a time.

MLX builds the graph of a whole prefill chunk (every layer) and evaluates it at once; on the CPU
that keeps far more intermediates alive than one layer needs. Measured on a Llama-3.2-1B shape
(4-bit, 512-token chunks): MLX's peak above the weights was 286 MB for the whole-graph chunk,
against 63 MB for the largest single layer (its MLP). An `mx.eval` after each layer of a prefill
chunk keeps the peak at one layer's worth, at the cost of one synchronisation per layer (a
chunk takes seconds; a sync, microseconds). The last layer is left out: a prefill chunk that is
not the prompt's last only needs the KV caches, so MLX skips that layer's attention output and
MLP, and evaluating it would add a layer's work (6% of a 16-layer model's prefill). Decode
steps (one token per sequence) are left alone: their intermediates are tiny and mlx-lm overlaps
them with the next step's graph.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from node.cpu.mlx_lm_quirks import put_mixin


class _EvaluatedInPrefill:
    """Mixed in before a layer's own class: evaluates its output when it saw several tokens."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = super().__call__(x, *args, **kwargs)  # type: ignore[misc]
        if x.ndim == 3 and x.shape[1] > 1 and isinstance(out, mx.array):
            mx.eval(out)
        return out


def evaluate_layers_in_prefill(model: Any) -> int:
    """Make each of `model.layers` but the last evaluate its output during prefill; returns how many.

    The layers keep their parameters, names and class name (only a mixin is put in front of
    their class), so loading, sharding and `named_modules()` see the same model. A model
    without a `layers` list is left as it is (0).
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return 0
    for layer in layers[:-1]:
        put_mixin(layer, _EvaluatedInPrefill)
    return max(0, len(layers) - 1)
