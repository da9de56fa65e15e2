"""A pipeline stage as its own OS process, for tests without trio (the node runs its stages with
`node.children.supervisor`: `node.hosting.stages`), and an even split of a model's layers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from node.children.process import read_first_frame, spawn, terminate
from node.pipeline.hop import HOP_TIMEOUT
from node.pipeline.shard import ShardError
from node.pipeline.stage_wire import READY_MAX_BYTES, decode_ready, stage_command


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of near-equal size, earlier stages taking the remainder."""
    if not 1 <= stages <= num_layers:
        raise ShardError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass
class StageProcess:
    """A stage running as its own OS process."""

    process: subprocess.Popen[bytes]
    address: tuple[str, int]
    start: int
    end: int

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        terminate(self.process, timeout)


def spawn_stage(
    model_path: Path | str,
    *,
    start: int,
    end: int | None = None,
    hop_timeout: float = HOP_TIMEOUT,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    next_from_stdin: bool = False,
) -> StageProcess:
    """Start a stage process on 127.0.0.1, any free port; returns at once (call `wait_ready` next).

    Starting several stages and then waiting for all loads them in parallel. `die_with_parent`
    ends the stage when this process dies, even by SIGKILL: at once on Linux, within
    `node.children.process.PARENT_POLL` elsewhere. `next_from_stdin`: as a node starts it, its next
    hop from `NextHop` frames written to `process.stdin`.
    """
    parent_pid = os.getpid() if die_with_parent else None
    command = stage_command(
        model_path,
        start=start,
        end=end,
        hop_timeout=hop_timeout,
        parent_pid=parent_pid,
        next_from_stdin=next_from_stdin,
    )
    process = spawn(command, env=env, stdin=next_from_stdin, die_with_parent=die_with_parent)
    return StageProcess(process, ("127.0.0.1", 0), start, -1 if end is None else end)


def wait_ready(stage: StageProcess, *, timeout: float = 120.0) -> StageProcess:
    """Read the stage's ready frame; RuntimeError if it exits or stays silent for `timeout` s."""
    assert stage.process.stdout is not None
    try:
        frame = read_first_frame(stage.process.stdout, max_bytes=READY_MAX_BYTES, timeout=timeout)
    except TimeoutError:
        stage.stop()
        raise RuntimeError(f"stage [{stage.start}, ...) was not ready within {timeout:.0f}s") from None
    if frame is None:
        stage.process.wait()
        raise RuntimeError(f"stage [{stage.start}, ...) exited with {stage.process.returncode}")
    ready = decode_ready(bytes(frame))
    stage.address, stage.end = (stage.address[0], ready.port), ready.end
    stage.process.stdout.close()
    return stage
