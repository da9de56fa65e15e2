"""Quantized models served by real `shoal run` nodes: the kernels' text, logs and memory.

A random bf16 llama quantized to MLX affine 4-bit (group 32) and 8-bit (group 64) is served three
ways, each by its own node on 127.0.0.1:

- kernels: the quantized folder on the fast path, weights kept as stored on Shoal's CPU kernels;
- plain: the same folder with `--no-fast-path`, dequantized to float32 at load by MLX;
- reference: a float32 folder dequantized in numpy (`dequantized_copy`), served as float32.

Plain and reference hold the same float32 numbers reached two ways (MLX's dequantize, and the
format written out by hand), so either is a fair reference for the kernels; the test asks all three
for the same greedy text. Then two 4-bit models differing only in depth show that the runner's
resident memory grows by the stored size, not by float32's, and the node's not at all.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx  # before node.native: the kernels extension links against MLX's library
import pytest

from node.native import load_kernels
from tests.model_factory import dequantized_copy, make_random_model, quantized_copy
from tests.nodes import RunningNode, start_node

needs_kernels = pytest.mark.skipif(
    load_kernels().module is None, reason=f"native kernels unavailable: {load_kernels().reason}"
)
PROMPTS = ["Tell me a long story.", "What is the capital of France?", "Count to twenty: 1, 2, 3,"]
MAX_TOKENS = 16
READY_TIMEOUT = 180.0
"""Seconds for a node to listen and load its model (the CPUs may be shared with other work)."""
REQUEST_TIMEOUT = 120.0
MB = 1024**2

QUANTS = [pytest.param((4, 32), id="4bit-g32"), pytest.param((8, 64), id="8bit-g64")]
pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.DeviceType.cpu, reason="the weight policy under test is the CPU's"
)


# --- helpers ---------------------------------------------------------------------------------------


@contextmanager
def _serving(model: Path, data_dir: Path, *args: str) -> Iterator[RunningNode]:
    """One node serving `model` on loopback; stopped however the block ends."""
    node = start_node(*args, data_dir=data_dir, model=str(model), ready_timeout=READY_TIMEOUT)
    try:
        yield node
    finally:
        node.stop()


def _body(node: RunningNode, prompt: str, *, stream: bool) -> dict[str, Any]:
    return {
        "model": node.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }


def _greedy_text(node: RunningNode, prompt: str) -> str:
    """The streamed content of a greedy completion, joined."""
    deltas = []
    url = f"{node.base_url}/v1/chat/completions"
    with httpx.stream(
        "POST", url, json=_body(node, prompt, stream=True), timeout=REQUEST_TIMEOUT
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    if content := choice["delta"].get("content"):
                        deltas.append(content)
    return "".join(deltas)


def _complete(node: RunningNode, prompt: str) -> dict[str, Any]:
    """A greedy completion with `"stream": false`: the JSON answer."""
    url = f"{node.base_url}/v1/chat/completions"
    response = httpx.post(url, json=_body(node, prompt, stream=False), timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _weights_line(node: RunningNode) -> str:
    """The runner's one "weights: ..." log line (already logged once the model is ready)."""
    lines = [line.strip() for line in node.log if "weights: " in line]
    assert len(lines) == 1, lines
    return lines[0]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _float32_bytes(safetensors: Path, bits: int) -> int:
    """The bytes the file's weights take as float32, dequantized: read from its header, not loaded."""
    with safetensors.open("rb") as f:
        header: dict[str, Any] = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    total = 0
    for name, entry in header.items():
        if name.endswith((".scales", ".biases")):
            continue
        count = math.prod(entry["shape"])
        if entry["dtype"] == "U32" and f"{name.removesuffix('.weight')}.scales" in header:
            count = count * 32 // bits
        total += 4 * count
    return total


# --- the served models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random bf16 llama (2 layers, 128 wide) with SmolLM2's tokenizer."""
    return make_random_model(
        tmp_path_factory.mktemp("models") / "bf16",
        tokenizer_from=builtin_model_dir,
        dtype="bfloat16",
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.fixture(scope="module", params=QUANTS)
def quant(request: pytest.FixtureRequest) -> tuple[int, int]:
    bits_group: tuple[int, int] = request.param
    return bits_group


@pytest.fixture(scope="module")
def quantized_model(
    bf16_model: Path, quant: tuple[int, int], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    bits, group = quant
    return quantized_copy(
        bf16_model, tmp_path_factory.mktemp("models") / f"q{bits}", bits=bits, group_size=group
    )


@pytest.fixture(scope="module")
def kernels_node(quantized_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    with _serving(quantized_model, tmp_path_factory.mktemp("data")) as node:
        yield node


@pytest.fixture(scope="module")
def plain_node(quantized_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """The same quantized folder on plain MLX (`--no-fast-path`): float32 weights from MLX's dequantize."""
    with _serving(quantized_model, tmp_path_factory.mktemp("data"), "--no-fast-path") as node:
        yield node


@pytest.fixture(scope="module")
def reference_node(quantized_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """A float32 folder holding the quantized weights dequantized by hand, on the fast path."""
    dense = dequantized_copy(quantized_model, tmp_path_factory.mktemp("models") / "dequantized")
    with _serving(dense, tmp_path_factory.mktemp("data")) as node:
        yield node


# --- 1 and 2: the same greedy text three ways ------------------------------------------------------


@needs_kernels
def test_quantized_model_on_the_kernels_answers_like_its_float32_weights(
    kernels_node: RunningNode, reference_node: RunningNode, quant: tuple[int, int]
) -> None:
    bits, _group = quant
    assert f"weights: {bits}-bit affine + bfloat16 kept as stored in " in _weights_line(kernels_node)
    assert "on Shoal's CPU kernels" in _weights_line(kernels_node)
    assert "weights: float32 as stored" in _weights_line(reference_node)
    for prompt in PROMPTS:
        text = _greedy_text(kernels_node, prompt)
        assert len(text) > 10, text  # a real answer, not an early end
        assert text == _greedy_text(reference_node, prompt), prompt

    answer = _complete(kernels_node, PROMPTS[0])
    usage = answer["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS, answer
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    assert answer["choices"][0]["message"]["content"] == _greedy_text(kernels_node, PROMPTS[0])


@needs_kernels
def test_no_fast_path_dequantizes_at_load_and_answers_like_the_kernels(
    kernels_node: RunningNode, plain_node: RunningNode, quant: tuple[int, int]
) -> None:
    bits, _group = quant
    line = _weights_line(plain_node)
    assert f"weights: float32, dequantized at load from {bits}-bit affine + bfloat16 " in line
    assert "turned off by configuration" in line
    for prompt in PROMPTS:
        assert _greedy_text(plain_node, prompt) == _greedy_text(kernels_node, prompt), prompt


def test_no_fast_path_serves_a_quantized_model_without_kernels(
    plain_node: RunningNode, reference_node: RunningNode
) -> None:
    """Where the kernels cannot load too: plain MLX's float32 equals the hand-dequantized weights."""
    for prompt in PROMPTS[:2]:
        text = _greedy_text(plain_node, prompt)
        assert len(text) > 10 and text == _greedy_text(reference_node, prompt), prompt


# --- 3: memory follows the stored size -------------------------------------------------------------

MEMORY_LAYERS = {"small": 2, "big": 28}
"""Depths of the two 4-bit models (256 wide, 8192 intermediate): 26 more layers of 6.5 M weights
are ~100 MB more stored at 4-bit (group 32, bf16 scales: 5 bits a weight), ~640 MB more as float32."""


@pytest.fixture(scope="module")
def memory_models(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memory-models")
    out = {}
    for name, layers in MEMORY_LAYERS.items():
        bf16 = make_random_model(
            root / f"{name}-bf16",
            tokenizer_from=builtin_model_dir,
            dtype="bfloat16",
            num_layers=layers,
            hidden_size=256,
            intermediate_size=8192,
        )
        out[name] = quantized_copy(bf16, root / f"{name}-q4", bits=4, group_size=32)
        shutil.rmtree(bf16)
    return out


@needs_kernels
def test_runner_memory_follows_the_stored_size_and_the_node_holds_no_weights(
    memory_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    stored, float32, runner, node_rss = {}, {}, {}, {}
    for name, model in memory_models.items():  # one node at a time: the other's memory is gone
        weights = model / "model.safetensors"
        stored[name], float32[name] = weights.stat().st_size, _float32_bytes(weights, bits=4)
        with _serving(model, tmp_path_factory.mktemp("data")) as node:
            assert "kept as stored" in _weights_line(node)
            assert _complete(node, PROMPTS[0])["usage"]["completion_tokens"] > 0
            runner[name], node_rss[name] = _rss_bytes(node.runner_pid()), _rss_bytes(node.process.pid)

    def diff(values: dict[str, int]) -> float:
        return (values["big"] - values["small"]) / MB

    for name in MEMORY_LAYERS:
        print(
            f"\n{name}: stored {stored[name] / MB:.1f} MB, float32 {float32[name] / MB:.1f} MB, "
            f"runner RSS {runner[name] / MB:.1f} MB, node RSS {node_rss[name] / MB:.1f} MB"
        )
    print(
        f"big - small: stored {diff(stored):.1f} MB, float32 {diff(float32):.1f} MB, "
        f"runner RSS {diff(runner):.1f} MB, node RSS {diff(node_rss):.1f} MB"
    )
    assert diff(stored) > 90, "the models should differ by ~100 MB stored"
    assert diff(runner) > 0.8 * diff(stored), "the big model's weights are not resident: a bad measurement?"
    assert diff(runner) < 1.3 * diff(stored) + 30, "the runner holds more than the stored weights"
    assert diff(runner) < 0.4 * diff(float32)
    assert diff(node_rss) < 50, "the node's memory grew with the model"
