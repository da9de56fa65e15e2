"""How a node starts a stage process, reads its ready frame and tells it its next hop, without the
stage's imports.

`node.pipeline.stage` runs MLX; the node only spawns it (`node.hosting.stages`). Keeping its command
line and frames here spares the node process MLX and numpy (~20 MB resident).

A stage started by its node (`--next-from-stdin`) learns where to send its output only from
`NextHop` frames on its stdin, which the node writes from what the next stage's node answers over
the mesh; the end of its stdin tells it to exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import TypeAdapter

from protocol.cbor_messages import WireMessage, decode_cbor, framed_cbor
from protocol.framing import FrameError


class StageReady(WireMessage):
    """A stage process's one frame on stdout: it accepts connections on `port`."""

    port: int
    start: int
    end: int
    pid: int


READY_MAX_BYTES = 1024
"""A ready frame is a few dozen bytes; the cap on what a starting stage may make us buffer."""


def encode_ready(ready: StageReady) -> bytes:
    return framed_cbor(ready, READY_MAX_BYTES)


def decode_ready(frame: bytes) -> StageReady:
    """`FrameError` for a frame that is no `StageReady`."""
    return decode_cbor(_READY, frame, limit=READY_MAX_BYTES, error=FrameError, what="stage ready frame")


_READY: TypeAdapter[StageReady] = TypeAdapter(StageReady)


class NextHop(WireMessage):
    """The node -> its stage process: the next hop's HOST:PORT (the next stage, or for the last
    stage the driver), None while the mesh does not know it."""

    address: str | None


NEXT_HOP_MAX_BYTES = 512
"""A next hop frame is an address; the cap on what the stage buffers from its stdin."""


def encode_next_hop(hop: NextHop) -> bytes:
    return framed_cbor(hop, NEXT_HOP_MAX_BYTES)


def decode_next_hop(frame: bytes) -> NextHop:
    """`FrameError` for a frame that is no `NextHop`."""
    return decode_cbor(_NEXT_HOP, frame, limit=NEXT_HOP_MAX_BYTES, error=FrameError, what="next hop frame")


_NEXT_HOP: TypeAdapter[NextHop] = TypeAdapter(NextHop)


def follower_command(
    model_path: Path | str, *, rank: int, size: int, host: str, port: int, parent_pid: int | None
) -> list[str]:
    """`python -m node.tensor.follower`: rank `rank` of a tensor-parallel group of `size`, which
    writes a `StageReady` frame once it listens, as a stage does."""
    command = [sys.executable, "-m", "node.tensor.follower", "--model-path", str(model_path)]
    command += ["--rank", str(rank), "--size", str(size), "--listen", f"{host}:{port}"]
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    return command


def stage_command(
    model_path: Path | str,
    *,
    start: int,
    end: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    hop_timeout: float | None = None,
    parent_pid: int | None = None,
    next_from_stdin: bool = False,
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
    if next_from_stdin:
        command.append("--next-from-stdin")
    return command
