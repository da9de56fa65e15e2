"""Prefill on the CPU evaluates one layer at a time: same values, same model tree, a lower peak."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from node.cpu.fused_layers import _FusedBlock, fuse_decoder_layers
from node.cpu.layer_eval import _EvaluatedInPrefill
from node.native import load_kernels
from node.runner.engine import load_model
from tests.model_factory import make_random_model


@pytest.fixture(scope="module")
def wide_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough that a layer's intermediates dwarf the residual stream."""
    return make_random_model(
        tmp_path_factory.mktemp("models") / "wide",
        tokenizer_from=builtin_model_dir,
        num_layers=8,
        hidden_size=256,
        intermediate_size=4096,
        dtype="bfloat16",
    )


def _unpatch(model: Any) -> None:
    """Back to the layers' own classes (mlx-lm's), fused again where they were (so that both
    prefills run the same arithmetic)."""
    fused = any(isinstance(layer, _FusedBlock) for layer in model.layers)
    for layer in model.layers:
        if isinstance(layer, _EvaluatedInPrefill):
            mixins = (_EvaluatedInPrefill, _FusedBlock)
            own: type = next(c for c in type(layer).__mro__ if not issubclass(c, mixins))
            layer.__class__ = own
    if fused:
        kernels = load_kernels().module
        assert kernels is not None and fuse_decoder_layers(model, kernels) == len(model.layers) - 1


def _prefill(model: Any, tokens: list[int]) -> tuple[list[mx.array], int]:
    """The KV caches after a prefill chunk that is not the prompt's last (only the caches are
    evaluated, as the runner does), and MLX's peak above what was live before."""
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    states = [a for c in cache for a in c.state]
    mx.eval(states)
    return states, mx.get_peak_memory() - before


def test_every_layer_but_the_last_evaluates_in_prefill(wide_model: Path) -> None:
    model = load_model(wide_model, vocab_dir=None).model
    names = [name for name, _ in model.named_modules()]
    patched = [isinstance(layer, _EvaluatedInPrefill) for layer in model.layers]
    assert patched == [True] * 7 + [False]
    assert type(model.layers[0]).__name__ == type(model.layers[-1]).__name__  # same class name
    _unpatch(model)
    assert [name for name, _ in model.named_modules()] == names


def test_same_caches_and_a_lower_peak(wide_model: Path) -> None:
    tokens = list(range(300, 812))
    model = load_model(wide_model, vocab_dir=None).model
    per_layer, per_layer_peak = _prefill(model, tokens)
    decode = model(mx.array([[5]]), cache=make_prompt_cache(model))  # one token: no eval inside
    mx.eval(decode)
    _unpatch(model)
    whole, whole_peak = _prefill(model, tokens)
    assert all(mx.array_equal(a, b).item() for a, b in zip(per_layer, whole, strict=True))
    # 512 tokens x 4096 wide: each layer's MLP holds ~25 MB; the whole graph holds several layers'.
    assert per_layer_peak < 0.6 * whole_peak, (per_layer_peak, whole_peak)
