"""Runner process entry point: `python -m node.runner`, no arguments.

Reads its `RunnerSpec` from the first frame on stdin (`Start`), then `Generate`/`Cancel`/`Shutdown`
frames; writes `Ready`/`RequestEvent`/`LoadFailed` frames on stdout. MLX runs on the main thread,
in the batch loop of `node.runner.scheduler`: every turn it takes the requests that arrived, then
advances all running ones by one step. A reader thread receives commands, so new requests and
cancels arrive while others generate. The runner exits when its stdin closes: a runner never
outlives its node (on Linux the kernel also kills it when the node dies: `node.children`).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

import mlx.core as mx

from node.cpu.memory import release_free_heap
from node.runner.engine import LoadedModel, load_model
from node.runner.prefix_cache import PrefixCache
from node.runner.scheduler import Scheduler
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, is_terminal
from protocol.ids import RequestId
from protocol.runner_wire import (
    Cancel,
    FrameError,
    Generate,
    LoadFailed,
    MessageDecoder,
    Ready,
    RequestEvent,
    RunnerMessage,
    RunnerSpec,
    Shutdown,
    Start,
    encode_frame,
)

log = logging.getLogger("shoal.runner")


class _Wire:
    """Thread-safe frame writer on the runner's private copy of stdout."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def send(self, message: RunnerMessage) -> None:
        frame = encode_frame(message)
        with self._lock:
            try:
                self._out.write(frame)
                self._out.flush()
            except BrokenPipeError:
                # The node is gone (killed: a clean stop closes our stdin first). Nobody can get our
                # tokens any more: stop now, without a traceback or more work.
                log.warning("the node closed the connection; exiting")
                os._exit(0)


class _Inbox:
    """Commands from the node: queued generations and the set of cancelled request ids."""

    def __init__(self) -> None:
        self.pending: queue.Queue[GenerateRequest | None] = queue.Queue()
        self._cancelled: set[RequestId] = set()
        self._lock = threading.Lock()
        self.closed = False

    def cancel(self, request_id: RequestId) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def is_cancelled(self, request_id: RequestId) -> bool:
        with self._lock:
            return self.closed or request_id in self._cancelled

    def forget(self, request_id: RequestId) -> None:
        with self._lock:
            self._cancelled.discard(request_id)

    def close(self) -> None:
        self.closed = True
        self.pending.put(None)


def _messages(stdin: BinaryIO) -> Iterator[RunnerMessage]:
    """The node's messages, in order, until stdin closes; `FrameError` for a bad frame."""
    decoder = MessageDecoder()
    while data := stdin.read1(65536):  # type: ignore[attr-defined]
        yield from decoder.feed(data)


def _read_commands(commands: Iterator[RunnerMessage], inbox: _Inbox) -> None:
    try:
        for message in commands:
            if isinstance(message, Generate):
                inbox.pending.put(message.request)
            elif isinstance(message, Cancel):
                inbox.cancel(message.request_id)
            elif isinstance(message, Shutdown):
                return
    except FrameError:
        log.exception("bad frame from the node; shutting down")
    finally:
        inbox.close()


def _settle() -> None:
    """Hand back what the last load or requests left free: MLX's buffer cache and the C heap's
    free pages, so an idle runner holds its weights, caches and little else."""
    mx.clear_cache()
    release_free_heap()


def _take_requests(inbox: _Inbox, scheduler: Scheduler) -> bool:
    """Submit every queued request, waiting for one when nothing runs; False once stdin closed."""
    block = scheduler.idle
    if block and inbox.pending.empty():
        _settle()
    while True:
        try:
            request = inbox.pending.get(block=block)
        except queue.Empty:
            return True
        if request is None:
            return False
        scheduler.submit(request)
        block = False


def _start_serving(
    wire: _Wire, loaded: LoadedModel, commands: Iterator[RunnerMessage], *, ring_port: int | None = None
) -> tuple[_Inbox, Callable[[RequestId, ChunkEvent], None]]:
    """Once the model is loaded: read the node's commands, say Ready, and give the event sender
    (which forgets a request after its last event)."""
    inbox = _Inbox()
    # What loading left (modules, the tokenizer: ~10^6 objects) never becomes garbage; frozen, the
    # collector stops walking it on every full collection while tokens are generated.
    gc.freeze()
    _settle()

    def emit(request_id: RequestId, event: ChunkEvent) -> None:
        wire.send(RequestEvent(request_id=request_id, event=event))
        if is_terminal(event):
            inbox.forget(request_id)

    threading.Thread(target=_read_commands, args=(commands, inbox), daemon=True).start()
    wire.send(
        Ready(
            model_type=loaded.model_type,
            context_length=loaded.context_length,
            pid=os.getpid(),
            ring_port=ring_port,
        )
    )
    return inbox, emit


def _read_spec(commands: Iterator[RunnerMessage]) -> RunnerSpec | None:
    """The spec from the node's first frame; None (logged) when that is not a `Start`."""
    try:
        first = next(commands, None)
    except FrameError:
        log.exception("bad first frame from the node")
        return None
    if not isinstance(first, Start):
        log.error("the node's first frame is %s, not the runner's spec", type(first).__name__)
        return None
    return first.spec


def main() -> int:
    # The node stops us by closing stdin; Ctrl-C in a terminal must not kill us mid-write.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Frames own the real stdout; anything printed by libraries goes to stderr (the node's log).
    wire = _Wire(os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, format="runner: %(message)s")

    commands = _messages(sys.stdin.buffer)
    if (spec := _read_spec(commands)) is None:
        return 2
    if spec.pipeline is not None or spec.tensor is not None:
        return _pipeline_main(spec, wire, commands)
    try:
        loaded = load_model(spec.model_path, vocab_dir=spec.vocab_dir)
    except Exception as exc:  # any load failure is reported to the node, which shows it to users
        log.exception("could not load %s", spec.model_path)
        wire.send(LoadFailed(message=f"{type(exc).__name__}: {exc}"))
        return 1
    inbox, emit = _start_serving(wire, loaded, commands)
    scheduler = Scheduler(
        loaded,
        emit=emit,
        is_cancelled=inbox.is_cancelled,
        prefill_step_size=spec.prefill_step_size,
        max_concurrent=spec.max_concurrent,
        prefix_cache=PrefixCache(spec.prefix_cache_tokens),
    )

    while _take_requests(inbox, scheduler):
        scheduler.step()
    scheduler.close()
    return 0


def _pipeline_main(spec: RunnerSpec, wire: _Wire, commands: Iterator[RunnerMessage]) -> int:
    """Pipeline or tensor mode (`node.runner.pipeline_mode`): this process drives the instance's
    other processes, one request at a time."""
    from node.runner.pipeline_mode import load_pipeline, load_tensor, run_one

    try:
        if spec.tensor is not None:
            loaded, driver = load_tensor(
                spec.model_path, followers=list(spec.tensor), vocab_dir=spec.vocab_dir
            )
        else:
            assert spec.pipeline is not None
            end, host, stages = spec.pipeline
            loaded, driver = load_pipeline(
                spec.model_path, end=end, stages=list(stages), host=host, vocab_dir=spec.vocab_dir
            )
    except Exception as exc:  # reported to the node like any load failure
        log.exception("could not load the first stage of %s", spec.model_path)
        wire.send(LoadFailed(message=f"{type(exc).__name__}: {exc}"))
        return 1
    ring = driver.listen_address
    inbox, emit = _start_serving(wire, loaded, commands, ring_port=None if ring is None else ring[1])
    try:
        while (request := inbox.pending.get()) is not None:
            run_one(
                loaded,
                driver,
                request,
                emit=emit,
                is_cancelled=inbox.is_cancelled,
                prefill_step_size=spec.prefill_step_size,
            )
            if inbox.pending.empty():
                _settle()
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
