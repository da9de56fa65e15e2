"""model_shape: sizes from real and random model folders, quantized estimates, and refused folders."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from node.models.shape import UNSPLITTABLE, ModelShapeError, model_shape, read_safetensors_header
from protocol.ids import NodeId
from protocol.placement import place
from tests.family_models import Family, make_family_model
from tests.model_factory import make_random_model


def tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors files (file sizes less their headers)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        total += path.stat().st_size - 8 - length
    return total


def parts_sum(folder: Path, **kwargs: Any) -> int:
    shape = model_shape("m", folder, **kwargs)
    return sum(shape.layer_bytes) + shape.embedding_bytes + shape.head_bytes


def test_builtin_smollm2(builtin_model_dir: Path) -> None:
    shape = model_shape("smollm2-135m", builtin_model_dir)
    assert shape.num_layers == 30
    assert shape.tied_embeddings
    assert sum(shape.layer_bytes) + shape.embedding_bytes + shape.head_bytes == tensor_bytes(
        builtin_model_dir
    )
    # Q8_0 as stored: one byte a weight, a float16 scale and bias per group of 32
    assert shape.embedding_bytes == 49152 * 576 + 2 * 49152 * (576 // 32) * 2
    assert shape.head_bytes == 576 * 4  # the final norm only: lm_head is the embedding
    assert len(set(shape.layer_bytes)) == 1
    assert shape.kv_bytes_per_token == 2 * 3 * 64 * 4  # K and V, 3 kv heads of 64, float32
    assert shape.context_length == 8192
    assert model_shape("s", builtin_model_dir, context_length=512).context_length == 512


@pytest.fixture(scope="module")
def bf16_model(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(
        tmp_path_factory.mktemp("shape") / "bf16",
        tokenizer_from=builtin_model_dir,
        num_layers=3,
        dtype="bfloat16",
    )


def test_random_bf16_model(bf16_model: Path) -> None:
    shape = model_shape("tiny", bf16_model)
    assert shape.num_layers == 3
    assert not shape.tied_embeddings
    assert parts_sum(bf16_model) == tensor_bytes(bf16_model)
    assert shape.head_bytes == shape.embedding_bytes + 64 * 2  # lm_head (untied) + final norm
    assert shape.kv_bytes_per_token == 2 * 2 * 16 * 2  # 2 kv heads of 64 / 4, bfloat16 weights
    assert shape.context_length == 2048

    as_f32 = model_shape("tiny", bf16_model, runtime_dtype_bytes=4)
    assert as_f32.layer_bytes == tuple(2 * b for b in shape.layer_bytes)
    assert (as_f32.embedding_bytes, as_f32.head_bytes) == (2 * shape.embedding_bytes, 2 * shape.head_bytes)
    assert as_f32.kv_bytes_per_token == 2 * shape.kv_bytes_per_token


def test_a_real_shape_places(bf16_model: Path) -> None:
    shape = model_shape("tiny", bf16_model, context_length=64)
    total = shape.total_bytes
    nodes = [(NodeId("n1"), total * 6 // 10), (NodeId("n2"), total * 6 // 10)]
    result = place(shape, nodes)
    assert [(s.node, s.start_layer, s.end_layer) for s in result.stages] == [("n1", 0, 2), ("n2", 2, 3)]


def test_quantized_estimate_is_the_dense_size(bf16_model: Path, tmp_path: Path) -> None:
    """mx.quantize's real packing: the float32 estimate equals the unquantized model's float32 size."""
    weights = mx.load(str(bf16_model / "model.safetensors"))
    assert isinstance(weights, dict)
    config = json.loads((bf16_model / "config.json").read_text())
    eight_bit = "model.layers.0.mlp.down_proj"
    config["quantization"] = {"group_size": 64, "bits": 4, eight_bit: {"group_size": 64, "bits": 8}}
    quantized: dict[str, mx.array] = {}
    for name, value in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and value.ndim == 2:
            bits = 8 if module == eight_bit else 4
            packed, scales, biases = mx.quantize(value, group_size=64, bits=bits)
            quantized |= {name: packed, f"{module}.scales": scales, f"{module}.biases": biases}
        else:
            quantized[name] = value
    folder = tmp_path / "q"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), quantized)
    (folder / "config.json").write_text(json.dumps(config))

    assert parts_sum(folder) == tensor_bytes(folder) < tensor_bytes(bf16_model)
    dense = model_shape("q", bf16_model, runtime_dtype_bytes=4)
    quantized_shape = model_shape("q", folder, runtime_dtype_bytes=4)
    # Bytes alike; only the tensor split differs (groups of 64 no longer end between KV heads).
    assert quantized_shape.tensor_ranks == 0 < dense.tensor_ranks
    ranks = dense.tensor_ranks
    assert dataclasses.replace(quantized_shape, tensor_ranks=ranks, tensor_unsplittable="") == dense


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with these (dtype, shape) tensors, all zeros."""
    size = {"F32": 4, "BF16": 2, "U32": 4}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def fake_folder(tmp_path: Path, tensors: dict[str, tuple[str, list[int]]], **config: Any) -> Path:
    base = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(base | config))
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", dict(list(tensors.items())[:2]))
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", dict(list(tensors.items())[2:]))
    return tmp_path


GOOD = {
    "model.embed_tokens.weight": ("BF16", [10, 8]),
    "model.layers.0.mlp.weight": ("BF16", [8, 8]),
    "model.layers.1.mlp.weight": ("BF16", [8, 8]),
    "model.norm.weight": ("BF16", [8]),
}


def test_sharded_files_and_config_defaults(tmp_path: Path) -> None:
    shape = model_shape("fake", fake_folder(tmp_path, GOOD))
    assert shape.layer_bytes == (128, 128)
    assert (shape.embedding_bytes, shape.head_bytes) == (160, 16)
    assert shape.tied_embeddings  # no lm_head and no tie_word_embeddings: tied
    assert shape.kv_bytes_per_token == 2 * 2 * 4 * 2  # kv heads default to heads, head dim 8 / 2
    assert shape.context_length == 4096


def test_vision_language_prefix_and_text_config(tmp_path: Path) -> None:
    tensors = {f"language_model.{k}": v for k, v in GOOD.items()}
    folder = fake_folder(tmp_path, tensors, num_hidden_layers=None, text_config={"num_hidden_layers": 2})
    assert model_shape("vl", folder).layer_bytes == (128, 128)


@pytest.mark.parametrize(
    ("tensors", "embedding", "head", "tied"),
    [
        (
            {"model.tok_embeddings.weight": [10, 8], "output.weight": [10, 8], "model.norm.weight": [8]},
            160,
            176,
            False,
        ),
        ({"model.embed_tokens.weight": [10, 8], "model.embedding_norm.weight": [8]}, 160, 16, True),  # lfm2
        ({"model.word_embeddings.weight": [10, 8], "model.final_layernorm.weight": [8]}, 160, 16, True),
        (
            {"backbone.embeddings.weight": [10, 8], "backbone.norm_f.weight": [8], "lm_head.weight": [10, 8]},
            160,
            176,
            False,
        ),
    ],
)
def test_other_families_names(
    tmp_path: Path, tensors: dict[str, list[int]], embedding: int, head: int, tied: bool
) -> None:
    """internlm2, lfm2, falcon_h1/jamba/bailing, mamba: where their embedding and final norm go."""
    prefix = "backbone" if "backbone.embeddings.weight" in tensors else "model"
    layers = {f"{prefix}.layers.{i}.mixer.weight": [8, 8] for i in range(2)}
    folder = fake_folder(tmp_path, {k: ("BF16", v) for k, v in (layers | tensors).items()})
    shape = model_shape("m", folder)
    assert (shape.layer_bytes, shape.embedding_bytes, shape.head_bytes) == ((128, 128), embedding, head)
    assert shape.tied_embeddings == tied


def test_a_model_without_attention_keeps_no_kv_cache(tmp_path: Path) -> None:
    layers = {f"backbone.layers.{i}.mixer.A_log": ("F32", [4]) for i in range(2)}
    tensors = {
        "backbone.embeddings.weight": ("F32", [10, 8]),
        **layers,
        "backbone.norm_f.weight": ("F32", [8]),
    }
    assert (
        model_shape("mamba", fake_folder(tmp_path, tensors, num_attention_heads=None)).kv_bytes_per_token == 0
    )


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (GOOD | {"vision_tower.weight": ("F32", [4])}, {}, "'vision_tower.weight' is not in a layer"),
        ({k: v for k, v in GOOD.items() if "layers.1" not in k}, {}, r"no tensors for layer\(s\) \[1\]"),
        (GOOD, {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        (
            GOOD | {"model.layers.1.mlp.scales": ("BF16", [8, 1])},
            {},
            "quantized but config.json gives no quantization bits",
        ),
    ],
)
def test_refused_folders(
    tmp_path: Path, tensors: dict[str, Any], config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelShapeError, match=message):
        model_shape("bad", fake_folder(tmp_path, tensors, **config), runtime_dtype_bytes=4)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 2**40), "exceeds"),
        (struct.pack("<Q", 5) + b"{nope", "malformed safetensors header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 19) + b'{"t": {"dtype": 1}}', "malformed entry for tensor 't'"),
    ],
)
def test_bad_headers(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelShapeError, match=message):
        read_safetensors_header(path)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ModelShapeError, match=r"cannot read config\.json"):
        model_shape("none", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(ModelShapeError, match=r"no \*\.safetensors files"):
        model_shape("none", tmp_path)


def test_kernels_count_quantized_and_16_bit_weights_as_stored(bf16_model: Path, tmp_path: Path) -> None:
    """With the CPU kernels a 4-bit model is placed at its stored size, not its float32 one."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model

    loaded: Any = load(str(bf16_model), return_config=True)
    model, _, config = loaded
    model, config = quantize_model(model, config, group_size=64, bits=4)
    folder = tmp_path / "q4"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))

    kept = model_shape("q", folder, runtime_dtype_bytes=4, kernels=True)
    dense = model_shape("q", folder, runtime_dtype_bytes=4)
    stored = model_shape("q", folder)
    assert kept.weight_bytes < 0.2 * dense.weight_bytes  # 4-bit + scales vs float32
    # as stored, but for the 1-D norms that become float32 (2 -> 4 bytes)
    assert stored.weight_bytes <= kept.weight_bytes < 1.05 * stored.weight_bytes
    assert 2 * kept.kv_bytes_per_token == dense.kv_bytes_per_token  # the kernels' caches are float16
    bf16_kept = model_shape("b", bf16_model, runtime_dtype_bytes=4, kernels=True)
    assert bf16_kept.weight_bytes < 0.55 * model_shape("b", bf16_model, runtime_dtype_bytes=4).weight_bytes


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_experts_and_sinks_count_in_their_layers(
    family: Family, builtin_model_dir: Path, tmp_path: Path
) -> None:
    """Every stored byte is counted, each expert tensor (`mlp.experts`, `mlp.switch_mlp`) and
    attention sink in its own layer, so placement sizes MoE stages by what they hold."""
    folder = make_family_model(tmp_path / family, family, tokenizer_from=builtin_model_dir, num_layers=2)
    shape = model_shape("m", folder)
    assert shape.weight_bytes == tensor_bytes(folder)
    assert not shape.unsplittable
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    layer0 = sum(v.nbytes for k, v in weights.items() if k.startswith("model.layers.0."))
    experts = sum(
        v.nbytes
        for k, v in weights.items()
        if k.startswith(("model.layers.0.mlp.experts.", "model.layers.0.mlp.switch_mlp."))
    )
    assert shape.layer_bytes[0] == layer0 and experts > layer0 / 2
    # A token reads its routed experts only ("auto" sharding weighs that, not the stored size).
    config = json.loads((folder / "config.json").read_text())
    share = config["num_experts_per_tok"] / (config.get("num_experts") or config["num_local_experts"])
    every = sum(v.nbytes for k, v in weights.items() if ".mlp.experts." in k or ".mlp.switch_mlp." in k)
    head = shape.embedding_bytes if shape.tied_embeddings else shape.head_bytes
    read = shape.weight_bytes - shape.embedding_bytes - shape.head_bytes - every * (1 - share) + head
    assert shape.token_bytes == pytest.approx(read, rel=1e-3) and shape.token_bytes < 0.8 * shape.weight_bytes
    assert model_shape("m", fake_folder(tmp_path, GOOD)).token_bytes == 0  # dense: every weight


def test_an_unsplittable_family_says_why(tmp_path: Path) -> None:
    shape = model_shape("m", fake_folder(tmp_path, GOOD, model_type="gemma3n"))
    assert shape.unsplittable == UNSPLITTABLE["gemma3n"] != ""
    assert model_shape("m", fake_folder(tmp_path, GOOD, model_type="gpt_oss")).unsplittable == ""


def test_mxfp4_experts_count_as_stored_with_the_kernels_and_at_float32_without(
    builtin_model_dir: Path, tmp_path: Path
) -> None:
    """Affine 4-bit and MXFP4 experts both stay as stored on the kernels, so placement counts their
    stored bytes; without the kernels they are dequantized at load and count at float32."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model

    source = make_family_model(tmp_path / "src", "qwen3_moe", tokenizer_from=builtin_model_dir, num_layers=2)
    shapes, plain, experts = {}, {}, {}
    for mode in ("affine", "mxfp4"):
        loaded: Any = load(str(source), return_config=True)
        model, _, config = loaded

        def predicate(path: str, _module: Any, mode: str = mode) -> bool | dict[str, Any]:
            return {"group_size": 32, "bits": 4, "mode": mode} if "switch_mlp" in path else True

        model, config = quantize_model(model, config, 32, 4, quant_predicate=predicate)
        folder = tmp_path / mode
        folder.mkdir()
        mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (folder / "config.json").write_text(json.dumps(config))
        shapes[mode] = model_shape("m", folder, runtime_dtype_bytes=4, kernels=True)
        plain[mode] = model_shape("m", folder, runtime_dtype_bytes=4, kernels=False)
        stored = mx.load(str(folder / "model.safetensors"))
        assert isinstance(stored, dict)
        experts[mode] = {k: v for k, v in stored.items() if k.startswith("model.layers.0.mlp.switch_mlp.")}
    as_stored = {mode: sum(v.nbytes for v in e.values()) for mode, e in experts.items()}
    assert as_stored["mxfp4"] < as_stored["affine"]  # one scale byte per 32, no biases
    # Layer 0 differs by exactly its experts' stored sizes (the rest is the same affine 4-bit).
    assert (
        shapes["mxfp4"].layer_bytes[0] - shapes["affine"].layer_bytes[0]
        == as_stored["mxfp4"] - as_stored["affine"]
    )
    # Without the kernels both are float32: the same bytes.
    assert plain["mxfp4"].layer_bytes[0] == plain["affine"].layer_bytes[0]
