"""The MLX side of a runner: load a model, and the per-request logic of a generation.

Runs on the runner process's main thread and never talks to a pipe itself: events go out through
`emit`. `admit` turns a request into prompt tokens (or an `invalid_request` error); `RequestOutput`
turns one request's generated tokens into chunk events (detokenizer, output parser, stop strings,
exactly one terminal event); each request samples with its own `node.pipeline.shard.request_sampler`,
as a pipeline's last stage does. The batch loop that feeds many requests at once is
`node.runner.scheduler`; `generate` runs one request alone, for models whose KV cache mlx-lm cannot
batch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from node.cpu.dtype import apply_dtype_policy, rounds_to_int8
from node.models.generation_config import read_sampling_defaults
from node.pipeline.shard import LogitsProcessor, Sampler, forcing, logits_processors, request_sampler
from node.runner.formats import HARMONY_MODEL_TYPES, ChatFormat, PromptError, chat_format_for
from node.runner.parsers import ParsedEvent
from node.runner.stops import StopMatcher
from protocol.chat import GenerateRequest
from protocol.events import (
    CONTEXT_LENGTH_EXCEEDED,
    TOKEN_OUT_OF_VOCABULARY,
    ChunkEvent,
    ErrorCode,
    Finish,
    FinishReason,
    GenerationError,
    OutputEvent,
    PrefillProgress,
    TerminalEvent,
    TextDelta,
    ToolCall,
    Usage,
)
from protocol.sampling import Sampling, SamplingDefaults, resolve_sampling

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when config.json names no context length."""

Emit = Callable[[ChunkEvent], None]


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    chat_format: ChatFormat
    model_type: str
    context_length: int
    sampling: SamplingDefaults
    """The model's own defaults (its generation_config.json), under every request's fields."""
    vocab_size: int | None = None
    """Rows of the model's embedding (config.json's `vocab_size`): a prompt id at or past it would
    read outside the embedding (garbage, silently), so `admit` refuses it. None: not stated."""
    stepwise_replay: bool = False
    """Whether a resumed request's tokens are decoded again step by step (`Admitted.forced`) even
    when greedy: its products round activations to int8 (`rounds_to_int8`)."""


def load_model(path: Path, *, vocab_dir: Path | None) -> LoadedModel:
    # Lazy: the dtype policy reads each weight once, already in the dtype it will run in.
    model, tokenizer, config = cast(
        tuple[Any, Any, dict[str, Any]], load(str(path), return_config=True, lazy=True)
    )
    apply_dtype_policy(model)
    return loaded_model(model, tokenizer, config, vocab_dir=vocab_dir, folder=path)


def loaded_model(
    model: Any, tokenizer: Any, config: dict[str, Any], *, vocab_dir: Path | None, folder: Path
) -> LoadedModel:
    """The `LoadedModel` of an already loaded model (or pipeline shard) from `folder`, and its tokenizer."""
    model_type = str(config.get("model_type", "unknown"))
    chat_format = chat_format_for(model_type, tokenizer, vocab_dir=vocab_dir)
    # Format-specific end tokens (harmony's <|return|>, <|call|>) end generation like EOS does.
    tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(chat_format.stop_token_ids)
    context = config.get("max_position_embeddings") or config.get("max_seq_len") or DEFAULT_CONTEXT_LENGTH
    sampling = read_sampling_defaults(folder)
    if given := sampling.given():
        log.info("sampling defaults from %s: %s", folder.name, sampling.model_dump(include=set(given)))
    return LoadedModel(
        model,
        tokenizer,
        chat_format,
        model_type,
        int(context),
        sampling,
        vocab_size=_vocab_size(config),
        stepwise_replay=rounds_to_int8(model),
    )


def _vocab_size(config: dict[str, Any]) -> int | None:
    """config.json's `vocab_size`, or its `text_config`'s (multimodal configs nest it there)."""
    for source in (config, config.get("text_config") or {}):
        size = source.get("vocab_size") if isinstance(source, dict) else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def _outside_vocabulary(loaded: LoadedModel, prompt: Sequence[int]) -> GenerationError | None:
    """The refusal of a prompt with an id the model has no embedding row for (a tokenizer, or
    GPT-OSS's harmony vocab, that does not match the weights); None when every id fits."""
    top = max(prompt)
    if loaded.vocab_size is None or top < loaded.vocab_size:
        return None
    tokenizer = "the harmony o200k vocab" if loaded.model_type in HARMONY_MODEL_TYPES else "its tokenizer"
    return GenerationError(
        error_kind="invalid_request",
        message=(
            f"the prompt holds token id {top}, but this model's vocabulary has {loaded.vocab_size} "
            f"tokens: {tokenizer} does not match its weights"
        ),
        code=TOKEN_OUT_OF_VOCABULARY,
        param="messages",
    )


def _too_long(message: str) -> GenerationError:
    return GenerationError(
        error_kind="invalid_request", message=message, code=CONTEXT_LENGTH_EXCEEDED, param="messages"
    )


@dataclass(frozen=True)
class Admitted:
    """A request that passed the checks: its prompt tokens and how many tokens it may generate.

    A resumed request (`GenerateRequest.resume`, failover) also has the tokens it generated before.
    Most go on from a prefill of the prompt and those tokens (`context`), which `RequestOutput.replay`
    feeds to the output at once; greedy tokens then come out as they would have (a chunk's float sums
    may differ from one step's in the last bits, as in a batch: only an exact near-tie could change a
    token). A seeded request's draws amplify those bits, and int8 activations (`stepwise`) can turn
    them into a rounding step, so such a request is `forced` instead: its prompt is prefilled as
    before and those tokens are decoded again, one step each, from a sampler that draws and returns
    them (`node.pipeline.shard.forcing`): the same arithmetic, the same key, the same tokens after,
    at the cost of one decode step per token.
    """

    request: GenerateRequest
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    """The request's fields over the model's defaults over the server's (`resolve_sampling`)."""
    stepwise: bool = False
    """The model's `stepwise_replay`."""

    @property
    def replayed(self) -> tuple[int, ...]:
        return self.request.resume.tokens if self.request.resume is not None else ()

    @property
    def forced(self) -> bool:
        seeded = self.sampling.temperature > 0 and self.sampling.seed is not None
        return bool(self.replayed) and (self.stepwise or seeded)

    @property
    def context(self) -> list[int]:
        """The tokens to prefill: the prompt, then the replayed output unless it is forced."""
        return self.prompt if self.forced else self.prompt + list(self.replayed)

    @property
    def remaining(self) -> int:
        """Tokens for the generator to produce (forced ones included)."""
        return self.max_tokens if self.forced else self.max_tokens - len(self.replayed)

    def sampler(self) -> Sampler:
        sampler = request_sampler(self.sampling)
        return forcing(sampler, self.replayed) if self.forced else sampler

    def processors(self) -> list[LogitsProcessor]:
        """What runs on the logits before the sampler: the repetition penalty, if any."""
        return logits_processors(self.sampling)


def admit(loaded: LoadedModel, request: GenerateRequest) -> Admitted | TerminalEvent:
    """The prompt's tokens and the generation budget, or the event that already ends the request:
    an `invalid_request` error, or for a `count_only` request the `Finish` carrying the count."""
    try:
        prompt = loaded.chat_format.prompt_tokens(request.messages, request.tools, request.tool_choice)
    except PromptError as exc:
        return GenerationError(error_kind="invalid_request", message=str(exc), param=exc.param)
    n_prompt = len(prompt)
    if n_prompt == 0:
        return GenerationError(error_kind="invalid_request", message="the prompt is empty", param="messages")
    if request.count_only:
        return Finish(reason="stop", usage=Usage(prompt_tokens=n_prompt, completion_tokens=0))
    if (outside := _outside_vocabulary(loaded, prompt)) is not None:
        return outside
    room = loaded.context_length - n_prompt
    if room < 1:
        return _too_long(f"the prompt is {n_prompt} tokens; this model's context is {loaded.context_length}")
    max_tokens = request.params.max_tokens
    if max_tokens is not None and max_tokens > room:
        return _too_long(
            f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {loaded.context_length} tokens"
        )
    sampling = resolve_sampling(request.params, loaded.sampling)
    budget = max_tokens if max_tokens is not None else room
    return Admitted(request, list(prompt), budget, sampling, stepwise=loaded.stepwise_replay)


class RequestOutput:
    """One request's generated tokens in, its chunk events out; ends with exactly one terminal event.

    Feed each token with `token()` in order (`last=True` for the final one); `progress()` reports
    prefill; `finish()` or `fail()` ends the request (later calls do nothing). End-of-sequence
    tokens count as generated but add no text, as in mlx-lm's `stream_generate`. Each output event
    carries the token ids consumed since the previous one (`tokens`). A resumed request first
    `replay()`s the tokens its client already has.
    """

    def __init__(self, loaded: LoadedModel, admitted: Admitted, emit: Emit) -> None:
        self._emit = emit
        self._eos = frozenset(loaded.tokenizer.eos_token_ids)
        self._detokenizer = loaded.tokenizer.detokenizer
        self._parser = loaded.chat_format.new_parser(admitted.prompt)
        self._stops = StopMatcher(admitted.request.params.stop)
        self._n_prompt = len(admitted.prompt)
        self._n_context = len(admitted.context)
        self._last_progress = -1
        self._stopped = False
        self._saw_tool_call = False
        self._unsent: list[int] = []
        """Tokens consumed since the last output event: the next one carries them."""
        self._skip = 0
        """Output events still to leave out (the client has them: see `token`)."""
        self._replayed = admitted.replayed
        resume = admitted.request.resume
        self._replayed_events = resume.events if resume is not None else 0
        self.cached_tokens = 0
        """Prompt tokens whose KV came from the prefix cache (reported in the usage)."""
        self.generated = 0
        self.done = False

    def progress(self, processed: int) -> None:
        """Prefill has `processed` of the context's tokens; each figure goes out once, rising."""
        if processed > self._last_progress and not self.done:
            self._last_progress = processed
            self._emit(PrefillProgress(processed_tokens=processed, total_tokens=self._n_context))

    def replay(self, admitted: Admitted) -> FinishReason | None:
        """Feed a resumed request's earlier tokens now, unless they are `forced` (then they come
        from the generator); the reason the request ends if they already ended it (end of
        sequence, a stop string, max_tokens), else None. Their events are left out (`token`)."""
        if admitted.forced:
            return None
        for n, token in enumerate(admitted.replayed):
            eos = token in self._eos
            last = eos or n + 1 == admitted.max_tokens
            if self.token(token, last=last):
                return "stop"
            if last:
                return "stop" if eos else "length"
        return None

    def token(self, token: int, *, last: bool) -> bool:
        """Emit what one generated token adds; True when a stop string ended the request's text.

        The tokens of a resumed request's `Resume` come first: the client has their events (and
        the first `resume.events` of the last one's), so those are left out."""
        n, replayed = self.generated, len(self._replayed)
        if n < replayed:
            self._skip = self._replayed_events if n + 1 == replayed else sys.maxsize
        else:
            self._skip = 0  # a new token: whatever the client had ended with the one before
        self.generated += 1
        self._unsent.append(token)
        if token in self._eos:
            self._detokenizer.finalize()
        else:
            self._detokenizer.add_token(token)
            if last:
                self._detokenizer.finalize()
        if self._forward(self._parser.feed(token, self._detokenizer.last_segment)):
            self._stopped = True
        if n + 1 == replayed:
            self._unsent.clear()  # the client has them all
        return self._stopped

    def _forward(self, events: Sequence[ParsedEvent]) -> bool:
        """Emit parsed events, cutting visible text at a stop sequence; True once one is hit."""
        for event in events:
            if isinstance(event, TextDelta):
                text, hit = self._stops.feed(event.text)
                if text:
                    self._output(TextDelta(text=text))
                if hit:
                    return True
            else:
                self._saw_tool_call = self._saw_tool_call or isinstance(event, ToolCall)
                self._output(event)
        return False

    def _output(self, event: OutputEvent) -> None:
        """Emit an output event with the tokens it accounts for, unless the client already has it."""
        tokens, self._unsent = tuple(self._unsent), []
        if self._skip > 0:
            self._skip -= 1
            return
        self._emit(event.model_copy(update={"tokens": tokens}) if tokens else event)

    def finish(self, reason: FinishReason) -> None:
        """The terminal `Finish`: flushes held-back text unless cancelled or cut by a stop string."""
        if self.done:
            return
        if self._stopped:
            reason = "stop"
        elif reason != "cancelled":
            if self._forward(self._parser.flush()):
                reason = "stop"
            elif tail := self._stops.flush():
                self._output(TextDelta(text=tail))
        if self._saw_tool_call and reason == "stop":
            reason = "tool_calls"
        self.done = True
        usage = Usage(
            prompt_tokens=self._n_prompt,
            completion_tokens=self.generated,
            cached_tokens=min(self.cached_tokens, self._n_prompt),
        )
        stop_sequence = self._stops.matched if reason == "stop" else None
        self._emit(Finish(reason=reason, usage=usage, stop_sequence=stop_sequence))

    def fail(self, message: str, *, code: ErrorCode | None = None) -> None:
        """The terminal `server_error`, for a fault on our side."""
        if not self.done:
            self.done = True
            self._emit(GenerationError(error_kind="server_error", message=message, code=code))


class _Cancelled(Exception):
    """Raised from the prefill progress callback to abort prefill."""


def generate(
    loaded: LoadedModel,
    admitted: Admitted,
    output: RequestOutput,
    *,
    is_cancelled: Callable[[], bool],
    prefill_step_size: int,
) -> None:
    """Run one request alone to completion (models mlx-lm cannot batch); `output` gets every event."""

    def on_progress(processed: int, total: int) -> None:
        if is_cancelled():
            raise _Cancelled
        output.progress(processed)

    reason: FinishReason = "length"
    try:
        for n, (step_token, _) in enumerate(
            generate_step(
                mx.array(admitted.context),
                loaded.model,
                max_tokens=admitted.remaining,
                sampler=admitted.sampler(),
                logits_processors=admitted.processors(),
                prefill_step_size=prefill_step_size,
                prompt_progress_callback=on_progress,
            )
        ):
            token = int(step_token)  # mlx-lm yields plain ints (its annotation says arrays)
            eos = token in loaded.tokenizer.eos_token_ids
            last = eos or n + 1 == admitted.remaining
            if output.token(token, last=last):
                reason = "stop"
                break
            if last:
                reason = "stop" if eos else "length"
                break
            if is_cancelled():
                reason = "cancelled"
                break
    except _Cancelled:
        reason = "cancelled"
    output.finish(reason)
