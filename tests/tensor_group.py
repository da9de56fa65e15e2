"""A tensor-parallel group for tests: rank 0 in this process, the others as real
`python -m node.tensor.follower` processes on 127.0.0.1."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from node.children.process import spawn, terminate
from node.cpu.dtype import apply_dtype_policy
from node.pipeline.hop import listen
from node.pipeline.link_auth import OPEN
from node.tensor.mesh import connect_group
from node.tensor.shard import TensorGenerator, load_tensor_shard


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (bound and released together, so they differ)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def follower_command(model_dir: Path, rank: int, group: str, *, link_timeout: float) -> list[str]:
    return [
        sys.executable, "-m", "node.tensor.follower", "--model-path", str(model_dir), "--rank", str(rank),
        "--group", group, "--parent-pid", str(os.getpid()), "--link-timeout", str(link_timeout),
    ]  # fmt: skip


def wait_line(process: subprocess.Popen[bytes], *, timeout: float) -> str:
    """The process's next stdout line; RuntimeError if none comes within `timeout` s."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline().decode() if ready else ""
    if not line:
        raise RuntimeError(
            f"follower {process.pid} said nothing within {timeout:.0f}s (exit {process.poll()})"
        )
    return line.strip()


@contextmanager
def tensor_group(
    model_dir: Path, size: int, *, link_timeout: float = 10.0
) -> Iterator[tuple[TensorGenerator, list[subprocess.Popen[bytes]]]]:
    """Rank 0's generator and the other ranks' processes, connected; all stopped on exit."""
    ports = free_ports(size)
    group = ",".join(f"127.0.0.1:{p}" for p in ports)
    listener = listen("127.0.0.1", ports[0])
    followers = [
        spawn(follower_command(model_dir, r, group, link_timeout=link_timeout), env=None, stdin=False)
        for r in range(1, size)
    ]
    shard = None
    try:
        shard = load_tensor_shard(model_dir, rank=0, size=size, prepare=apply_dtype_policy)
        link = connect_group(
            0, [("127.0.0.1", p) for p in ports], listener, security=OPEN, link_timeout=link_timeout
        )
        shard.attach(link)
        for rank, process in enumerate(followers, start=1):
            assert wait_line(process, timeout=60) == f"ready rank {rank}"
        yield TensorGenerator(shard), followers
    finally:
        listener.close()
        if shard is not None and shard.link is not None:
            shard.link.close()
        for process in followers:
            terminate(process, 5.0)
