"""The MLX side of a runner: load a model, turn one request into a stream of chunk events.

Runs on the runner process's main thread. It never talks to a pipe itself: it calls `emit` for
each event, and polls `is_cancelled` between prefill chunks and decode steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

from node.runner.formats import ChatFormat, PromptError, chat_format_for
from node.runner.stops import StopMatcher
from protocol.chat import GenerateRequest
from protocol.events import (
    ChunkEvent,
    Finish,
    FinishReason,
    GenerationError,
    PrefillProgress,
    TextDelta,
    ToolCall,
    Usage,
)

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when config.json names no context length."""

Emit = Callable[[ChunkEvent], None]


class _Cancelled(Exception):
    """Raised from the prefill progress callback to abort prefill."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    chat_format: ChatFormat
    model_type: str
    context_length: int


def load_model(path: Path, *, vocab_dir: Path | None) -> LoadedModel:
    model, tokenizer, config = cast(tuple[Any, Any, dict[str, Any]], load(str(path), return_config=True))
    model_type = str(config.get("model_type", "unknown"))
    chat_format = chat_format_for(model_type, tokenizer, vocab_dir=vocab_dir)
    # Format-specific end tokens (harmony's <|return|>, <|call|>) end generation like EOS does.
    tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(chat_format.stop_token_ids)
    context = config.get("max_position_embeddings") or config.get("max_seq_len") or DEFAULT_CONTEXT_LENGTH
    return LoadedModel(model, tokenizer, chat_format, model_type, int(context))


def _too_long(message: str) -> GenerationError:
    return GenerationError(
        error_kind="invalid_request", message=message, code="context_length_exceeded", param="messages"
    )


def generate(
    loaded: LoadedModel,
    request: GenerateRequest,
    *,
    emit: Emit,
    is_cancelled: Callable[[], bool],
    prefill_step_size: int,
) -> None:
    """Run one request to completion, emitting events; always ends with exactly one terminal event."""
    try:
        prompt = loaded.chat_format.prompt_tokens(request.messages, request.tools, request.tool_choice)
    except PromptError as exc:
        emit(GenerationError(error_kind="invalid_request", message=str(exc), param=exc.param))
        return
    n_prompt = len(prompt)
    room = loaded.context_length - n_prompt
    if room < 1:
        emit(_too_long(f"the prompt is {n_prompt} tokens; this model's context is {loaded.context_length}"))
        return
    max_tokens = request.params.max_tokens
    if max_tokens is not None and max_tokens > room:
        emit(
            _too_long(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                f"context of {loaded.context_length} tokens"
            )
        )
        return

    last_progress = -1

    def on_progress(processed: int, total: int) -> None:
        nonlocal last_progress
        if is_cancelled():
            raise _Cancelled
        if processed > last_progress:  # mlx-lm reports the end twice; send each figure once
            last_progress = processed
            emit(PrefillProgress(processed_tokens=processed, total_tokens=total))

    if request.params.seed is not None:
        mx.random.seed(request.params.seed)
    sampler = make_sampler(temp=request.params.temperature, top_p=request.params.top_p)
    parser = loaded.chat_format.new_parser(prompt)
    stops = StopMatcher(request.params.stop)
    generated = 0
    reason: FinishReason = "length"
    stopped = False
    saw_tool_call = False

    def forward(events: list[Any]) -> bool:
        """Emit parsed events, cutting visible text at a stop sequence; True once one is hit."""
        nonlocal saw_tool_call
        for event in events:
            if isinstance(event, TextDelta):
                text, hit = stops.feed(event.text)
                if text:
                    emit(TextDelta(text=text))
                if hit:
                    return True
            else:
                saw_tool_call = saw_tool_call or isinstance(event, ToolCall)
                emit(event)
        return False

    try:
        for response in stream_generate(
            loaded.model,
            loaded.tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens if max_tokens is not None else room,
            sampler=sampler,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=on_progress,
        ):
            generated += 1
            if forward(parser.feed(response.token, response.text)):
                reason, stopped = "stop", True
                break
            if response.finish_reason is not None:
                reason = "stop" if response.finish_reason == "stop" else "length"
                break
            if is_cancelled():
                reason = "cancelled"
                break
    except _Cancelled:
        reason = "cancelled"
    if reason != "cancelled" and not stopped:
        if forward(parser.flush()):
            reason = "stop"
        elif tail := stops.flush():
            emit(TextDelta(text=tail))
    if saw_tool_call and reason == "stop":
        reason = "tool_calls"
    emit(Finish(reason=reason, usage=Usage(prompt_tokens=n_prompt, completion_tokens=generated)))
