"""How a node starts a stage process and reads its ready frame, without the stage's imports.

`node.pipeline.stage` runs MLX; the node only spawns it (`node.hosting.stages`). Keeping its command
line and ready frame here spares the node process MLX and numpy (~20 MB resident).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, encode_cbor
from protocol.framing import FrameError, encode


class StageReady(WireMessage):
    """A stage process's one frame on stdout: it accepts connections on `port`."""

    port: int
    start: int
    end: int
    pid: int


READY_MAX_BYTES = 1024
"""A ready frame is a few dozen bytes; the cap on what a starting stage may make us buffer."""


def encode_ready(ready: StageReady) -> bytes:
    return encode(encode_cbor(ready, limit=READY_MAX_BYTES, error=FrameError), READY_MAX_BYTES)


def decode_ready(frame: bytes) -> StageReady:
    """`FrameError` for a frame that is no `StageReady`."""
    return decode_cbor(_READY, frame, limit=READY_MAX_BYTES, error=FrameError, what="stage ready frame")


_READY: TypeAdapter[StageReady] = TypeAdapter(StageReady)


def stage_command(
    model_path: Path | str,
    *,
    start: int,
    end: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    hop_timeout: float | None = None,
    parent_pid: int | None = None,
) -> list[str]:
    """`python -m node.pipeline.stage` with these arguments (see its `main`); no hop_timeout: its default."""
    command = [sys.executable, "-m", "node.pipeline.stage", "--model-path", str(model_path)]
    command += ["--start", str(start), "--listen", f"{host}:{port}"]
    if hop_timeout is not None:
        command += ["--hop-timeout", str(hop_timeout)]
    if end is not None:
        command += ["--end", str(end)]
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    return command
