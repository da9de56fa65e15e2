"""llama.cpp for the benchmarks: find (or build) its binaries, write random llama GGUFs, run llama-bench.

The binaries come from `$LLAMACPP_DIR` (a folder holding `llama-bench` and `llama-quantize`, or
their `bin/` or `build/bin/` parent) or from the cache `$SHOAL_LLAMACPP_CACHE` (default
`~/.cache/shoal-llamacpp`), where they are built once, as `/work/shared/notes/platform.md` says:
the sdist of `llama-cpp-python==0.3.36` (pip download, no binaries) has `vendor/llama.cpp`, which
builds with plain CMake. The build logs to `<cache>/cmake.log` and ends it with a line `done <rc>`;
while another process's build is still writing that log, we wait for it instead of starting a second.

A random GGUF is llama-shaped, F16 (norms F32), weights normal * 0.02 and norms 1, with untied
`token_embd` and `output`, and the tokenizer (`tokenizer.*` metadata) of another GGUF, so that
Shoal's importer can read it. The weights are i.i.d., so they are as good in GGUF's q/k row order
(llama.cpp's interleaved rotary halves) as in any other.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-quantize")
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
if platform.machine() in ("x86_64", "AMD64"):
    # Hosts (VMs) may list AMX in cpuinfo without granting its register state: a native build then
    # dies of SIGILL in its first AMX matmul (seen 2026-12-02). AVX-512/VNNI stay on where present.
    _NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_FLAGS += (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}")
BUILD = "build-noamx"
"""The build folder; renamed when the flags change, so that an older cached build is not reused."""
WEIGHT_SCALE = 0.02
GGUF_QUANTS = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
"""The random model's quantizations: model name -> llama-quantize type."""
_DONE = re.compile(r"^done (-?\d+)\s*$", re.MULTILINE)


def bench_cache() -> Path:
    return Path(os.environ.get("SHOAL_BENCH_CACHE", Path.home() / ".cache" / "shoal-bench"))


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_LLAMACPP_CACHE", Path.home() / ".cache" / "shoal-llamacpp"))


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path

    @property
    def bench(self) -> Path:
        return self.bin_dir / "llama-bench"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"


def _bin_dir_in(folder: Path) -> Path | None:
    for candidate in (folder, folder / "bin", folder / "build" / "bin", folder / BUILD / "bin"):
        if all((candidate / name).is_file() for name in TARGETS):
            return candidate
    return None


def source_dir(cache: Path) -> Path:
    return cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def find_llamacpp() -> LlamaCpp | None:
    """The binaries from `$LLAMACPP_DIR`, else from the cache's build; None when neither has them."""
    if env := os.environ.get("LLAMACPP_DIR"):
        if found := _bin_dir_in(Path(env).expanduser()):
            return LlamaCpp(found)
        print(f"$LLAMACPP_DIR={env} has no {' and '.join(TARGETS)}; trying the cache", flush=True)
    found = _bin_dir_in(source_dir(cache_dir()) / BUILD)
    return LlamaCpp(found) if found else None


def _build_in_progress(log: Path, quiet_s: float = 600) -> bool:
    """Whether the log is of a build that has not ended (no `done` line) and wrote lately."""
    try:
        text = log.read_text(errors="replace")
        age = time.time() - log.stat().st_mtime
    except OSError:
        return False
    return not _DONE.search(text) and age < quiet_s


def _wait_for_build(log: Path) -> None:
    print(f"a llama.cpp build is already running (log {log}); waiting for its 'done' line", flush=True)
    while _build_in_progress(log):
        time.sleep(10)
    if match := _DONE.search(log.read_text(errors="replace")):
        print(f"that build ended with rc {match.group(1)}", flush=True)


def _run_logged(cmd: list[str], log: Path, cwd: Path | None = None) -> int:
    print("  $", " ".join(cmd), flush=True)
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        return subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def build_llamacpp(jobs: int) -> LlamaCpp:
    """Download the sdist and build llama-bench and llama-quantize in the cache (~10 min on 2 cores)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "cmake.log"
    src = source_dir(cache)
    print(
        f"building llama.cpp {VERSION} (llama-cpp-python's vendored copy) in {cache}; log {log}", flush=True
    )
    log.write_text("")
    rc = 0
    if not (src / "CMakeLists.txt").is_file():
        sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            rc = _run_logged([*pip, "-d", str(cache), f"llama-cpp-python=={VERSION}"], log)
        if rc == 0:
            print(f"  extracting {sdist}", flush=True)
            with tarfile.open(sdist) as tar:
                tar.extractall(cache, filter="data")
    if rc == 0:
        rc = _run_logged(["cmake", "-B", BUILD, *CMAKE_FLAGS], log, cwd=src)
    if rc == 0:
        build = ["cmake", "--build", BUILD, f"-j{jobs}", "--target", *TARGETS]
        rc = _run_logged(build, log, cwd=src)
    with log.open("a") as out:
        out.write(f"done {rc}\n")
    found = find_llamacpp()
    if rc != 0 or found is None:
        raise RuntimeError(f"the llama.cpp build failed (rc {rc}); see {log}")
    return found


def ensure_llamacpp(jobs: int = 2) -> LlamaCpp:
    """The llama.cpp binaries: found, or after waiting for a running build, or built now."""
    log = cache_dir() / "cmake.log"
    if _build_in_progress(log):
        _wait_for_build(log)
    if found := find_llamacpp():
        print(f"llama.cpp binaries: {found.bin_dir}", flush=True)
        return found
    return build_llamacpp(jobs)


# ---- GGUF models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    context: int = 4096

    def params(self, vocab: int) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return 2 * vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.intermediate)


LLAMA_1B = LlamaShape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8)
"""Llama-3.2-1B's shape (with a 49k vocab instead of 128k: ~1.17B parameters)."""
LLAMA_SMALL = LlamaShape(layers=10, hidden=1024, intermediate=4096, heads=16, kv_heads=4)
"""~250M parameters with the 49k vocab: for developing the benchmark."""


def tokenizer_fields(gguf_path: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of every `tokenizer.*` metadata field of a GGUF."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    out: list[tuple[str, Any, Any, Any]] = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def _tensors(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes (rows = outputs) of a llama model, in file order."""
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    h, f = shape.hidden, shape.intermediate
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (h,)),
            (p + "attn_q.weight", (h, h)),
            (p + "attn_k.weight", (kv, h)),
            (p + "attn_v.weight", (kv, h)),
            (p + "attn_output.weight", (h, h)),
            (p + "ffn_norm.weight", (h,)),
            (p + "ffn_gate.weight", (f, h)),
            (p + "ffn_up.weight", (f, h)),
            (p + "ffn_down.weight", (h, f)),
        ]
    return [*out, ("output_norm.weight", (h,)), ("output.weight", (vocab, h))]


TensorSpec = tuple[str, tuple[int, ...], str]
"""A GGUF tensor to write: name, numpy shape (rows = outputs), and its content: `normal` (F16,
normal * WEIGHT_SCALE), `normal32` (the same in F32: routers, which llama-quantize keeps as they
are and converters write in F32), `ones` or `zeros` (F32: norms, biases, attention sinks)."""


def write_random_tensors(
    out: Path,
    arch: str,
    meta: dict[str, int | float | str],
    tensors: list[TensorSpec],
    tokenizer: list[tuple[str, Any, Any, Any]],
    seed: int = 0,
) -> Path:
    """A GGUF of `arch` with `meta` (`{arch}.` prefixed to every key but `general.*`; int -> uint32,
    float -> float32), `tokenizer` fields and random `tensors`, streamed one tensor at a time."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for key, value in meta.items():
        key = key if key.startswith("general.") else f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for key, value, vtype, sub in tokenizer:
        writer.add_key_value(key, value, vtype, sub)
    for name, dims, kind in tensors:
        dtype = np.dtype(np.float16 if kind == "normal" else np.float32)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, kind in tensors:
        if kind in ("ones", "zeros"):
            writer.write_tensor_data((np.ones if kind == "ones" else np.zeros)(dims, np.float32))
        else:
            weight = rng.standard_normal(dims, dtype=np.float32) * WEIGHT_SCALE
            writer.write_tensor_data(weight.astype(np.float16) if kind == "normal" else weight)
    writer.close()
    partial.rename(out)
    return out


def write_random_gguf(out: Path, shape: LlamaShape, tokenizer_from: Path, seed: int = 0) -> Path:
    """An F16 llama GGUF of `shape` with random weights and `tokenizer_from`'s tokenizer (streamed)."""
    import gguf

    fields = tokenizer_fields(tokenizer_from)
    vocab = len(next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"))
    meta: dict[str, int | float | str] = {
        "general.name": f"random llama {shape.layers}x{shape.hidden}",
        "block_count": shape.layers,
        "context_length": shape.context,
        "embedding_length": shape.hidden,
        "feed_forward_length": shape.intermediate,
        "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads,
        "rope.dimension_count": shape.hidden // shape.heads,
        "rope.freq_base": 500000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": vocab,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
    }
    tensors = [(name, dims, "ones" if len(dims) == 1 else "normal") for name, dims in _tensors(shape, vocab)]
    return write_random_tensors(out, "llama", meta, tensors, fields, seed)


def quantize_gguf(llama: LlamaCpp, src: Path, dst: Path, qtype: str, threads: int) -> Path:
    """`llama-quantize src dst qtype` (written beside `dst`, renamed into place when it succeeds)."""
    partial = dst.with_name(dst.name + ".partial")
    cmd = [str(llama.quantize), str(src), str(partial), qtype, str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    partial.rename(dst)
    return dst


def prepare_ggufs(names: list[str], small: bool, llama: LlamaCpp | None, threads: int) -> dict[str, Path]:
    """The GGUF of each name (smollm2 = the built-in, or a quantization of the random model),
    made and cached when missing; names it cannot make are left out."""
    from node.models.builtin import builtin_gguf_path

    out: dict[str, Path] = {}
    if "smollm2" in names:
        out["smollm2"] = builtin_gguf_path()
    quants = [n for n in names if n in GGUF_QUANTS]
    if not quants:
        return out
    shape, tag = (LLAMA_SMALL, "llama-250m") if small else (LLAMA_1B, "llama-1b")
    f16 = bench_cache() / f"{tag}-f16.gguf"
    for name in quants:
        path = bench_cache() / f"{tag}-{name}.gguf"
        if not path.is_file():
            if llama is None:
                print(f"  {path.name}: no llama-quantize to make it; skipped", flush=True)
                continue
            if not f16.is_file():
                print(
                    f"  writing {f16} ({shape.params(49152) / 1e9:.2f}B random parameters, F16)", flush=True
                )
                write_random_gguf(f16, shape, builtin_gguf_path())
            print(f"  llama-quantize {f16.name} -> {path.name} ({GGUF_QUANTS[name]})", flush=True)
            quantize_gguf(llama, f16, path, GGUF_QUANTS[name], threads)
        out[name] = path
    return out


def gguf_bytes_per_token(path: Path) -> tuple[int, int, dict[str, int]]:
    """(weight bytes a decode step reads, all tensor bytes, count of tensors per type) of a GGUF.

    A step reads every tensor except the embedding table, of which it looks up one row, unless
    the model has no `output` tensor (tied): then the head reads the whole table. Of a mixture of
    experts' expert tensors (`*_exps*`: weights and biases) it reads the chosen experts' share,
    `{arch}.expert_used_count` of `{arch}.expert_count` (the active bytes)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())

    def number(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.contents()) if field is not None else 0

    experts, used = number("expert_count"), number("expert_used_count")
    share = used / experts if experts and used else 1.0
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    total = sum(sizes.values())
    read = sum(size * share if "_exps." in name else size for name, size in sizes.items())
    if "output.weight" in sizes:
        read -= sizes.get("token_embd.weight", 0)
    return int(read), total, types


# ---- llama-bench -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    prefill_tps: float
    decode_tps: float
    peak_rss: int
    """Bytes: the maximum resident set size of llama-bench (`/usr/bin/time -v`), 0 if unknown."""


_MAX_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def llama_bench(
    llama: LlamaCpp, model: Path, threads: int, prompt: int, gen: int, repeats: int, depth: int = 0
) -> BenchResult:
    """`llama-bench -m model -t threads -p prompt -n gen -r repeats -d depth -o json`, timed for its
    peak RSS (`-d`: the tests run after a context of that many tokens)."""
    cmd = [str(llama.bench), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen)]
    cmd += ["-r", str(repeats), "-d", str(depth), "-o", "json"]
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").is_file() else []
    done = subprocess.run([*timer, *cmd], capture_output=True, text=True, check=False, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rates = {"pp": float("nan"), "tg": float("nan")}
    for row in json.loads(done.stdout):
        kind = "pp" if int(row.get("n_prompt", 0)) > 0 and int(row.get("n_gen", 0)) == 0 else "tg"
        rates[kind] = float(row["avg_ts"])
    match = _MAX_RSS.search(done.stderr)
    return BenchResult(rates["pp"], rates["tg"], int(match.group(1)) * 1024 if match else 0)
