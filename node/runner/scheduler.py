"""The runner's batch loop: concurrent requests to one model decoded together (continuous batching).

It wraps mlx-lm's `BatchGenerator`, which keeps one batch of sequences in decode and prefills new
prompts in chunks between decode steps; requests join and leave the batch between steps. Each
`step()` of the loop:

1. ends cancelled requests, waiting or running, with `Finish(cancelled)`; a running one leaves the
   batch and what it computed goes into the prefix cache;
2. admits waiting requests while fewer than `max_concurrent` run: the prefix cache gives the KV of
   the longest known prefix of the prompt, and only the rest goes into the generator;
3. runs one `BatchGenerator.next()`: one decode step for every running request past its prefill,
   and one prefill chunk (`prefill_step_size` tokens) of one prompt (prompts are prefilled one at a
   time: a chunk of one prompt is already a large matrix product on a CPU);
4. hands every token to its request's `RequestOutput` (parser, stop strings, events); a request
   that ends leaves the batch and stores its KV (prompt plus generated tokens) in the prefix cache.

Every request has its own sampler (a seeded one its own PRNG key), max_tokens and end-of-sequence
check, and the rows of a batched decode step never mix: padding positions of shorter sequences are
masked out of attention, greedy sampling is a per-row argmax, and the fast path's matrix kernel sums
each row of a linear layer in the same order whatever the batch. So a greedy stream gets the tokens
it gets alone. One caveat, measured: the masked padding still shifts the blocks in which attention's
sums are added up, so a padded row's log-probs can differ from its solo run in the last float32 bits
(up to ~3e-5 on SmolLM2), which could change a greedy token only on an exact near-tie; in the tests
and benchmarks no stream ever differed. Cancelling a request only removes its row.

Models whose KV cache mlx-lm cannot batch (a cache type without `merge`) run one request at a time
through `engine.generate`, without the prefix cache.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from node.runner.engine import Admitted, LoadedModel, RequestOutput, admit, generate
from node.runner.prefix_cache import PrefixCache
from protocol.chat import GenerateRequest
from protocol.events import ChunkEvent, FinishReason, GenerationError
from protocol.ids import RequestId

log = logging.getLogger("shoal.runner")

EmitFor = Callable[[RequestId, ChunkEvent], None]


def can_batch(model: Any) -> bool:
    """Whether mlx-lm can merge this model's KV caches into one batch (what `mlx_lm.server` checks)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass
class _Running:
    uid: int
    admitted: Admitted
    output: RequestOutput

    @property
    def request_id(self) -> RequestId:
        return self.admitted.request.request_id


class Scheduler:
    """Owns the batch. `submit` and `step` are called from the runner's main thread only."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        emit: EmitFor,
        is_cancelled: Callable[[RequestId], bool],
        prefill_step_size: int,
        max_concurrent: int,
        prefix_cache: PrefixCache,
    ) -> None:
        self._loaded = loaded
        self._emit = emit
        self._is_cancelled = is_cancelled
        self._prefill_step_size = prefill_step_size
        self._max_concurrent = max(1, max_concurrent)
        self.prefix_cache = prefix_cache
        self.batchable = can_batch(loaded.model)
        self._eos = StopSequences([[token] for token in sorted(loaded.tokenizer.eos_token_ids)])
        self._waiting: deque[tuple[Admitted, RequestOutput]] = deque()
        self._running: dict[int, _Running] = {}
        self._generator: BatchGenerator | None = self._new_generator() if self.batchable else None
        if not self.batchable:
            log.info("this model's KV cache cannot be batched: one request at a time, no prefix cache")

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._loaded.model,
            completion_batch_size=self._max_concurrent,
            prefill_batch_size=1,
            prefill_step_size=self._prefill_step_size,
        )

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, request: GenerateRequest) -> None:
        """Queue a request; a bad one gets its `invalid_request` error at once, a good one (0, total)."""
        emit = functools.partial(self._emit, request.request_id)
        try:
            admitted = admit(self._loaded, request)
            if not isinstance(admitted, Admitted):
                emit(admitted)
                return
            output = RequestOutput(self._loaded, admitted, emit)
            output.progress(0)
            if (ended := output.replay(admitted)) is not None:
                output.finish(ended)
                return
        except Exception as exc:  # a fault in one request fails that request, not the runner
            log.exception("request %s failed", request.request_id)
            emit(GenerationError(error_kind="server_error", message=f"generation failed: {exc}"))
            return
        self._waiting.append((admitted, output))

    def step(self) -> None:
        """One turn of the loop (see the module docstring); returns quickly when idle."""
        try:
            self._end_cancelled()
            if not self.batchable:
                self._run_one()
                return
            self._admit()
            if self._running:
                self._advance()
        except Exception as exc:  # a fault fails the batch, not the runner
            log.exception("batch step failed; failing its %d requests", len(self._running))
            for running in self._running.values():
                running.output.fail(f"generation failed: {exc}")
            self._running.clear()
            if self._generator is not None:
                self._generator.close()
                self._generator = self._new_generator()

    def close(self) -> None:
        """Cancel everything still queued or running (the node went away) and free the generator."""
        for _, output in self._waiting:
            output.finish("cancelled")
        self._waiting.clear()
        self._remove(list(self._running.values()), "cancelled")
        if self._generator is not None:
            self._generator.close()

    # --- the batch -------------------------------------------------------------------------
    def _end_cancelled(self) -> None:
        if any(self._is_cancelled(a.request.request_id) for a, _ in self._waiting):
            keep: deque[tuple[Admitted, RequestOutput]] = deque()
            for admitted, output in self._waiting:
                if self._is_cancelled(admitted.request.request_id):
                    output.finish("cancelled")
                else:
                    keep.append((admitted, output))
            self._waiting = keep
        cancelled = [r for r in self._running.values() if self._is_cancelled(r.request_id)]
        if cancelled:
            self._remove(cancelled, "cancelled")

    def _admit(self) -> None:
        assert self._generator is not None
        while self._waiting and len(self._running) < self._max_concurrent:
            admitted, output = self._waiting.popleft()
            try:
                prompt = admitted.context
                cache, cached = self.prefix_cache.fetch(prompt)
                (uid,) = self._generator.insert(
                    [prompt[cached:]],
                    max_tokens=[admitted.remaining],
                    caches=[cache] if cache is not None else None,
                    all_tokens=[prompt[:cached]],
                    samplers=[admitted.sampler()],
                    logits_processors=[admitted.processors()],
                    stop_sequences=[self._eos],
                )
            except Exception as exc:  # a fault in one request fails that request, not the batch
                log.exception("request %s failed", admitted.request.request_id)
                output.fail(f"generation failed: {exc}")
                continue
            output.cached_tokens = cached
            output.progress(cached)
            self._running[uid] = _Running(uid, admitted, output)

    def _advance(self) -> None:
        assert self._generator is not None
        prompt_responses, responses = self._generator.next()
        for progress in prompt_responses:
            if (prefilling := self._running.get(progress.uid)) is not None:
                prefilling.output.progress(prefilling.output.cached_tokens + progress.progress[0])
        stopped: list[_Running] = []
        for response in responses:
            running = self._running.get(response.uid)
            if running is None:
                continue
            last = response.finish_reason is not None
            hit_stop = running.output.token(response.token, last=last)
            if last:  # the generator already took it out of the batch
                del self._running[response.uid]
                self._store(response.all_tokens, response.prompt_cache, running)
                running.output.finish("stop" if response.finish_reason == "stop" else "length")
            elif hit_stop:
                stopped.append(running)
        if stopped:
            self._remove(stopped, "stop")

    def _remove(self, entries: Sequence[_Running], reason: FinishReason) -> None:
        """Take requests out of the batch, keep what they computed, and end them."""
        if self._generator is not None and entries:
            caches = self._generator.remove(
                [r.uid for r in entries], return_prompt_caches=self.prefix_cache.enabled
            )
            for running in entries:
                if running.uid in caches:
                    cache, tokens = caches[running.uid]
                    self._store(tokens, cache, running)
        for running in entries:
            self._running.pop(running.uid, None)
            running.output.finish(reason)

    def _store(self, tokens: list[int] | None, cache: list[Any] | None, running: _Running) -> None:
        """Keep a sequence's KV for later requests, if it computed anything beyond its cache hit."""
        if not self.prefix_cache.enabled or tokens is None or cache is None:
            return
        if len(tokens) <= running.output.cached_tokens:
            return
        mx.eval([c.state for c in cache])  # a slice of the batch's cache; don't keep the batch alive
        self.prefix_cache.insert(tokens, cache)

    # --- one at a time -----------------------------------------------------------------------
    def _run_one(self) -> None:
        if not self._waiting:
            return
        admitted, output = self._waiting.popleft()
        request_id = admitted.request.request_id
        try:
            generate(
                self._loaded,
                admitted,
                output,
                is_cancelled=functools.partial(self._is_cancelled, request_id),
                prefill_step_size=self._prefill_step_size,
            )
        except Exception as exc:  # a fault in one generation fails that request, not the runner
            log.exception("generation %s failed", request_id)
            output.fail(f"generation failed: {exc}")
