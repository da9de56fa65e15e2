"""A pipeline stage after the first: receive hidden states, run this stage's layers, pass them on.

    python -m node.pipeline.stage --model-path P --start S --end E --listen PORT
        [--next HOST:PORT | --next-from-stdin]

Loads only layers [S, E) (see `shard`), listens, and writes one frame on stdout once it accepts
connections: `StageReady` (port, start, end, pid), the handshake of `node.children`.

A session starts when the previous stage (or the driver) connects, proves the instance's key (the
`Gate` admits it: `link_auth`; a stranger never holds the stage), and says HELLO. The stage then
dials its next hop (the next stage, or from the last stage the driver), which must prove the same
key back before anything is sent to it, and says HELLO in turn. Where the next hop is:
- started by a node (`--next-from-stdin`): only what the node last wrote on our stdin
  (`next_hop.NextHopFeed`), from the mesh's answer for the next stage; re-read on every dial try,
  so a driver or stage that moved is followed. A HELLO's route is ignored: no frame steers us.
- started by hand (tests, `bench/`): `--next`, else the HELLO's route, the address of every later
  hop ending with the driver's own, which each stage passes on without its first entry.

Per request (keyed by the driver's request number) the stage keeps a KV cache for its own layers.
PREFILL frames fill it, DECODE frames run one position; the last stage samples on DECODE and
acknowledges PREFILL chunks, both to the driver. RESET/CANCEL drop the cache and travel on (the
last stage echoes them, so the driver knows the ring is clean). A step that fails (bad position,
MLX error) drops that request and sends ERROR on to the driver; the stage keeps serving.

When either link fails, the session ends: both links are closed (so the failure travels around
the ring in both directions at once instead of waiting for timeouts), every cache is dropped,
and the stage waits for a new upstream connection. A stage never outlives a `stop()` by more than
the accept poll interval, and never blocks on a peer without a bound.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from node.children.process import exit_when_orphaned, keep_beating
from node.cpu.memory import release_free_heap
from node.pipeline.frames import Frame, Kind
from node.pipeline.gate import ACCEPT_POLL, Gate
from node.pipeline.hop import (
    CONNECT_TIMEOUT,
    HOP_TIMEOUT,
    HopError,
    InLink,
    OutLink,
    Target,
    dial_member,
    listen,
    parse_address,
)
from node.pipeline.link_auth import OPEN, FrameCipher, LinkSecurity
from node.pipeline.next_hop import NextHopFeed
from node.pipeline.shard import Sampler, Shard, load_shard, request_sampler
from node.pipeline.stage_wire import StageReady, encode_ready
from protocol.sampling import GREEDY, Sampling

log = logging.getLogger("shoal.pipeline")

MAX_LIVE_REQUESTS = 16
"""Caches kept at once; the oldest is dropped beyond this (a driver that lost track of a request).
The driver runs one request at a time, so normally there is one."""


class StepError(Exception):
    """A step this stage cannot run; reported to the driver as an ERROR frame."""


@dataclass
class _Request:
    cache: list[Any]
    position: int
    sampler: Sampler | None


class StageServer:
    """Serves one stage of a pipeline: `serve_forever` runs it until `stop()`.

    Run it on a process's main thread, as `python -m node.pipeline.stage` does. On another thread
    it works, but MLX 0.32 can abort the process at interpreter exit: a thread that ran the model
    owns a thread-local `mx.compile` cache (mlx-lm compiles `swiglu`), whose destructor needs the
    GIL, and if that thread ends while the interpreter finalizes, libstdc++ calls terminate.

    `next_hop`, when given, is where the next hop is (read before each dial try) and the HELLO's
    route is ignored; `hop_timeout` bounds every wait on a neighbour, `connect_timeout` the dial of
    the next one (it may still be loading); `security` is the instance's link key; `stopping`, once
    set, stops it as `stop()` does.
    """

    def __init__(
        self,
        shard: Shard,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        next_hop: Target | None = None,
        hop_timeout: float = HOP_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        security: LinkSecurity = OPEN,
        stopping: threading.Event | None = None,
    ) -> None:
        if shard.spec.is_first:
            raise ValueError("the first stage is the driver (PipelineGenerator), not a StageServer")
        self.shard = shard
        self._next_hop = next_hop
        self._hop_timeout = hop_timeout
        self._connect_timeout = connect_timeout
        self._listener = listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stop = stopping or threading.Event()
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self._name = f"stage[{shard.spec.start},{shard.spec.end})"
        self._security = security
        self._gate = Gate(self._listener, security, boundary=shard.spec.start, name=self._name)

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                if (upstream := self._gate.admitted(ACCEPT_POLL)) is None:
                    continue
                try:
                    self._session(*upstream)
                except HopError as exc:
                    log.warning("%s: ring broken: %s", self._name, exc)
                finally:
                    self._requests.clear()
                    mx.clear_cache()
        finally:
            self._gate.close()
            self._listener.close()

    def _session(self, sock: Any, cipher: FrameCipher | None) -> None:
        inbound = InLink(sock, name="previous stage", cipher=cipher, timeout=self._hop_timeout)
        outbound: OutLink | None = None
        try:
            hello = inbound.recv(timeout=self._hop_timeout)
            if hello is None or hello.kind != Kind.HELLO:
                raise HopError("the previous stage did not say HELLO")  # its layer: the gate checked it
            route = [str(hop) for hop in hello.meta.get("route", [])]
            target = self._next_hop
            if target is None:
                if not route:
                    raise HopError("the HELLO carries no route to the next stage")
                target = parse_address(route[0])
            downstream, sealer = dial_member(
                target, self._security, self.shard.spec.end, timeout=self._connect_timeout
            )
            dialed = downstream.getpeername()[:2]
            outbound = OutLink(
                downstream,
                name="next stage" if not self.shard.spec.is_last else "driver",
                cipher=sealer,
                send_timeout=self._hop_timeout,
                on_broken=inbound.fail,
            )
            outbound.send(Frame(Kind.HELLO, meta={**hello.meta, "route": route[1:]}))
            log.info("%s: ring up (next: %s:%d)", self._name, *dialed)
            while not self._stop.is_set():
                frame = inbound.recv(timeout=ACCEPT_POLL)
                if frame is not None:
                    self._handle(frame, outbound)
        finally:
            inbound.close()
            if outbound is not None:
                outbound.close()

    def _handle(self, frame: Frame, out: OutLink) -> None:
        if frame.kind in (Kind.PREFILL, Kind.DECODE):
            try:
                self._step(frame, out)
            except StepError as exc:
                self._fail_request(frame.request, str(exc), out)
            except (RuntimeError, ValueError, TypeError) as exc:  # how MLX reports a bad shape/dtype
                log.exception("%s: step failed", self._name)
                self._fail_request(frame.request, f"{type(exc).__name__}: {exc}", out)
        elif frame.kind in (Kind.RESET, Kind.CANCEL, Kind.ERROR):
            self._requests.pop(frame.request, None)
            out.send(frame)  # on to the next stage; from the last, the echo to the driver
        else:
            raise HopError(f"unexpected {frame.kind.name} frame from the previous stage")

    def _fail_request(self, request: int, message: str, out: OutLink) -> None:
        self._requests.pop(request, None)
        out.send(Frame(Kind.ERROR, request, meta={"message": f"{self._name}: {message}"}))

    def _step(self, frame: Frame, out: OutLink) -> None:
        started = time.perf_counter()
        spec = self.shard.spec
        state = self._requests.get(frame.request)
        if state is None:
            if frame.position != 0:
                raise StepError(f"request {frame.request} is unknown here (its cache was dropped)")
            sampler = (
                request_sampler(Sampling.model_validate(frame.meta.get("sampling", GREEDY.model_dump())))
                if spec.is_last
                else None
            )
            state = self._requests[frame.request] = _Request(self.shard.make_cache(), 0, sampler)
            while len(self._requests) > MAX_LIVE_REQUESTS:
                dropped, _ = self._requests.popitem(last=False)
                log.warning(
                    "%s: dropped the cache of request %d (too many live requests)", self._name, dropped
                )
        if frame.position != state.position:
            raise StepError(f"step at position {frame.position}, but the cache holds {state.position}")
        x = frame.tensor
        if x is None or x.ndim != (2 if spec.is_first else 3) or x.shape[0] != 1:
            raise StepError(f"bad input tensor {None if x is None else x.shape}")
        h = self.shard.forward(x, state.cache)
        state.position += x.shape[1]
        if not spec.is_last:
            mx.eval(h)
            meta = dict(frame.meta)
            if frame.kind == Kind.DECODE:
                meta["busy_us"] = [*meta.get("busy_us", ()), _since_us(started)]
            out.send(Frame(frame.kind, frame.request, frame.position, h, meta))
        elif frame.kind == Kind.PREFILL:
            # Like mlx-lm's prefill: only the caches are needed, not the last layer's output.
            mx.eval([c.state for c in state.cache])
            out.send(Frame(Kind.ACK, frame.request, state.position))
        else:
            assert state.sampler is not None
            token = self.shard.next_token(h, state.sampler).astype(mx.int32)
            mx.eval(token)
            meta = {"busy_us": [*frame.meta.get("busy_us", ()), _since_us(started)]}
            out.send(Frame(Kind.TOKEN, frame.request, state.position, token, meta))
        if frame.kind == Kind.PREFILL:
            mx.clear_cache()


def _since_us(started: float) -> int:
    """Microseconds of work since `started`, reported along the ring so the driver can tell the
    stages' own time from the hops' (see `RingStats`)."""
    return int((time.perf_counter() - started) * 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.pipeline.stage", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--start", type=int, required=True, help="first layer this stage runs")
    parser.add_argument("--end", type=int, default=None, help="one past its last layer (default: the last)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="[HOST:]PORT to accept the previous stage on")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--next", default=None, help="HOST:PORT of the next hop, overriding the route the driver sends"
    )
    where.add_argument(
        "--next-from-stdin",
        action="store_true",
        help="the next hop is what NextHop frames on stdin say (a node's stage); stdin's end stops it",
    )
    parser.add_argument("--hop-timeout", type=float, default=HOP_TIMEOUT)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT)
    parser.add_argument(
        "--dtype",
        choices=("auto", "stored"),
        default="auto",
        help="auto: the runner's dtype policy (float32 on the CPU); stored: run the checkpoint's dtype",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="stage: %(message)s", stream=sys.stderr)
    if args.parent_pid is not None:
        exit_when_orphaned(args.parent_pid)

    stopping = threading.Event()
    feed = NextHopFeed(sys.stdin.buffer, on_closed=stopping.set) if args.next_from_stdin else None
    prepare = None
    if args.dtype == "auto":
        from node.cpu.dtype import apply_dtype_policy

        prepare = apply_dtype_policy
    shard = load_shard(args.model_path, start=args.start, end=args.end, prepare=prepare)
    release_free_heap()  # what loading freed (node.cpu.memory says why)
    host, port = parse_address(args.listen) if ":" in args.listen else ("127.0.0.1", int(args.listen))
    server = StageServer(
        shard,
        host=host,
        port=port,
        next_hop=feed.current if feed is not None else parse_address(args.next) if args.next else None,
        hop_timeout=args.hop_timeout,
        connect_timeout=args.connect_timeout,
        security=LinkSecurity.from_env(),
        stopping=stopping,
    )
    ready = StageReady(port=server.address[1], start=shard.spec.start, end=shard.spec.end, pid=os.getpid())
    sys.stdout.buffer.write(encode_ready(ready))
    sys.stdout.flush()
    # From now on the pipe carries only heartbeats (whoever started us may stop reading it), and
    # stdout is the log.
    keep_beating(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
