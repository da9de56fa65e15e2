"""Tiny GGUFs of every supported type and architecture, imported and checked against gguf-py.

Each file is written with `gguf.GGUFWriter` (random weights; quantized with `gguf.quants.quantize`
where gguf-py can, else random valid K-quant blocks). The reference is gguf-py's own
`dequantize` of the very blocks in the file, put back in Hugging Face row order by the test's own
llama.cpp permutation; the imported folder is loaded with `mlx_lm.load` and compared layer by
layer (`mx.dequantize`) and by the logits of a forward pass against a float32 reference folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from tokenizers import pre_tokenizers

from node.models import GGUFImportError, import_gguf
from tests.model_factory import llama_cpp_permute
from tests.test_gguf_arch import llama_cpp_rope_factors
from tests.test_gguf_quants import random_k_blocks

Q = GGMLQuantizationType
EXACT = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4}
READ = {Q.Q4_K, Q.Q5_K, Q.Q6_K}
"""Types the import reads but not exactly: fp16-rounded scales, or requantized (Q6_K)."""
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 256
"""qwen3moe: experts per layer, chosen per token, and each expert's ffn width (K-quant rows: 256)."""
ROPE_BASE = 500000.0


def tiny_tokenizer_meta() -> dict[str, Any]:
    """A byte-level BPE vocabulary of 262 tokens (all bytes, 2 merges, 2 specials): tiny embeddings."""
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 2,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


@dataclass
class TinyModel:
    arch: str
    types: Mapping[str, GGMLQuantizationType] = field(default_factory=dict)
    """GGUF part name (`attn_q`, `token_embd`, ...) -> its type; others are `default`."""
    default: GGMLQuantizationType = Q.Q8_0
    tied: bool = False
    head_dim: int = HIDDEN // HEADS
    rope_freqs: bool = False
    chat_template: str | None = None
    """`tokenizer.chat_template`, for a model a node serves through the chat API."""
    pre: str = "default"
    """`tokenizer.ggml.pre`: how the vocabulary splits text before BPE."""

    def shapes(self, vocab: int) -> dict[str, tuple[int, ...]]:
        q_rows, kv_rows = HEADS * self.head_dim, KV_HEADS * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (vocab, HIDDEN),
            "output_norm.weight": (HIDDEN,),
        }
        if not self.tied:
            shapes["output.weight"] = (vocab, HIDDEN)
        for i in range(LAYERS):
            layer = {
                "attn_norm.weight": (HIDDEN,),
                "attn_q.weight": (q_rows, HIDDEN),
                "attn_k.weight": (kv_rows, HIDDEN),
                "attn_v.weight": (kv_rows, HIDDEN),
                "attn_output.weight": (HIDDEN, q_rows),
                ("post_attention_norm" if self.arch == "gpt-oss" else "ffn_norm") + ".weight": (HIDDEN,),
            }
            if self.arch in ("qwen3moe", "gpt-oss"):
                layer |= {
                    "ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                    "ffn_gate_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                    "ffn_up_exps.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
                    "ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
                }
            else:
                layer |= {"ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN)}
                layer |= {"ffn_down.weight": (HIDDEN, FFN)}
            if self.arch == "qwen2":
                layer |= {"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)}
            if self.arch in ("qwen3", "qwen3moe"):
                layer |= {"attn_q_norm.weight": (self.head_dim,), "attn_k_norm.weight": (self.head_dim,)}
            if self.arch == "gpt-oss":  # a bias for every matrix (experts: one per expert), sinks
                layer |= {n.replace(".weight", ".bias"): s[:-1] for n, s in layer.items() if len(s) > 1}
                layer["attn_sinks.weight"] = (HEADS,)
            shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
        return shapes


_HF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_HF_GPT_OSS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")},
}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The test's own spelling of the HF names (independent of node.models.gguf_arch)."""
    parts = gguf_name.split(".")
    if parts[0] != "blk":
        return f"{_HF_GLOBAL[parts[0]]}.{parts[1]}"
    name = f"model.layers.{parts[1]}.{(_HF_LAYER | (_HF_GPT_OSS if arch == 'gpt-oss' else {}))[parts[2]]}"
    return name if parts[2] == "attn_sinks" else f"{name}.{parts[3]}"


def write_tiny_gguf(
    spec: TinyModel, path: Path, seed: int = 0
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, Q]]:
    """Write `spec` as a GGUF; return the float32 reference weights (HF names, HF row order) and
    each HF weight's GGUF type."""
    rng = np.random.default_rng(seed)
    meta = tiny_tokenizer_meta()
    vocab = len(meta["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(path, spec.arch)
    a = spec.arch
    for key, value in {
        f"{a}.block_count": LAYERS,
        f"{a}.context_length": 131072,
        f"{a}.embedding_length": HIDDEN,
        f"{a}.feed_forward_length": FFN,
        f"{a}.attention.head_count": HEADS,
        f"{a}.attention.head_count_kv": KV_HEADS,
        f"{a}.attention.key_length": spec.head_dim,
        f"{a}.attention.value_length": spec.head_dim,
        f"{a}.rope.dimension_count": spec.head_dim,
    }.items():
        writer.add_uint32(key, value)
    if a in MODEL_TYPES:  # mixtures of experts
        writer.add_uint32(f"{a}.expert_count", EXPERTS)
        writer.add_uint32(f"{a}.expert_used_count", EXPERTS_USED)
        writer.add_uint32(f"{a}.expert_feed_forward_length", EXPERT_FFN)
    if a == "gpt-oss":  # as llama.cpp's converter writes gpt-oss-20b's
        writer.add_uint32(f"{a}.attention.sliding_window", 128)
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", 32.0)
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", ROPE_BASE)
    writer.add_string("tokenizer.ggml.model", meta["tokenizer.ggml.model"])
    writer.add_string("tokenizer.ggml.pre", spec.pre)
    writer.add_array("tokenizer.ggml.tokens", meta["tokenizer.ggml.tokens"])
    writer.add_array("tokenizer.ggml.token_type", meta["tokenizer.ggml.token_type"])
    writer.add_array("tokenizer.ggml.merges", meta["tokenizer.ggml.merges"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", meta["tokenizer.ggml.bos_token_id"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", meta["tokenizer.ggml.eos_token_id"])
    if spec.chat_template is not None:
        writer.add_string("tokenizer.chat_template", spec.chat_template)

    reference: dict[str, np.ndarray[Any, Any]] = {}
    kinds: dict[str, Q] = {}
    for i, (name, shape) in enumerate(sorted(spec.shapes(vocab).items())):
        if len(shape) == 1 or name.endswith(".bias"):
            data = (1.0 if "norm" in name else 0.0) + rng.standard_normal(shape).astype(np.float32) * 0.1
            writer.add_tensor(name, data)
            reference[hf_name(name, spec.arch)] = data
            continue
        part = name.split(".")[-2]
        qtype = spec.types.get(part, spec.default)
        if qtype not in EXACT:  # random valid blocks (gguf-py cannot quantize K-quants)
            n_rows = int(np.prod(shape[:-1]))  # experts' (experts, rows, cols): rows of rows
            raw = random_k_blocks(qtype, n_rows, shape[-1], seed=seed * 1000 + i).reshape(*shape[:-1], -1)
        else:
            raw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        kinds[hf_name(name, spec.arch)] = qtype
        if qtype not in EXACT | READ:
            continue  # a type the import must refuse: no reference needed
        rows = dequantize(raw, qtype).reshape(shape)
        if spec.arch == "llama" and part in ("attn_q", "attn_k"):  # the file holds llama.cpp's order
            heads = HEADS if part == "attn_q" else KV_HEADS
            order = np.array(llama_cpp_permute(mx.arange(shape[0]), heads))  # GGUF row k = HF row order[k]
            hf_rows = np.empty_like(rows)
            hf_rows[order] = rows
            rows = hf_rows
        reference[hf_name(name, spec.arch)] = rows
    if spec.rope_freqs:
        factors = llama_cpp_rope_factors(
            factor=8.0, low=1.0, high=4.0, old=8192, head_dim=spec.head_dim, base=ROPE_BASE
        )
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference, kinds


def reference_folder(imported: Path, reference: Mapping[str, np.ndarray[Any, Any]], out: Path) -> Path:
    """The same model as plain float32 weights: the imported config without quantization."""
    out.mkdir()
    config = json.loads((imported / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(imported / name, out / name)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in reference.items()})
    return out


CASES = {
    "llama-untied-every-type": TinyModel(
        "llama",
        types={
            "attn_q": Q.Q4_0,
            "attn_k": Q.Q4_1,
            "attn_v": Q.Q8_0,
            "attn_output": Q.Q4_K,
            "ffn_gate": Q.Q5_K,
            "ffn_up": Q.Q6_K,
            "ffn_down": Q.F16,
            "token_embd": Q.Q8_0,
            "output": Q.BF16,
        },
    ),
    "llama-tied-kquant-qk-llama3-rope": TinyModel(
        "llama",
        types={"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "token_embd": Q.Q4_1},
        default=Q.Q4_0,
        tied=True,
        rope_freqs=True,
    ),
    "qwen2-tied-biases": TinyModel(
        "qwen2", types={"ffn_down": Q.Q5_K, "attn_q": Q.Q4_K, "attn_v": Q.Q5_0, "ffn_gate": Q.Q5_1}, tied=True
    ),
    "qwen3-untied-qk-norms": TinyModel(
        "qwen3", types={"attn_q": Q.Q4_1, "output": Q.Q6_K}, default=Q.F32, head_dim=128
    ),
    "llama-f32": TinyModel("llama", default=Q.F32),
    "qwen3moe-q8-q4-experts": TinyModel(
        "qwen3moe",
        types={"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0},
        default=Q.F32,
    ),
    "qwen3moe-mxfp4-experts": TinyModel(  # as llama-quantize's MXFP4_MOE writes them
        "qwen3moe", types={"ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4, "ffn_down_exps": Q.MXFP4}
    ),
    "qwen3moe-kquant-experts-quantized-router": TinyModel(
        "qwen3moe",
        types={
            "ffn_gate_exps": Q.Q4_K,
            "ffn_up_exps": Q.Q5_K,
            "ffn_down_exps": Q.Q6_K,
            "ffn_gate_inp": Q.Q8_0,
        },
        default=Q.Q4_1,
        tied=True,
    ),
    "gpt-oss-mxfp4-experts": TinyModel(
        "gpt-oss", types=dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.MXFP4)
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_imported_layers_and_logits_match_gguf_py(name: str, tmp_path: Path) -> None:
    from mlx_lm import load

    spec = CASES[name]
    reference, kinds = write_tiny_gguf(spec, tmp_path / "tiny.gguf")
    imported = import_gguf(tmp_path / "tiny.gguf", tmp_path / "imported")
    config = json.loads((imported / "config.json").read_text())
    model_type = MODEL_TYPES.get(spec.arch, spec.arch)
    assert (config["model_type"], config["tie_word_embeddings"]) == (model_type, spec.tied)
    assert config["head_dim"] == spec.head_dim
    if spec.rope_freqs:
        assert config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    quant = config.get("quantization")
    assert (quant is None) == all(t in (Q.F32, Q.F16, Q.BF16) for t in kinds.values())

    model = load(str(imported))[0]
    modules = dict(model.named_modules())
    for hf, qtype in kinds.items():
        path = hf.removesuffix(".weight")
        module = modules[path]
        expected = reference[hf]
        if qtype in (Q.F32, Q.F16, Q.BF16):
            assert type(module) in (nn.Linear, nn.Embedding, SwitchLinear), path
            dtype = {Q.F32: mx.float32, Q.F16: mx.float16, Q.BF16: mx.bfloat16}[qtype]
            assert module.weight.dtype == dtype, path  # 16-bit stays 16-bit
            assert np.array_equal(np.array(module.weight.astype(mx.float32)), expected), path
            continue
        assert isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear), path
        bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.MXFP4: 4}.get(qtype, 8)
        mode = "mxfp4" if qtype == Q.MXFP4 else "affine"
        assert (module.bits, module.group_size, module.mode) == (bits, 32, mode), path
        assert quant is not None and quant.get(path, quant)["bits"] == bits  # default or an override
        assert quant.get(path, quant)["mode"] == mode
        biases, scales = module.get("biases"), module.scales
        assert (biases is None) == (mode == "mxfp4"), path  # mxfp4: E8M0 scale bytes, no biases
        if biases is not None:
            biases, scales = biases.astype(mx.float32), scales.astype(mx.float32)
        got = np.array(
            mx.dequantize(
                module.weight, scales, biases, group_size=32, bits=bits, mode=mode, dtype=mx.float32
            )
        )
        if qtype in EXACT:
            assert np.array_equal(got, expected), path
        else:  # fp16 scales (Q4_K, Q5_K) or 8-bit requantization (Q6_K): see test_gguf_quants
            limit = {Q.Q4_K: 2e-3, Q.Q5_K: 2e-3, Q.Q6_K: 5e-3}[qtype] * float(np.abs(expected).max())
            assert float(np.abs(got - expected).max()) <= limit, path
    if spec.tied:
        assert "lm_head" not in modules

    plain = load(str(reference_folder(imported, reference, tmp_path / "reference")))[0]
    tokens = mx.array([[5, 80, 13, 200, 7, 258, 99, 1]])
    got_logits, want_logits = np.array(model(tokens)), np.array(plain(tokens))
    # Exact weights still differ by fp16 rounding: mlx's QuantizedEmbedding dequantizes in its
    # scales' dtype (measured ~1e-3 of the largest logit). Q6_K's requantization of random blocks
    # (sub-block scales far apart, unlike real ones) moves them by up to ~3% (measured 2.1%).
    worst = 6e-2 if Q.Q6_K in kinds.values() else 4e-3
    assert float(np.abs(got_logits - want_logits).max()) <= worst * float(np.abs(want_logits).max())


@pytest.mark.parametrize(("part", "qtype"), [("attn_v", Q.Q3_K), ("ffn_up", Q.Q2_K), ("output", Q.IQ4_NL)])
def test_an_unsupported_type_is_refused_naming_it(part: str, qtype: Q, tmp_path: Path) -> None:
    spec = TinyModel("llama", types={part: qtype}, default=Q.F32)
    write_tiny_gguf(spec, tmp_path / "bad.gguf")
    with pytest.raises(GGUFImportError, match=rf"{part}\.weight.*{qtype.name}"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", list(CASES))
def test_the_tiny_files_name_tensors_as_llama_cpp_does(name: str) -> None:
    """Every tensor is one gguf-py (llama.cpp's names) lists for the architecture, so that the
    import is tested on the names real files carry (gpt-oss's pre-MLP norm is `post_attention_norm`)."""
    spec = CASES[name]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == spec.arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for tensor in spec.shapes(vocab=8):
        parts = tensor.split(".")
        base = f"blk.{{bid}}.{parts[2]}" if parts[0] == "blk" else parts[0]
        assert base in known, tensor
