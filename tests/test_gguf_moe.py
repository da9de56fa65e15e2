"""A qwen3moe GGUF, written with gguf-py, imported and served by a real node.

`test_gguf_import` checks the imported layers (each expert dequantizes to gguf-py's values) and
the logits of mlx-lm's qwen3_moe forward; here: the header check lets the file through, the
import gives the same bytes every time, and `shoal run --model FILE.gguf` answers with the greedy
text of the float32 reference model built from gguf-py's dequantized tensors.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest

from node.cpu.dtype import rounds_to_int8
from node.cpu.kernel_layers import KernelDenseLinear
from node.models import import_gguf
from node.models.preflight import check_header
from node.native import load_kernels
from node.runner.engine import load_model
from tests.kernel_error import int8_rows
from tests.nodes import start_node
from tests.test_gguf_import import Q, TinyModel, reference_folder, write_tiny_gguf

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
MOE = TinyModel(
    "qwen3moe",
    types={"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0},
    default=Q.F32,
    chat_template=CHATML,
)
"""Experts as stored (Q8_0, Q4_0; exact in MLX's affine form), the rest float32."""
MXFP4_MOE = replace(MOE, types=dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.MXFP4))
"""Experts as llama-quantize's MXFP4_MOE writes them (MLX `mxfp4`, exact)."""
MAX_TOKENS = 8
READY_TIMEOUT = 180.0
"""Seconds for the node to import the file and load the model (the CPUs may be shared)."""


def test_the_header_check_and_a_second_import_agree(tmp_path: Path) -> None:
    gguf = tmp_path / "moe.gguf"
    write_tiny_gguf(MOE, gguf)
    check_header(gguf)  # no GGUFImportError: `shoal run` lets it through
    first = import_gguf(gguf, tmp_path / "first")
    second = import_gguf(gguf, tmp_path / "second")
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:  # the import is deterministic: same bytes every time
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    config = json.loads((first / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    assert config["quantization"]["model.layers.1.mlp.switch_mlp.up_proj"]["bits"] == 4


@pytest.mark.skipif(load_kernels().module is None, reason="needs the native kernels")
def test_float32_layers_and_routers_of_a_quantized_file_run_on_the_kernels(tmp_path: Path) -> None:
    """GGUF keeps routers (and here the attention) float32: they go to the kernels as they are, and
    each router runs inside its MoE operation, so no decode step leaves the kernels' threads."""
    gguf = tmp_path / "tiny-moe.gguf"
    write_tiny_gguf(MOE, gguf, seed=3)
    model = load_model(import_gguf(gguf, tmp_path / "imported"), vocab_dir=None).model
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    routers = [layer.mlp.gate for layer in model.model.layers]
    assert routers and all(isinstance(r, KernelDenseLinear) and r.weight.dtype == mx.float32 for r in routers)
    # Its experts round activations to int8 where the CPU has int8 bodies (the default), so a
    # failover replays step by step.
    assert rounds_to_int8(model) == int8_rows(4, experts=True)


@pytest.mark.parametrize("spec", [MOE, MXFP4_MOE], ids=["q8-q4-experts", "mxfp4-experts"])
def test_a_node_serves_a_qwen3moe_gguf_as_the_float32_reference_answers(
    spec: TinyModel, tmp_path: Path
) -> None:
    from mlx_lm import generate, load

    gguf = tmp_path / "tiny-moe.gguf"
    reference, _kinds = write_tiny_gguf(spec, gguf, seed=3)
    imported = import_gguf(gguf, tmp_path / "imported")
    loaded = load(str(reference_folder(imported, reference, tmp_path / "reference")))
    plain, tokenizer = loaded[0], loaded[1]
    messages = [{"role": "user", "content": "Say hello."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = generate(plain, tokenizer, prompt=prompt, max_tokens=MAX_TOKENS)
    assert prompt and want

    node = start_node(data_dir=tmp_path / "data", model=str(gguf), ready_timeout=READY_TIMEOUT)
    try:
        body = {"model": node.model_id, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
        answer = httpx.post(f"{node.base_url}/v1/chat/completions", json=body, timeout=120)
    finally:
        node.stop()
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["usage"]["prompt_tokens"] == len(prompt)
    assert got["choices"][0]["message"]["content"] == want, (got, want)
    assert any("weights: " in line for line in node.log)  # the runner loaded it
