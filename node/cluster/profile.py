"""What this machine offers the cluster: host, OS, accelerator and memory, read at the edge."""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass
from typing import Literal

from node.cpu.memory import read_memory

Accelerator = Literal["cpu", "metal", "cuda"]
"""The device MLX runs models on (not `api.backend.Backend`, the API's view of the node)."""


@dataclass(frozen=True)
class MachineProfile:
    hostname: str
    os: str
    accelerator: Accelerator
    memory_total: int
    memory_available: int


def detect_accelerator() -> Accelerator:
    """The device MLX will run models on here."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def read_profile(accelerator: Accelerator) -> MachineProfile:
    """Current figures; memory_available changes as models load, so this is re-read periodically.

    Memory is `node.cpu.memory`'s probe (a cgroup limit caps both figures), the one the runner's
    weight policy reads: placement counts what the runner will have."""
    memory = read_memory()
    return MachineProfile(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        accelerator=accelerator,
        memory_total=memory.total,
        memory_available=memory.available,
    )
