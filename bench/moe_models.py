"""Random mixture-of-experts models for `bench/vs_llamacpp.py`: qwen3moe and gpt-oss, as GGUF and MLX.

Shapes (full; `--small` halves them for developing the benchmark; expert widths stay multiples
of 256, or llama-quantize's Q4_K_M falls back to Q5_0, which Shoal holds at 8 bits, not 5.5):
- qwen3moe, Qwen3-30B-A3B scaled down: 8 layers, hidden 2048, 32 query / 4 KV heads of 128, 64
  experts of width 768, top-8, SmolLM2's 49k tokenizer, untied head (2.77B parameters, 0.56B of
  them read per token).
- gpt-oss, gpt-oss-20b scaled down: 8 layers, hidden 2048, 32 query / 8 KV heads of 64 (real: 64 /
  8 of 64 over hidden 2880), 32 experts of width 2048 (real: 32 of 2880, expert width = hidden),
  top-4, biases everywhere, attention sinks, alternating 128-token windows, yarn rope, and a vocab
  of 201088 rows (o200k's), because Shoal renders gpt_oss chats with openai-harmony, whose ids
  reach ~200k. Its tokenizer is SmolLM2's (`pre = smollm`, as the other random GGUFs; Shoal does
  not rebuild o200k's `gpt-4o` pre-tokenizer yet) padded with `<|pad_N|>` tokens to 201088 ids.
  4.1B parameters, 0.9B read per token (the head alone 0.41B).

GGUFs are written F16 (norms, biases, sinks and routers F32, as llama.cpp's converter writes them)
with random normal * 0.02 weights and quantized by llama-quantize: qwen3moe to Q4_0 and Q4_K_M,
gpt-oss to MXFP4_MOE (experts MXFP4, every other matrix Q8_0). MLX folders come from mlx-lm's own
model classes (its random initialization) and `quantize_model`: qwen3_moe 4-bit group 64 (its
router 8-bit, as mlx-lm's predicate says), gpt_oss with MXFP4 experts and the rest 8-bit group 64
(like mlx-community's gpt-oss-*-MXFP4-Q8); float32 scales and unquantized parts, as the dense
mlx4 row (mlx-lm's fastest CPU case). Everything is cached in `$SHOAL_BENCH_CACHE`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from bench.llamacpp import (
    LlamaCpp,
    TensorSpec,
    bench_cache,
    quantize_gguf,
    tokenizer_fields,
    write_random_tensors,
)
from bench.side_by_side import Measured, Timing

Family = Literal["qwen3moe", "gpt-oss"]
O200K_ROWS = 201088
"""gpt-oss's vocab rows (o200k_harmony's ids, reserved ones included)."""


@dataclass(frozen=True)
class MoeShape:
    family: Family
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int | None = None
    """Rows of the embedding and head; None: the tokenizer's."""

    @property
    def tag(self) -> str:
        name = "gptoss" if self.family == "gpt-oss" else self.family
        return f"{name}-{self.layers}x{self.hidden}-{self.experts}e{self.top_k}"

    def params(self, vocab: int) -> tuple[int, int]:
        """(all parameters, those a decode step reads: all but the embedding and unchosen experts)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 2 * self.hidden * q + 2 * self.hidden * kv
        expert = 3 * self.hidden * self.expert_ffn
        total = 2 * vocab * self.hidden + self.layers * (attn + self.experts * (expert + self.hidden))
        active = vocab * self.hidden + self.layers * (attn + self.top_k * expert + self.experts * self.hidden)
        return total, active


QWEN3MOE = MoeShape("qwen3moe", 8, 2048, 32, 4, 128, experts=64, top_k=8, expert_ffn=768)
GPT_OSS = MoeShape("gpt-oss", 8, 2048, 32, 8, 64, experts=32, top_k=4, expert_ffn=2048, vocab=O200K_ROWS)
SMALL = {
    "qwen3moe": replace(QWEN3MOE, layers=4, hidden=1024, heads=16, experts=32, expert_ffn=512),
    "gpt-oss": replace(GPT_OSS, layers=4, hidden=1024, heads=16, kv_heads=4, experts=16, expert_ffn=1024),
}
GGUF_ROWS: dict[str, tuple[Family, str]] = {
    "qwen3moe_q4_0": ("qwen3moe", "Q4_0"),
    "qwen3moe_q4_k_m": ("qwen3moe", "Q4_K_M"),
    "gptoss_mxfp4": ("gpt-oss", "MXFP4_MOE"),
}
"""Row name -> (family, llama-quantize type)."""
MLX_ROWS: dict[str, Family] = {"qwen3moe_mlx4": "qwen3moe", "gptoss_mlx_mxfp4_q8": "gpt-oss"}
ROWS = [*GGUF_ROWS, *MLX_ROWS]


def shape_of(family: Family, small: bool) -> MoeShape:
    return SMALL[family] if small else {"qwen3moe": QWEN3MOE, "gpt-oss": GPT_OSS}[family]


def timing(row: str) -> Timing:
    """How Shoal's side of a row is timed: by whole requests where Shoal renders the chats with
    openai-harmony (gpt_oss: random output reaches the client in few chunks), else by chunks."""
    family = GGUF_ROWS[row][0] if row in GGUF_ROWS else MLX_ROWS.get(row)
    return "requests" if family == "gpt-oss" else "chunks"


# ---- tokenizer -------------------------------------------------------------------------------------


def padded_tokenizer(fields: list[tuple[str, Any, Any, Any]], rows: int) -> list[tuple[str, Any, Any, Any]]:
    """GGUF tokenizer fields with `<|pad_N|>` tokens (type normal) appended up to `rows` ids."""
    out = []
    tokens = next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")
    extra = range(len(tokens), max(rows, len(tokens)))
    for key, value, vtype, sub in fields:
        if key == "tokenizer.ggml.tokens":
            value = [*value, *(f"<|pad_{i}|>" for i in extra)]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *(1 for _ in extra)]
        out.append((key, value, vtype, sub))
    return out


def pad_tokenizer_json(folder: Path, rows: int) -> None:
    """The same padding in an MLX folder's `tokenizer.json` (ids the model can emit decode to text)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    used = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    vocab |= {f"<|pad_{i}|>": i for i in range(used, rows)}
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# ---- GGUF ------------------------------------------------------------------------------------------


def gguf_meta(shape: MoeShape, vocab: int) -> dict[str, int | float | str]:
    """The architecture's metadata, as llama.cpp's converter writes it for the real models."""
    meta: dict[str, int | float | str] = {
        "general.name": f"random {shape.family} {shape.tag}",
        "general.file_type": 1,  # MOSTLY_F16
        "block_count": shape.layers,
        "embedding_length": shape.hidden,
        "feed_forward_length": shape.expert_ffn,
        "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads,
        "attention.key_length": shape.head_dim,
        "attention.value_length": shape.head_dim,
        "rope.dimension_count": shape.head_dim,
        "expert_count": shape.experts,
        "expert_used_count": shape.top_k,
        "expert_feed_forward_length": shape.expert_ffn,
        "vocab_size": vocab,
    }
    if shape.family == "qwen3moe":
        return meta | {
            "feed_forward_length": 3 * shape.hidden,  # unused: every layer is experts
            "context_length": 32768,
            "rope.freq_base": 1e6,
            "attention.layer_norm_rms_epsilon": 1e-6,
        }
    return meta | {
        "context_length": 131072,
        "rope.freq_base": 150000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.sliding_window": 128,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
    }


def gguf_tensors(shape: MoeShape, vocab: int) -> list[TensorSpec]:
    """Every tensor of the family's GGUF, in file order."""
    h, f, e = shape.hidden, shape.expert_ffn, shape.experts
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    oss = shape.family == "gpt-oss"
    out: list[TensorSpec] = [("token_embd.weight", (vocab, h), "normal")]
    for i in range(shape.layers):
        layer: list[TensorSpec] = [
            ("attn_norm.weight", (h,), "ones"),
            ("attn_q.weight", (q, h), "normal"),
            ("attn_k.weight", (kv, h), "normal"),
            ("attn_v.weight", (kv, h), "normal"),
            ("attn_output.weight", (h, q), "normal"),
            ("post_attention_norm.weight" if oss else "ffn_norm.weight", (h,), "ones"),
            ("ffn_gate_inp.weight", (e, h), "normal32"),
            ("ffn_gate_exps.weight", (e, f, h), "normal"),
            ("ffn_up_exps.weight", (e, f, h), "normal"),
            ("ffn_down_exps.weight", (e, h, f), "normal"),
        ]
        if oss:  # a bias for every matrix (experts: one per expert), and the sinks
            layer += [(n.replace(".weight", ".bias"), d[:-1], "zeros") for n, d, _ in layer if len(d) > 1]
            layer.append(("attn_sinks.weight", (shape.heads,), "zeros"))
        else:
            layer += [("attn_q_norm.weight", (shape.head_dim,), "ones")]
            layer += [("attn_k_norm.weight", (shape.head_dim,), "ones")]
        out += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in layer]
    return [*out, ("output_norm.weight", (h,), "ones"), ("output.weight", (vocab, h), "normal")]


def prepare_moe_ggufs(names: list[str], small: bool, llama: LlamaCpp | None, threads: int) -> dict[str, Path]:
    """The GGUF of each MoE row in `names`, made and cached when missing (F16 first, then
    llama-quantize); rows it cannot make (no llama-quantize) are left out."""
    from node.models.builtin import builtin_gguf_path

    out: dict[str, Path] = {}
    for name in (n for n in names if n in GGUF_ROWS):
        family, qtype = GGUF_ROWS[name]
        shape = shape_of(family, small)
        path = bench_cache() / f"{shape.tag}-{qtype.lower()}.gguf"
        if not path.is_file():
            if llama is None:
                print(f"  {path.name}: no llama-quantize to make it; skipped", flush=True)
                continue
            f16 = bench_cache() / f"{shape.tag}-f16.gguf"
            if not f16.is_file():
                fields = tokenizer_fields(builtin_gguf_path())
                if shape.vocab:
                    fields = padded_tokenizer(fields, shape.vocab)
                vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
                total, active = shape.params(vocab)
                print(f"  writing {f16} ({total / 1e9:.2f}B random parameters, {active / 1e9:.2f}B active)")
                write_random_tensors(f16, family, gguf_meta(shape, vocab), gguf_tensors(shape, vocab), fields)
            print(f"  llama-quantize {f16.name} -> {path.name} ({qtype})", flush=True)
            quantize_gguf(llama, f16, path, qtype, threads)
        out[name] = path
    return out


# ---- MLX -------------------------------------------------------------------------------------------


def mlx_config(shape: MoeShape, vocab: int, special: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's config.json for the shape (the same model the GGUF describes)."""
    common = {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_experts_per_tok": shape.top_k,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        **special,
    }
    if shape.family == "qwen3moe":
        return common | {
            "model_type": "qwen3_moe",
            "intermediate_size": 3 * shape.hidden,
            "num_experts": shape.experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": shape.expert_ffn,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "max_position_embeddings": 32768,
            "norm_topk_prob": True,
        }
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    return common | {
        "model_type": "gpt_oss",
        "intermediate_size": shape.expert_ffn,
        "num_local_experts": shape.experts,
        "sliding_window": 128,
        "rope_theta": 150000,
        "rope_scaling": yarn | {"beta_fast": 32.0, "beta_slow": 1.0},
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention", "full_attention"] * (shape.layers // 2),
    }


def _mxfp4_experts(path: str, _module: object) -> dict[str, Any] | bool:
    """mlx-community's gpt-oss MXFP4-Q8 split: experts MXFP4, everything else the default 8-bit."""
    return {"group_size": 32, "bits": 4, "mode": "mxfp4"} if ".experts." in path else True


def _requantize_per_expert(proj: Any) -> None:
    """Fresh random MXFP4 weights for a `QuantizedSwitchLinear`, quantized one expert at a time:
    MLX's CPU `mx.quantize(mode="mxfp4")` holds ~17x its float input while it runs (a 64 MB
    tensor peaked at 1.1 GB), so quantizing a layer's experts at once would need tens of GB."""
    import mlx.core as mx

    experts, rows = proj.weight.shape[:2]
    columns, bound = proj.input_dims, proj.input_dims**-0.5
    weights, scales = [], []
    for _ in range(experts):
        dense = mx.random.uniform(-bound, bound, (rows, columns))
        weight, scale, *_ = mx.quantize(dense, proj.group_size, proj.bits, mode=proj.mode)
        mx.eval(weight, scale)
        weights.append(weight)
        scales.append(scale)
    proj.weight, proj.scales = mx.stack(weights), mx.stack(scales)
    mx.eval(proj.weight, proj.scales)


def prepare_moe_mlx(name: str, small: bool) -> Path:
    """The MLX folder of an MoE row, made and cached when missing (one layer evaluated at a time,
    so that at most one layer, or one expert, is ever in float32)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from bench.common import builtin_model
    from tests.model_factory import _special_ids, tokenizer_vocab_size, write_model_folder

    shape = shape_of(MLX_ROWS[name], small)
    out = bench_cache() / f"{shape.tag}-{'mlx-mxfp4-q8' if shape.family == 'gpt-oss' else 'mlx4'}"
    if (out / "config.json").is_file():
        return out
    tokenizer = builtin_model()
    config = mlx_config(shape, shape.vocab or tokenizer_vocab_size(tokenizer), _special_ids(tokenizer))
    total, active = shape.params(config["vocab_size"])
    print(f"  writing {out} ({total / 1e9:.2f}B random parameters, {active / 1e9:.2f}B active)", flush=True)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(0)
    if shape.family == "gpt-oss":
        model, config = quantize_model(model, config, 64, 8, quant_predicate=_mxfp4_experts)
    else:
        model, config = quantize_model(model, config, 64, 4)
    for layer in model.model.layers:
        if shape.family == "gpt-oss":
            for proj in (layer.mlp.experts.gate_proj, layer.mlp.experts.up_proj, layer.mlp.experts.down_proj):
                _requantize_per_expert(proj)
        mx.eval(layer.parameters())
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_model_folder(partial, weights, config, tokenizer_from=tokenizer)
    if shape.vocab:
        pad_tokenizer_json(partial, shape.vocab)
    partial.rename(out)
    return out


def mlx_bytes_per_token(folder: Path) -> int:
    """Stored bytes a decode step reads: every tensor but the (untied) embedding table's, and of
    the expert layers (`switch_mlp`, `experts`) the chosen experts' share (top-k of all)."""
    from node.models.shape import read_safetensors_header

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    share = int(config.get("num_experts_per_tok") or 0) / experts if experts else 1.0
    sizes: dict[str, int] = {}
    for path in folder.glob("*.safetensors"):
        for name, info in read_safetensors_header(path).items():
            if isinstance(info, dict) and "data_offsets" in info:
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    routed = (".switch_mlp.", ".experts.")
    read = sum(size * share if any(r in name for r in routed) else size for name, size in sizes.items())
    if any(n.startswith("lm_head.") for n in sizes):
        read -= sum(v for n, v in sizes.items() if "embed_tokens." in n)
    return int(read)


# ---- targets ---------------------------------------------------------------------------------------

TARGETS = {"llama.cpp": {"decode": 1.0, "prefill": 1.0, "memory": 1.2}, "mlx-lm": {"decode": 10.0}}
"""Issue 33's targets: Shoal / baseline ratios (memory: at most), per baseline."""
LIMIT_SHARE = 0.70
"""Decode at least this share of the bandwidth limit at the active bytes."""


def targets(baseline: str, base: Measured, shoal: Measured, limit: float) -> str:
    """One line: each target of the row with its figure, met or missed."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    ratios = {
        "decode": shoal.decode_tps / base.decode_tps if base.decode_tps else float("nan"),
        "prefill": shoal.prefill_tps / base.prefill_tps if base.prefill_tps else float("nan"),
        "memory": shoal.peak_rss / base.peak_rss if base.peak_rss else float("nan"),
    }
    parts = []
    for metric, want in TARGETS.get(baseline, {}).items():
        got = ratios[metric]
        ok = got <= want if metric == "memory" else got >= want
        parts.append(f"{metric} {got:.2f}x {'<=' if metric == 'memory' else '>='} {want}: {verdict(ok)}")
    share = shoal.decode_tps / limit
    parts.append(f"decode {share:.0%} of limit >= {LIMIT_SHARE:.0%}: {verdict(share >= LIMIT_SHARE)}")
    return "targets: " + "; ".join(parts)
