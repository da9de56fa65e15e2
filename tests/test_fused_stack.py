"""A decode step's layer stack as one operation (`node.cpu.fused_stack`) gives the per-layer bits.

Each architecture it takes (llama; qwen2, with q/k/v biases; qwen3, with per-head norms) is loaded
4-bit twice, with the stack and without (`SHOAL_DECODER_STACK=0`: the fused layers, which
tests/test_fused_layers.py holds to mlx-lm's own): decode steps give equal logits alone (across a
KV-cache growth, where the per-layer way takes over for a step) and in a padded batch (mlx-lm's
`BatchGenerator`, as the runner runs it, with sequences leaving and joining). Caches it writes in
place are never shared with another array.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from node.cpu.fused import uninstall_fused_ops
from node.cpu.fused_stack import _StackedModel, stack_decoder
from node.native import load_kernels
from node.runner.engine import load_model
from tests.decode_runs import BATCHED_TOKENS, batched, logits_alone
from tests.model_factory import ModelType, make_random_model, quantized_copy

KERNELS = load_kernels().module
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "decoder_stack"), reason="the native kernels are not built"
)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    uninstall_fused_ops()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request: Any, builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type: ModelType = request.param
    root = tmp_path_factory.mktemp(f"stack-{model_type}")
    bf16 = make_random_model(
        root / "bf16",
        model_type=model_type,
        tokenizer_from=builtin_model_dir,
        dtype="bfloat16",
        num_layers=3,
        hidden_size=128,
        intermediate_size=256,
    )
    return quantized_copy(bf16, root / "q4", bits=4, group_size=32)


def _loaded(model_dir: Path, monkeypatch: pytest.MonkeyPatch, *, stacked: bool) -> Any:
    monkeypatch.setenv("SHOAL_DECODER_STACK", "1" if stacked else "0")
    model = load_model(model_dir, vocab_dir=None).model
    assert isinstance(model.model, _StackedModel) == stacked
    return model


def _steps(model: Any) -> int:
    stack = model.model.stack() if isinstance(model.model, _StackedModel) else None
    return 0 if stack is None else stack.steps


def test_the_stack_gives_the_bits_of_the_fused_layers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacked = _loaded(model_dir, monkeypatch, stacked=True)
    layered = _loaded(model_dir, monkeypatch, stacked=False)
    # KVCache grows in steps of 256: from 250 positions, step 7 must grow it (the per-layer way).
    for prompt, steps in [(9, 4), (250, 10)]:
        before = _steps(stacked)
        got, want = logits_alone(stacked, prompt, steps), logits_alone(layered, prompt, steps)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and bool(mx.array_equal(a, b).item())
        assert steps - 1 <= _steps(stacked) - before <= steps  # all steps but the growing one
    before = _steps(stacked)
    got_batch, want_batch = batched(stacked), batched(layered)
    assert _steps(stacked) > before
    assert len(got_batch) == len(want_batch) == BATCHED_TOKENS
    for (uid, token, logprobs), (uid2, token2, logprobs2) in zip(got_batch, want_batch, strict=True):
        assert (uid, token) == (uid2, token2)
        assert bool(mx.array_equal(logprobs, logprobs2).item())


def test_a_shared_cache_is_not_written_in_place(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _loaded(model_dir, monkeypatch, stacked=True)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(300, 310))]), cache=cache))
    views = [c.keys[:, :, :11, :] for c in cache]  # another array on each cache's buffer
    mx.eval(views)
    stored = [np.array(v) for v in views]
    before = _steps(model)
    mx.eval(model(mx.array([[7]]), cache=cache))
    assert _steps(model) == before  # shared: the per-layer way, which copies
    for view, keys, c in zip(views, stored, cache, strict=True):
        assert np.array_equal(np.array(view), keys)  # position 10 still as it was: zeros
        assert not np.array_equal(np.array(c.keys), keys)  # the step's keys went to the copy
    del views
    mx.eval(model(mx.array([[8]]), cache=cache))
    assert _steps(model) == before + 1  # the copies are the cache's own


def test_models_it_cannot_run_keep_their_own_call(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_FUSED_LAYERS", "0")  # mlx-lm's layers: nothing for one operation to run
    model = load_model(model_dir, vocab_dir=None).model
    assert KERNELS is not None and not stack_decoder(model, KERNELS)
    want = logits_alone(model, 5, 2)
    got = logits_alone(model, 5, 2)
    assert all(bool(mx.array_equal(a, b).item()) for a, b in zip(got, want, strict=True))
    assert _steps(model) == 0


def test_bad_inputs_are_refused_by_name(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _loaded(model_dir, monkeypatch, stacked=True)
    stack = model.model.stack()
    assert stack is not None and KERNELS is not None
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(300, 305))]), cache=cache))
    keys, values = [c.keys for c in cache], [c.values for c in cache]
    x = mx.zeros((1, 1, 128))
    kw: dict[str, Any] = {"dims": 32, "traditional": False, "base": 10000.0, "rope_scale": 1.0, "offset": 5}
    kw["scale"] = 0.1
    with pytest.raises(ValueError, match=r"decoder_stack.*one key and value cache a layer"):
        KERNELS.decoder_stack(x, stack.plan, keys[:-1], values[:-1], index=5, **kw)
    with pytest.raises(ValueError, match=r"decoder_stack.*index is outside"):
        KERNELS.decoder_stack(x, stack.plan, keys, values, index=keys[0].shape[2], **kw)
    with pytest.raises(ValueError, match=r"decoder_stack.*\[B, 1, E\]"):
        KERNELS.decoder_stack(mx.zeros((1, 2, 128)), stack.plan, keys, values, index=5, **kw)
    with pytest.raises(ValueError, match=r"decoder_stack.*both float32 or both float16"):
        KERNELS.decoder_stack(x, stack.plan, [k.astype(mx.bfloat16) for k in keys], values, index=5, **kw)
    with pytest.raises(ValueError, match=r"decoder_stack.*both float32 or both float16"):
        KERNELS.decoder_stack(x, stack.plan, [k.astype(mx.float32) for k in keys], values, index=5, **kw)
