"""A tensor-parallel group for tests: rank 0 in this process, the others as real
`python -m node.tensor.follower` processes on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from node.children.process import read_first_frame, spawn, terminate
from node.cpu.dtype import apply_dtype_policy
from node.pipeline.link_auth import LINK_ENV, OPEN, LinkSecurity
from node.pipeline.stage_wire import READY_MAX_BYTES, decode_ready
from node.tensor.shard import TensorGenerator, load_tensor_shard


def follower_command(model_dir: Path, rank: int, size: int, *, link_timeout: float) -> list[str]:
    return [
        sys.executable, "-m", "node.tensor.follower", "--model-path", str(model_dir), "--rank", str(rank),
        "--size", str(size), "--parent-pid", str(os.getpid()), "--link-timeout", str(link_timeout),
    ]  # fmt: skip


def ready_address(process: subprocess.Popen[bytes], *, timeout: float = 120.0) -> str:
    """Where a follower listens, from its ready frame; RuntimeError if it exits or stays silent."""
    assert process.stdout is not None
    try:
        frame = read_first_frame(process.stdout, max_bytes=READY_MAX_BYTES, timeout=timeout)
    except TimeoutError:
        raise RuntimeError(f"follower {process.pid} was not ready within {timeout:.0f}s") from None
    if frame is None:
        raise RuntimeError(f"follower {process.pid} exited with {process.wait()}")
    return f"127.0.0.1:{decode_ready(bytes(frame)).port}"


@contextmanager
def tensor_group(
    model_dir: Path,
    size: int,
    *,
    link_timeout: float = 10.0,
    connect_timeout: float = 30.0,
    security: LinkSecurity = OPEN,
) -> Iterator[tuple[TensorGenerator, list[subprocess.Popen[bytes]]]]:
    """Rank 0's generator (connected) and the other ranks' processes; all stopped on exit."""
    env = {**os.environ, LINK_ENV: security.encode()}
    followers = [
        spawn(follower_command(model_dir, r, size, link_timeout=link_timeout), env=env, stdin=False)
        for r in range(1, size)
    ]
    generator = None
    try:
        shard = load_tensor_shard(model_dir, rank=0, size=size, prepare=apply_dtype_policy)
        addresses = [ready_address(process) for process in followers]
        generator = TensorGenerator(
            shard, addresses, security=security, link_timeout=link_timeout, connect_timeout=connect_timeout
        )
        generator.connect()
        yield generator, followers
    finally:
        if generator is not None:
            generator.close()
        for process in followers:
            terminate(process, 5.0)
