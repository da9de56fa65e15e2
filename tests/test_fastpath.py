"""The runner's fast CPU path (BLAS shim, threads) and its load-time dtype policy."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.cpu import fastpath
from tests.nodes import RunningNode, start_node

SHIM = fastpath.DEFAULT_SHIM
needs_shim = pytest.mark.skipif(
    not (sys.platform == "linux" and SHIM.is_file() and fastpath._openblas_library() is not None),
    reason=f"the BLAS shim is not built ({SHIM}); installing the package builds it",
)
PROMPTS = ["Tell me a long story.", "What is the capital of France?", "Count to twenty: 1, 2, 3,"]


# --- the shim itself ---------------------------------------------------------------------------

_MATMUL_CHECK = """
import os, mlx.core as mx, numpy as np
rng = np.random.default_rng(0)
worst = 0.0
# decode's matrix-vector shapes (split across threads above 256 KB), odd sizes, and prefill shapes
for M, N, K in [(1, 1024, 512), (1, 1000, 333), (1, 77, 4099), (1, 49, 64), (700, 1, 300),
                (2, 1024, 1024), (3, 999, 77), (5, 700, 2048), (8, 1030, 1037), (9, 500, 64),
                (256, 768, 512), (100, 1500, 257), (1500, 100, 257), (65, 1027, 33)]:
    a = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    b = rng.standard_normal((N,)).astype(np.float32)
    ref = a.astype(np.float64) @ w.T.astype(np.float64)
    A, W = mx.array(a), mx.array(w)
    for got, want in ((A @ W.T, ref), (mx.addmm(mx.array(b), A, W.T), ref + b), (W @ A.T, ref.T),
                      (A @ mx.array(w.T.copy()), ref), (mx.array(a.T.copy()).T @ W.T, ref)):
        got = np.asarray(got)
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    if M <= 8 and os.environ["SHOAL_SHIM_KERNEL"] != "openblas":  # decode batches: rows as if alone
        alone = np.concatenate([np.asarray(A[i : i + 1] @ W.T) for i in range(M)])
        assert (np.asarray(A @ W.T) == alone).all(), (M, N, K)
print(worst)
"""


def _run_preloaded(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    fast = fastpath.decide({})
    assert fast.enabled, fast.message
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **fast.env, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_shim
@pytest.mark.parametrize(("kernel", "threads"), [("", "1"), ("", "2"), ("avx2", "3"), ("openblas", "2")])
def test_shim_products_match_float64(kernel: str, threads: str) -> None:
    """Every product shape MLX sends, through each kernel and thread count, is right to float32."""
    done = _run_preloaded(_MATMUL_CHECK, SHOAL_SHIM_KERNEL=kernel, SHOAL_BLAS_THREADS=threads)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) < 1e-5, done.stdout


_FIRST_PRODUCT = """
import json, os, mlx.core as mx
def seen():
    openblas = os.environ["SHOAL_OPENBLAS_LIB"]
    return len(os.listdir("/proc/self/task")), openblas in open("/proc/self/maps").read()
a, w = mx.random.normal((256, 1024)), mx.random.normal((1024, 1024))
mx.eval(a, w)
threads, loaded = seen()
mx.eval(a @ w.T)
print(json.dumps([loaded, seen()[1], seen()[0] - threads]))  # OpenBLAS before, after; new threads
"""


@needs_shim
@pytest.mark.parametrize("threads", [1, 3])
def test_mlx_products_go_through_the_shim_to_openblas(threads: int) -> None:
    """The first product MLX computes enters the shim: it loads OpenBLAS and starts its pool (one
    worker per thread after the first). Without the preload neither happens. (What this buys in
    GFLOP/s, beside MLX's own BLAS: `bench/runner_speed.py --blas-only`.)"""
    library = fastpath.decide({}).env["SHOAL_OPENBLAS_LIB"]
    fast = _run_preloaded(_FIRST_PRODUCT, SHOAL_BLAS_THREADS=str(threads))
    assert fast.returncode == 0 and "shoal blas shim" not in fast.stderr, fast.stderr
    assert json.loads(fast.stdout) == [False, True, threads - 1]
    env = {**os.environ, "SHOAL_OPENBLAS_LIB": library}
    plain = subprocess.run(
        [sys.executable, "-c", _FIRST_PRODUCT], env=env, capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout) == [False, False, 0]


def test_shim_falls_back_to_the_default_blas_when_openblas_is_missing() -> None:
    if not SHIM.is_file():
        pytest.skip("the BLAS shim is not built")
    code = "import mlx.core as mx; a = mx.ones((8, 8)); print(float((a @ a).sum()))"
    env = {**os.environ, "LD_PRELOAD": str(SHIM), "SHOAL_OPENBLAS_LIB": "/nonexistent/libopenblas.so"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == 512.0
    assert "cannot use OpenBLAS at '/nonexistent/libopenblas.so'" in done.stderr


# --- the decision --------------------------------------------------------------------------------


def test_decision_off_when_disabled_or_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fastpath.decide({"SHOAL_FAST_PATH": "0"}) == fastpath.FastPath(
        False, "fast CPU path off: disabled by configuration; using plain MLX", {"SHOAL_KERNELS": "0"}
    )
    assert not fastpath.decide({}, enabled=False).enabled
    missing = fastpath.decide({"SHOAL_BLAS_SHIM": "/nonexistent/shim.so"})
    assert missing.env == {} and "/nonexistent/shim.so is not built" in missing.message
    monkeypatch.setattr(fastpath, "_default_device_is_gpu", lambda: True)
    gpu = fastpath.decide({}).message
    assert gpu == "fast CPU path off: MLX's default device is the GPU; using plain MLX"
    monkeypatch.setattr(fastpath.sys, "platform", "darwin")
    assert "only built for Linux (this is darwin)" in fastpath.decide({}).message


def test_runner_environment_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    def broken(environ: Any = None, *, enabled: bool = True) -> fastpath.FastPath:
        raise OSError("no /sys here")

    monkeypatch.setattr(fastpath, "decide", broken)
    with caplog.at_level(logging.INFO, logger="shoal.runner"):
        assert fastpath.runner_environment({}) == {}
    assert caplog.messages == ["fast CPU path off: OSError: no /sys here; using plain MLX"]


@needs_shim
def test_decision_on_appends_to_ld_preload_and_respects_thread_choice() -> None:
    fast = fastpath.decide({"LD_PRELOAD": "/opt/user.so", "OPENBLAS_NUM_THREADS": "3"})
    assert fast.enabled and fast.message.startswith("fast CPU path on: ")
    assert fast.env["LD_PRELOAD"] == f"/opt/user.so:{SHIM}"
    assert fast.env["SHOAL_BLAS_THREADS"] == "3" and fast.env["OPENBLAS_NUM_THREADS"] == "1"
    default = fastpath.decide({})
    assert default.env["SHOAL_BLAS_THREADS"] == str(fastpath.usable_cores())


_HUGE = """
import re, mlx.core as mx
a = mx.zeros((64 << 20) // 4)
mx.eval(a + 1)
print(re.search(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps_rollup").read()).group(1))
"""


@needs_shim
def test_runner_weights_get_huge_pages_unless_the_user_chose() -> None:
    """The runner's large MLX buffers come on transparent huge pages (where the kernel offers them);
    GLIBC_TUNABLES the user set are kept, and their own hugetlb choice wins."""
    assert fastpath.decide({}).env["GLIBC_TUNABLES"] == fastpath.HUGE_PAGES
    kept = fastpath.decide({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}).env["GLIBC_TUNABLES"]
    assert kept == f"glibc.malloc.arena_max=2:{fastpath.HUGE_PAGES}"
    assert "GLIBC_TUNABLES" not in fastpath.decide({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}).env
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("this kernel offers no transparent huge pages")
    done = _run_preloaded(_HUGE)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 32 << 10, done.stdout  # kB: most of the 64 MB buffer


def _fake_cpu(sysfs: Path, cpu: int, package: int, core: int) -> None:
    topology = sysfs / f"cpu{cpu}" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text(f"{package}\n")
    (topology / "core_id").write_text(f"{core}\n")


def test_usable_cores_counts_hyperthreads_once_and_obeys_cgroup_quota(tmp_path: Path) -> None:
    sysfs = tmp_path / "cpu"
    for cpu in range(8):  # 2 packages x 2 cores x 2 hyperthreads
        _fake_cpu(sysfs, cpu, package=cpu // 4, core=(cpu // 2) % 2)
    no_quota = tmp_path / "cpu.max"
    no_quota.write_text("max 100000\n")
    assert fastpath.usable_cores(set(range(8)), sysfs=sysfs, cpu_max=no_quota) == 4
    assert fastpath.usable_cores({0, 1}, sysfs=sysfs, cpu_max=no_quota) == 1
    assert fastpath.usable_cores({0, 2, 4}, sysfs=sysfs, cpu_max=tmp_path / "missing") == 3
    quota = tmp_path / "quota"
    quota.write_text("150000 100000\n")  # 1.5 CPUs
    assert fastpath.usable_cores(set(range(8)), sysfs=sysfs, cpu_max=quota) == 2
    assert fastpath.usable_cores({5}, sysfs=tmp_path / "no-sysfs", cpu_max=no_quota) == 1


# --- through real nodes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """A node whose shim is "missing": the fallback path, serving plain MLX."""
    node = start_node(
        data_dir=tmp_path_factory.mktemp("data"),
        model=str(random_model_dir),
        env={"SHOAL_BLAS_SHIM": "/nonexistent/libshoal_blas_shim.so"},
    )
    yield node
    node.stop()


def _greedy_deltas(node: RunningNode, prompt: str, max_tokens: int = 24) -> list[str]:
    body = {
        "model": node.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    deltas = []
    with httpx.stream("POST", f"{node.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    if content := choice["delta"].get("content"):
                        deltas.append(content)
    return deltas


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_fallback_node_serves_and_logs_one_line(plain_node: RunningNode) -> None:
    assert _greedy_deltas(plain_node, PROMPTS[0], max_tokens=4)
    lines = [line for line in plain_node.log if "fast CPU path" in line]
    assert len(lines) == 1, lines
    assert "fast CPU path off: the BLAS shim /nonexistent/libshoal_blas_shim.so is not built" in lines[0]
    assert "using plain MLX" in lines[0]
    assert "libshoal_blas_shim" not in _maps(plain_node.runner_pid())
    assert "libshoal_blas_shim" not in _maps(plain_node.process.pid)


@needs_shim
def test_fast_path_gives_the_same_greedy_tokens_as_plain_mlx(
    random_node: RunningNode, plain_node: RunningNode
) -> None:
    assert any("fast CPU path on: " in line for line in random_node.log)
    assert str(SHIM) in _maps(random_node.runner_pid())  # the runner really runs on the shim
    assert "libshoal_blas_shim" not in _maps(random_node.process.pid)  # and the node never does
    for prompt in PROMPTS:
        fast = _greedy_deltas(random_node, prompt)
        assert len(fast) > 5
        assert fast == _greedy_deltas(plain_node, prompt), prompt
