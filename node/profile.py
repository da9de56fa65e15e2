"""What this machine offers the cluster: host, OS, compute backend and memory, read at the edge."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass
from typing import Literal

import psutil

Backend = Literal["cpu", "metal", "cuda"]


@dataclass(frozen=True)
class MachineProfile:
    hostname: str
    os: str
    backend: Backend
    memory_total: int
    memory_available: int


def compute_backend() -> Backend:
    """The device MLX will run models on here."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def read_profile(backend: Backend) -> MachineProfile:
    """Current figures; memory_available changes as models load, so this is re-read periodically."""
    memory = psutil.virtual_memory()
    return MachineProfile(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        backend=backend,
        memory_total=memory.total,
        memory_available=memory.available,
    )
