"""Where a stage sends its output: the next hop its node last named, read from the stage's stdin.

The node writes a `NextHop` frame (`stage_wire`) whenever the mesh's answer for the next stage
changes; a thread here keeps the latest. A HELLO's route is never read in this mode, so no frame,
not even one from a member, can point the stage anywhere. The end of stdin (the node stopping us,
or gone) calls `on_closed`; a malformed frame is logged and ends the feed the same way, since the
node is the only writer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import BinaryIO

from node.pipeline.hop import parse_address
from node.pipeline.stage_wire import NEXT_HOP_MAX_BYTES, decode_next_hop
from protocol.framing import FrameDecoder, FrameError

log = logging.getLogger("shoal.pipeline")


class NextHopFeed:
    """The latest next hop from `stream` (read on a daemon thread until it closes)."""

    def __init__(self, stream: BinaryIO, on_closed: Callable[[], None]) -> None:
        self._stream = stream
        self._on_closed = on_closed
        self._lock = threading.Lock()
        self._address: tuple[str, int] | None = None
        self._thread = threading.Thread(target=self._read, name="next-hop", daemon=True)
        self._thread.start()

    def current(self) -> tuple[str, int] | None:
        """The next hop's address as the node last said it; None while it knows none."""
        with self._lock:
            return self._address

    def _read(self) -> None:
        decoder = FrameDecoder(NEXT_HOP_MAX_BYTES)
        try:
            while data := self._stream.read1(4096):  # type: ignore[attr-defined]
                for frame in decoder.feed(data):
                    hop = decode_next_hop(bytes(frame))
                    address = None if hop.address is None else parse_address(hop.address)
                    with self._lock:
                        self._address = address
                    log.info("next hop: %s", hop.address or "unknown")
        except (FrameError, ValueError, OSError) as exc:
            log.error("bad next hop from the node (%s); stopping", exc)
        finally:
            self._on_closed()
