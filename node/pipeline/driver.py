"""The first stage, which drives generation around the ring: `PipelineGenerator.generate`.

    shard = load_shard(path, start=0, end=15)
    pipeline = PipelineGenerator(shard, stages=[("10.0.0.7", 47100), ("10.0.0.8", 47100)])
    for token in pipeline.generate(prompt_tokens, max_tokens=64, eos_token_ids=eos):
        ...

`generate` yields the token ids `mlx_lm.stream_generate` would put in its responses' `.token`, in
the same order and with the same stopping rule: every sampled token, ending after the first one in
`eos_token_ids` (which is yielded, as stream_generate's last response carries it) or after
`max_tokens`. Detokenizing, stop strings and parsers stay with the caller.

It mirrors mlx-lm's `generate_step` step for step: the prompt is prefilled in chunks of
`prefill_step_size` leaving its last token, which then runs as the first decode step; progress is
reported as (0, total) at the start, (processed, total) after each chunk and (total, total) once
the first token exists. Identical chunks give identical arithmetic, hence identical greedy tokens.

Across stages, prefill is pipelined (this stage computes chunk k+1 while the next computes chunk
k, at most `MAX_CHUNKS_IN_FLIGHT` ahead) and a chunk counts as processed when the last stage
acknowledges it. Decode is a ring: the token sampled by the last stage comes back here, is
embedded and run through this stage's layers, and goes round again.

Cancellation (`is_cancelled`, polled between chunks, between steps and while waiting) ends the
generator early and sends CANCEL round the ring, which drops every stage's cache for the request;
the echo is collected before the next request starts, so the caller never waits for it. Any link
failure raises `HopError` within the hop timeout; the links are then closed, every stage drops its
caches, and the next `generate` reconnects (the links themselves are `ring.py`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from node.pipeline.frames import Frame, Kind
from node.pipeline.hop import CONNECT_TIMEOUT, HOP_TIMEOUT, HopError
from node.pipeline.link_auth import OPEN, LinkSecurity
from node.pipeline.ring import Cancelled, Ring
from node.pipeline.shard import Shard, forcing, request_sampler
from protocol.sampling import GREEDY, Sampling

MAX_CHUNKS_IN_FLIGHT = 2
"""Prefill chunks sent but not yet acknowledged: 2 keeps the next stage busy while this one works
on the following chunk, without queueing a whole prompt's activations in socket buffers."""

ProgressCallback = Callable[[int, int], None]


@dataclass
class RingStats:
    """Where a request's decode steps spent their time, from this stage's point of view.

    `ring_wait_s - remote_busy_s` is what the hops cost: serialization, TCP, thread wake-ups
    and scheduling, summed over `steps` round trips of the ring.
    """

    steps: int = 0
    ring_wait_s: float = 0.0
    """From sending a step to receiving its token."""
    remote_busy_s: float = 0.0
    """Of which the other stages spent computing and sending (each reports its own)."""
    local_s: float = 0.0
    """From receiving a token to sending the next step: this stage's layers, and the caller."""

    @property
    def hop_overhead_s(self) -> float:
        """Seconds per step spent outside any stage's work."""
        return (self.ring_wait_s - self.remote_busy_s) / self.steps if self.steps else float("nan")


class PipelineError(Exception):
    """A stage could not run a step of this request (its message says which and why)."""


class PipelineGenerator:
    """The first stage of a pipeline and the driver of its requests; one request at a time.

    `shard` holds layers [0, k) and the embedding. With k equal to the model's layer count it runs
    everything in this process (a 1-stage pipeline) and needs no network. Otherwise `stages` are
    the addresses of the other stages in layer order: it dials the first, sends the route through
    the rest, and waits for the last to connect back to `listen_address`, every link proving
    `security`'s key.
    """

    def __init__(
        self,
        shard: Shard,
        *,
        stages: Sequence[tuple[str, int]] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        hop_timeout: float = HOP_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        security: LinkSecurity = OPEN,
    ) -> None:
        if not shard.spec.is_first:
            raise ValueError("the driver must hold the first layers and the embedding")
        if shard.spec.is_last == bool(stages):
            raise ValueError("stage addresses are needed exactly when this shard is not the whole model")
        self.shard = shard
        self._ring = (
            None
            if shard.spec.is_last
            else Ring(
                stages,
                end_layer=shard.spec.end,
                num_layers=shard.spec.num_layers,
                host=host,
                port=port,
                hop_timeout=hop_timeout,
                connect_timeout=connect_timeout,
                security=security,
            )
        )
        self.listen_address: tuple[str, int] | None = (
            None if self._ring is None else self._ring.listen_address
        )
        self._requests = itertools.count(1)
        self._busy = False
        self.last_stats = RingStats()
        """Timings of the latest request's decode steps (ring pipelines only)."""

    @property
    def local(self) -> bool:
        """True when this process runs the whole model."""
        return self.shard.spec.is_last

    def connect(self) -> None:
        """Form the ring (no-op when connected or local); `HopError` if it cannot within the timeout."""
        if self._ring is not None:
            self._ring.connect()

    def disconnect(self) -> None:
        """Close the links; every other stage notices, drops its caches and waits for a new ring."""
        if self._ring is not None:
            self._ring.disconnect()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()

    def generate(
        self,
        prompt_tokens: Sequence[int] | mx.array,
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        forced: Sequence[int] = (),
        eos_token_ids: Collection[int] = (),
        prefill_step_size: int = 2048,
        progress_callback: ProgressCallback | None = None,
        is_cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """Token ids for `prompt_tokens`, as `mlx_lm.stream_generate` would produce them.

        `forced`: the first tokens to produce whatever is sampled (a seeded request resumed by
        failover decodes its earlier tokens again, one step each, so that its caches and its
        sampler, here or on the last stage, are exactly as they were). They are yielded too.
        Raises `HopError` when a link fails and `PipelineError` when a stage cannot run a step;
        exceptions from `progress_callback` propagate (after the ring is cleaned). Ends early,
        without error, once `is_cancelled()` is true.
        """
        prompt = (
            prompt_tokens.reshape(-1)
            if isinstance(prompt_tokens, mx.array)
            else mx.array(list(prompt_tokens))
        )
        if prompt.size == 0:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self._busy:
            raise RuntimeError("a PipelineGenerator runs one request at a time")
        self._busy = True
        try:
            run = self._generate_local if self.local else self._generate_ring
            yield from run(
                prompt,
                max_tokens,
                sampling or GREEDY,
                forced,
                eos_token_ids,
                prefill_step_size,
                progress_callback or _no_progress,
                is_cancelled or _never,
            )
        finally:
            self._busy = False

    def _generate_local(
        self,
        prompt: mx.array,
        max_tokens: int,
        sampling: Sampling,
        forced: Sequence[int],
        eos: Collection[int],
        step: int,
        progress: ProgressCallback,
        cancelled: Callable[[], bool],
    ) -> Iterator[int]:
        cache = self.shard.make_cache()
        sampler = forcing(request_sampler(sampling), forced)
        total = prompt.size
        progress(0, total)
        done = 0
        while total - done > 1:
            if cancelled():
                return
            n = min(step, total - done - 1)
            self.shard.prefill(prompt[done : done + n][None], cache)
            done += n
            progress(done, total)
            mx.clear_cache()
        # As mlx-lm's generate_step: the next step is queued (async_eval) before the current token
        # is read, so building and running it overlaps with the caller's work on this one.
        y = self.shard.next_token(self.shard.forward(prompt[done:][None], cache), sampler)
        mx.async_eval(y)
        produced = 0
        while True:
            next_y = None
            if produced + 1 < max_tokens:
                next_y = self.shard.next_token(self.shard.forward(y[None], cache), sampler)
                mx.async_eval(next_y)
            token = cast(int, y.item())
            produced += 1
            if produced == 1:
                progress(total, total)
            yield token
            if next_y is None or token in eos or cancelled():
                return
            y = next_y

    def _generate_ring(
        self,
        prompt: mx.array,
        max_tokens: int,
        sampling: Sampling,
        forced: Sequence[int],
        eos: Collection[int],
        step: int,
        progress: ProgressCallback,
        cancelled: Callable[[], bool],
    ) -> Iterator[int]:
        ring = self._ring
        assert ring is not None
        ring.connect()
        ring.collect_echo()
        request = next(self._requests)
        stats = self.last_stats = RingStats()
        cache = self.shard.make_cache()
        # Every field decided here (`resolve_sampling`), so the last stage samples as a runner would.
        first_meta: dict[str, Any] = {"sampling": sampling.model_dump()}
        total = prompt.size
        ending = Kind.CANCEL
        try:
            progress(0, total)
            done = in_flight = 0
            while total - done > 1:
                if cancelled():
                    return
                n = min(step, total - done - 1)
                h = self.shard.forward(prompt[done : done + n][None], cache)
                ring.send(Frame(Kind.PREFILL, request, done, h, first_meta if done == 0 else {}))
                done += n
                in_flight += 1
                mx.clear_cache()
                # Collect the acknowledgements that are in; wait only when too far ahead.
                while in_flight and (
                    frame := ring.recv(request, cancelled, block=in_flight >= MAX_CHUNKS_IN_FLIGHT)
                ):
                    progress(self._expect(frame, Kind.ACK), total)
                    in_flight -= 1
            h = self.shard.forward(prompt[done:][None], cache)
            ring.send(Frame(Kind.DECODE, request, done, h, first_meta if done == 0 else {}))
            while in_flight:
                progress(self._expect(ring.recv(request, cancelled), Kind.ACK), total)
                in_flight -= 1
            sent = 0.0
            produced = 0
            while True:
                frame = ring.recv(request, cancelled)
                self._expect(frame, Kind.TOKEN)
                if produced:  # the first step overlapped with prefill: not a plain round trip
                    stats.ring_wait_s += time.perf_counter() - sent
                    stats.remote_busy_s += sum(frame.meta.get("busy_us", ())) / 1e6
                    stats.steps += 1
                received = time.perf_counter()
                assert frame.tensor is not None
                token = forced[produced] if produced < len(forced) else cast(int, frame.tensor.item())
                produced += 1
                if produced == 1:
                    progress(total, total)
                more = produced < max_tokens and token not in eos
                if more:
                    # Run this stage's part of the next step while the caller handles this token.
                    h = self.shard.forward(mx.array([[token]]), cache)
                    mx.async_eval(h)
                else:
                    ending = Kind.RESET
                yield token
                if not more or cancelled():
                    return
                ring.send(Frame(Kind.DECODE, request, total + produced - 1, h))
                sent = time.perf_counter()
                stats.local_s += sent - received
        except Cancelled:
            return
        except HopError:
            ring.disconnect()
            raise
        finally:
            ring.end(request, ending)

    @staticmethod
    def _expect(frame: Frame, kind: Kind) -> int:
        if frame.kind == Kind.ERROR:
            raise PipelineError(str(frame.meta.get("message", "a stage failed")))
        if frame.kind != kind:
            raise HopError(f"expected {kind.name} from the last stage, got {frame.kind.name}")
        return frame.position


def _no_progress(processed: int, total: int) -> None:
    pass


def _never() -> bool:
    return False
