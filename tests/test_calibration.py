"""Kernel sets chosen by measurement (`node.cpu.calibration`): the choice rule, the cache per CPU
model and kernel build, the settings, and products that agree whichever set a layout runs on."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from node.cpu.calibration import ROW_CLASSES, cache_file, calibrate, decide
from node.native import load_kernels
from tests.model_factory import make_random_model, quantized_copy

KERNELS = load_kernels().module
CANDIDATES: list[str] = list(KERNELS.rows_candidates()) if KERNELS is not None else []
pytestmark = pytest.mark.skipif(len(CANDIDATES) < 2, reason="this CPU runs one kernel set: nothing to choose")


@pytest.fixture(autouse=True)
def _defaults_after() -> Iterator[None]:
    """Choices are process-wide: put the defaults back for the tests that follow."""
    yield
    assert KERNELS is not None
    for layout in ("affine4", "affine8", "mxfp4", "f16", "bf16", "f32"):
        for rows in ROW_CLASSES:
            KERNELS.choose_rows_kernels(layout, rows, "")


@pytest.fixture(scope="module")
def q4_dir(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("calibration")
    bf16 = make_random_model(
        root / "bf16", tokenizer_from=builtin_model_dir, dtype="bfloat16", hidden_size=128
    )
    return quantized_copy(bf16, root / "q4", bits=4, group_size=32)


def _loaded(folder: Path) -> Any:
    from node.runner.engine import load_model

    return load_model(folder, vocab_dir=None).model


def test_the_fastest_set_wins_only_by_more_than_the_margin() -> None:
    assert decide({"wide": 1.0, "narrow": 0.9}, "wide") == "narrow"
    assert decide({"wide": 1.0, "narrow": 0.98}, "wide") == "wide"  # within the noise: the default
    assert decide({"wide": 1.0, "narrow": 1.2}, "wide") == "wide"
    assert decide({"wide": 1.0, "mid": 0.8, "narrow": 0.85}, "wide") == "mid"


def test_measured_once_then_read_from_the_cache(q4_dir: Path, tmp_path: Path) -> None:
    assert KERNELS is not None
    model = _loaded(q4_dir)
    env = {"SHOAL_KERNEL_CALIBRATE": "on", "SHOAL_CACHE_DIR": str(tmp_path)}
    first = calibrate(model, KERNELS, env)
    assert "measured 2 now" in first
    path = cache_file(KERNELS, env)
    stored = json.loads(path.read_text())
    assert set(stored["choices"]) == {"affine4/1", "affine4/4"}
    for rows in ROW_CLASSES:
        entry = stored["choices"][f"affine4/{rows}"]
        assert set(entry["ms"]) == set(CANDIDATES) and entry["kernel"] in CANDIDATES
        assert KERNELS.rows_choice("affine4", rows) == entry["kernel"]
    # The next start reads the cache: a choice written there is what runs, and nothing is measured.
    stored["choices"]["affine4/1"]["kernel"] = CANDIDATES[-1]
    path.write_text(json.dumps(stored))
    assert "(cached," in calibrate(model, KERNELS, env)
    assert KERNELS.rows_choice("affine4", 1) == CANDIDATES[-1]
    # A set this build or CPU does not run counts as not measured; "redo" measures everything again.
    stored["choices"]["affine4/1"]["kernel"] = "neon"
    path.write_text(json.dumps(stored))
    assert "measured 1 now" in calibrate(model, KERNELS, env)
    assert "measured 2 now" in calibrate(model, KERNELS, {**env, "SHOAL_KERNEL_CALIBRATE": "redo"})


def test_off_and_bad_settings(q4_dir: Path, tmp_path: Path) -> None:
    assert KERNELS is not None
    model = _loaded(q4_dir)
    off = calibrate(model, KERNELS, {"SHOAL_KERNEL_CALIBRATE": "off", "SHOAL_CACHE_DIR": str(tmp_path)})
    assert "for every product (calibration off)" in off and not list(tmp_path.iterdir())
    assert KERNELS.rows_choice("affine4", 1) == ""
    with pytest.raises(ValueError, match="SHOAL_KERNEL_CALIBRATE='sometimes': use one of on, redo, off"):
        calibrate(model, KERNELS, {"SHOAL_KERNEL_CALIBRATE": "sometimes"})


def test_the_runner_calibrates_when_it_loads(
    q4_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SHOAL_KERNEL_CALIBRATE", "on")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        _loaded(q4_dir)
    assert any("kernels by measurement (measured 2 now" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rows", [1, 4])
def test_every_set_gives_the_product(rows: int) -> None:
    assert KERNELS is not None
    w, scales, biases = mx.quantize(mx.random.normal((96, 512)), group_size=32, bits=4)
    x = mx.random.normal((rows, 512))
    want = x @ mx.dequantize(w, scales, biases, group_size=32, bits=4).T
    for name in CANDIDATES:
        KERNELS.choose_rows_kernels("affine4", rows, name)
        got = KERNELS.weight_matmul(x, w, scales, biases, group_size=32, bits=4)
        assert (mx.abs(got - want).max() < 1e-4 * mx.abs(want).max()).item(), name
