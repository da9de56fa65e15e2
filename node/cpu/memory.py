"""How much memory this machine gives a process: the one probe behind placement and the runner.

The host's figures come from psutil (MemTotal and MemAvailable of /proc/meminfo on Linux, the VM
statistics on macOS). Under a cgroup v2 memory limit (a container, a systemd slice with
MemoryMax) the limit is what an allocation can get, not the host's RAM: total becomes the limit
and available what is left of it. The node advertises these figures to the leader, which places
models by them, and the runner's weight policy decides by the same ones, so a container's limit
that the runner respects is also one placement respects.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import psutil

CGROUP_MEMORY = Path("/sys/fs/cgroup")
"""Where this process's cgroup v2 files appear (its own cgroup, inside a container namespace)."""


@dataclass(frozen=True)
class Memory:
    total: int
    """Bytes this process may ever use: the host's RAM, or the cgroup limit when lower."""
    available: int
    """Bytes a new allocation can get now."""


def read_memory(cgroup: Path | None = None) -> Memory:
    """The host's total and available bytes, each capped by the memory limit of `cgroup` (default
    `CGROUP_MEMORY`) if it has one."""
    host = psutil.virtual_memory()
    total, available = int(host.total), int(host.available)
    limit = _cgroup_limit(CGROUP_MEMORY if cgroup is None else cgroup)
    if limit is not None:
        limit_bytes, used = limit
        total = min(total, limit_bytes)
        available = min(available, max(0, limit_bytes - used))
    return Memory(total, available)


def available_memory_bytes(cgroup: Path | None = None) -> int:
    """`read_memory(cgroup).available`: what the runner's weight policy checks before converting."""
    return read_memory(cgroup).available


def _cgroup_limit(cgroup: Path) -> tuple[int, int] | None:
    """(memory.max, memory.current) in bytes; None without a limit or when they can't be read."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit), int((cgroup / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def release_free_heap() -> bool:
    """Give the pages the C heap holds free back to the OS (glibc's `malloc_trim(0)`); False where
    there is no glibc (macOS, musl), which needs no help or offers none.

    glibc keeps freed small allocations for reuse: loading a model parses tokenizer.json (the
    tokenizers library builds and drops ~30 MB of JSON values for a 49k vocabulary) and reads
    weights through buffers it frees, and those pages stay in the runner's resident memory for
    good (measured: 33 MB after SmolLM2-135M's tokenizer, 49 MB after a 1B model's load). A
    runner calls this once loaded and each time it goes idle; it takes milliseconds.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
