"""The one memory probe: the host's figures capped by a cgroup v2 limit, for placement and runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from node.cluster.profile import read_profile
from node.cpu import memory
from node.cpu.dtype import apply_dtype_policy
from node.cpu.memory import Memory, available_memory_bytes, read_memory
from node.native import KernelLoad
from tests.model_factory import make_random_model

GIB = 1024**3


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with 16 GiB of RAM, 8 GiB of it available."""
    monkeypatch.setattr(
        memory.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * GIB, available=8 * GIB)
    )


def cgroup(tmp_path: Path, limit: str | None, current: str | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, value in (("memory.max", limit), ("memory.current", current)):
        if value is not None:
            (tmp_path / name).write_text(value + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("limit", "current", "expected"),
    [
        (None, None, Memory(16 * GIB, 8 * GIB)),  # no cgroup files: the host's figures
        ("max", str(GIB), Memory(16 * GIB, 8 * GIB)),  # a cgroup without a limit
        (str(4 * GIB), str(GIB), Memory(4 * GIB, 3 * GIB)),  # a container: its limit counts
        (str(4 * GIB), str(5 * GIB), Memory(4 * GIB, 0)),  # over its limit (page cache): nothing left
        (str(64 * GIB), str(GIB), Memory(16 * GIB, 8 * GIB)),  # a limit above the host's RAM
        ("garbage", str(GIB), Memory(16 * GIB, 8 * GIB)),  # unreadable: the host's figures
        (str(4 * GIB), None, Memory(16 * GIB, 8 * GIB)),  # no usage figure: the limit is not applied
    ],
)
def test_a_cgroup_limit_caps_the_hosts_figures(
    host: None, tmp_path: Path, limit: str | None, current: str | None, expected: Memory
) -> None:
    path = cgroup(tmp_path, limit, current)
    assert read_memory(path) == expected
    assert available_memory_bytes(path) == expected.available


def test_placement_and_the_runner_see_the_same_limit(
    host: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builtin_model_dir: Path
) -> None:
    """A node in a 64 MB container advertises 64 MB, and its runner does not convert to float32."""
    monkeypatch.setattr(memory, "CGROUP_MEMORY", cgroup(tmp_path / "cgroup", str(64 * 10**6), "0"))
    profile = read_profile("cpu")
    assert (profile.memory_total, profile.memory_available) == (64 * 10**6, 64 * 10**6)

    from mlx_lm.utils import load

    bf16 = make_random_model(tmp_path / "bf16", tokenizer_from=builtin_model_dir, dtype="bfloat16")
    model = load(str(bf16), lazy=True)[0]
    decision = apply_dtype_policy(model, kernels=KernelLoad(None, "kernels left out by the test"))
    assert not decision.converted
    assert "NOT converted to float32" in decision.message and "only 0.1 GB available" in decision.message


RELEASE_CHILD = """
import ctypes, re, sys
from node.cpu.memory import release_free_heap

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1000) for _ in range(100_000)]  # 100 MB of small blocks: the heap, not mmap
for b in blocks:
    ctypes.memset(b, 1, 1000)
for i, b in enumerate(blocks):  # every 16th stays: free alone cannot shrink the heap around them
    if i % 16:
        libc.free(b)
before = rss()
released = release_free_heap()
print(released, before - rss())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_released_heap_pages_leave_resident_memory() -> None:
    """Freed small blocks stay resident under glibc until `release_free_heap` hands them back."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", RELEASE_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        check=True,
    )
    released, dropped = done.stdout.split()
    assert released == "True"
    assert int(dropped) > 40 * 1024 * 1024, done.stdout  # measured: 66 MB of the 94 freed
