"""The driver's side of the ring: its two links and the bookkeeping of requests on them.

The driver dials stage 1 (an `OutLink`) and sends it HELLO with the route through the other
stages; the last stage dials back (an `InLink` admitted here by the `Gate`) and says HELLO. Both
links prove the instance's key first (`link_auth`), bound to the layer where they cut the model: the
gate admits only a last stage that ends at the model's last layer. Each `connect` names its ring
with a fresh id in the HELLO, which every stage passes on; a connection back whose HELLO names
another ring is a stage's session of an earlier attempt (say one that had queued behind a stage
still busy) and is closed, else every later attempt would pair with the one before it. Frames of
an earlier request still in flight are dropped on receipt, and a request's RESET/CANCEL echo is
read before the next request starts, so each request sees a clean ring. Any link failure is a
`HopError`; after one the links are closed (every stage then drops its caches) and the next
`connect` forms a new ring.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import overload

from node.pipeline.frames import Frame, Kind
from node.pipeline.gate import Gate
from node.pipeline.hop import HopError, InLink, OutLink, dial_member, listen
from node.pipeline.link_auth import OPEN, LinkSecurity

log = logging.getLogger("shoal.pipeline")

POLL_INTERVAL = 0.05
"""Seconds between `is_cancelled` checks while waiting for the ring."""


class Cancelled(Exception):
    """Raised while waiting on the ring once the caller's `is_cancelled()` is true."""


class Ring:
    """Links to `stages` (the other stages' addresses, in layer order), formed on `connect`."""

    def __init__(
        self,
        stages: Sequence[tuple[str, int]],
        *,
        end_layer: int,
        num_layers: int,
        host: str,
        port: int,
        hop_timeout: float,
        connect_timeout: float,
        security: LinkSecurity = OPEN,
    ) -> None:
        self._stages = [(str(h), int(p)) for h, p in stages]
        self._security = security
        self._end_layer = end_layer
        self._hop_timeout = hop_timeout
        self._connect_timeout = connect_timeout
        self._listener = listen(host, port)
        self.listen_address: tuple[str, int] = self._listener.getsockname()[:2]
        """Where the last stage connects back to."""
        self._gate = Gate(self._listener, security, boundary=num_layers, name="driver")
        self._out: OutLink | None = None
        self._in: InLink | None = None
        self._unechoed: int | None = None

    def connect(self) -> None:
        """Form the ring (no-op when connected); `HopError` if it cannot within the timeout."""
        if self._out is not None:
            return
        try:
            self._in = None
            sock, cipher = dial_member(
                self._stages[0], self._security, self._end_layer, timeout=self._connect_timeout
            )
            self._out = OutLink(
                sock,
                name="stage 1",
                cipher=cipher,
                send_timeout=self._hop_timeout,
                on_broken=self._broken,
            )
            route = [f"{host}:{port}" for host, port in [*self._stages[1:], self.listen_address]]
            ring = secrets.token_hex(8)
            self._out.send(Frame(Kind.HELLO, meta={"route": route, "ring": ring}))
            self._in = self._accept_last_stage(ring, time.monotonic() + self._connect_timeout)
            log.info(
                "pipeline ring up: %d stages, layers [0, %d) here", len(self._stages) + 1, self._end_layer
            )
        except BaseException:
            self.disconnect()
            raise

    def _accept_last_stage(self, ring: str, deadline: float) -> InLink:
        while True:
            timeout = max(0.1, deadline - time.monotonic())
            if (admitted := self._gate.admitted(timeout)) is None:
                raise HopError(f"no stage connected within {timeout:.1f}s")
            sock, cipher = admitted
            link = InLink(sock, name="last stage", cipher=cipher, timeout=self._hop_timeout)
            try:
                hello = link.recv(timeout=self._hop_timeout)
            except HopError:
                hello = None  # a connection from an earlier, broken ring
            if hello is not None and hello.kind == Kind.HELLO and hello.meta.get("ring") == ring:
                return link  # its layer: the gate checked it
            log.info("closed a connection back from an earlier ring")
            link.close()

    def disconnect(self) -> None:
        """Close the links; every other stage notices, drops its caches and waits for a new ring."""
        for link in (self._out, self._in):
            if link is not None:
                link.close()
        self._out = self._in = None
        self._unechoed = None

    def close(self) -> None:
        self.disconnect()
        self._gate.close()
        self._listener.close()

    def _broken(self, error: HopError) -> None:
        link = self._in
        if link is not None:
            link.fail(error)

    def send(self, frame: Frame) -> None:
        assert self._out is not None
        self._out.send(frame)

    @overload
    def recv(self, request: int, cancelled: Callable[[], bool] | None) -> Frame: ...
    @overload
    def recv(self, request: int, cancelled: Callable[[], bool] | None, *, block: bool) -> Frame | None: ...
    def recv(self, request: int, cancelled: Callable[[], bool] | None, *, block: bool = True) -> Frame | None:
        """The next frame of `request` (older requests' leftovers are dropped).

        Blocking, it waits as long as the ring is alive, checking `cancelled()` every
        POLL_INTERVAL (raising `Cancelled`); not blocking, it returns None when nothing is in.
        """
        assert self._in is not None
        while True:
            if cancelled is not None and cancelled():
                raise Cancelled
            frame = self._in.recv(timeout=POLL_INTERVAL if block else 0)
            if frame is None:
                if block:
                    continue
                return None
            if frame.request == request:
                return frame
            log.debug("dropped a stale %s frame of request %d", frame.kind.name, frame.request)

    def end(self, request: int, kind: Kind) -> None:
        """Tell every stage to drop the request; its echo is collected before the next request."""
        if self._out is None:
            return
        try:
            self._out.send(Frame(kind, request))
            self._unechoed = request
        except HopError:
            self.disconnect()

    def collect_echo(self) -> None:
        """Read up to the echo of the previous request's RESET/CANCEL: the ring is then clean."""
        request = self._unechoed
        if request is None:
            return
        try:
            while self.recv(request, None).kind not in (Kind.RESET, Kind.CANCEL):
                pass
        except HopError:
            self.disconnect()
            raise
        self._unechoed = None
